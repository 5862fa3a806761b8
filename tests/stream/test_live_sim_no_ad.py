"""`astec stream simulate` on the real services: a page the model knows no word of gets no ad
by design and is reported as no_ad, apart from a true unanswered, and is not waited for; a
scenario's fatigue reaches the live click responder."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from simulator.scenario import load_scenario
from stream.live_sim import ClickResponder, run_simulation
from stream.model_handle import ModelHandle
from stream.policy_handle import Top1Policy
from stream.worker import StreamWorker
from testkit.corpora import KnnPredictor

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]


class VocabKnn(KnnPredictor):
    """The reference model with the engine predictor's has_evidence: a title is known when
    its TF-IDF vector has any word of the model's vocabulary."""

    def has_evidence(self, texts):
        return np.diff(self.vec.transform(list(texts)).indptr) > 0


def test_pages_without_a_known_word_count_as_no_ad(stream_settings, tmp_path):
    from simulator.world import generate_world, save_world

    w = generate_world(500, 1000, 100, seed=0)
    # a fifth of the pages get titles of words no page the model learned from has
    rng = np.random.default_rng(0)
    strange = set(rng.choice(w.n_pages, w.n_pages // 5, replace=False).tolist())
    w.page_title = [f"zqxv{p} wqqz{p}" if p in strange else t for p, t in enumerate(w.page_title)]
    save_world(w, tmp_path / "world")
    labels = [
        w.link_query[w.link_indptr[p] : w.link_indptr[p + 1]].tolist() for p in range(w.n_pages)
    ]
    keep = [p for p in range(w.n_pages) if labels[p] and p not in strange]
    knn = VocabKnn(
        [w.page_title[p] for p in keep], [labels[p] for p in keep], w.query_text, version="v"
    )
    assert not knn.has_evidence([w.page_title[p] for p in strange]).any()
    worker = StreamWorker(
        stream_settings, ModelHandle.open(tmp_path, loader=lambda p: knn), Top1Policy(), "w-na"
    )
    wt = threading.Thread(target=worker.run, daemon=True)
    wt.start()
    t0 = time.monotonic()
    try:
        rep = run_simulation(
            stream_settings,
            str(tmp_path / "world"),
            rate=200,
            duration=2,
            seed=1,
            progress=False,
            warmup_s=1,
            drain_s=90,
            known=knn.has_evidence,
        )
        took = time.monotonic() - t0
    finally:
        worker.stop()
        wt.join(30)
    assert rep["page_views"] == 600
    assert rep["no_ad"] > 20  # about a fifth of the views, all without an ad by design
    assert rep["unanswered"] == 0
    assert rep["ad_queries"] + rep["no_ad"] == 600
    # the views left without an ad by design are not waited for: the 90 s drain is not run out
    assert took < 60, took


def test_the_responder_tires_users_of_a_repeated_query(stream_settings):
    from simulator.world import generate_world

    w = generate_world(300, 500, 20, seed=1)
    sc = load_scenario("fatigue")
    r = ClickResponder(stream_settings, w, {}, 0, "t", sc)
    try:
        q = np.array([3, 4, 3, 5, 6, 7, 8, 9, 3], np.int64)
        f = r._tired(["u"] * len(q), q)
    finally:
        r.consumer.close(autocommit=False)
        r.producer.close(timeout=5)
    factor = sc.click.fatigue.factor
    # the third ad repeats the first (within 5); the last is 6 ads after the previous 3
    assert f.tolist() == [1, 1, factor, 1, 1, 1, 1, 1, 1]
