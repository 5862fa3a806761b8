"""`--policy gru` in the real stream (Tansu + Redis + a real exported Astec predictor): every
event gets a query from its user's window (the page's top query on a first visit), each visit's
stored state holds the query published for it (what the policy reads at later visits), and a
newly promoted GRU version is picked up while the worker runs (a corrupt one is refused)."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from personalization.artifact import WEIGHTS
from personalization.train import TrainConfig, publish, train_policy
from stream.model_handle import ModelHandle
from stream.policy_handle import make_policy
from stream.schemas import decode
from stream.state_store import StateStore, connect
from stream.topics import make_consumer
from stream.worker import StreamWorker
from testkit.stream_run import produce_views

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gru_weights(astec_predictor, tmp_path_factory):
    """A GRU trained (2 epochs) on simulator logs over the stream test corpus."""
    from engine.predictor import Predictor
    from personalization.visits import load_visits
    from simulator.traffic import LogSettings, simulate_logs
    from simulator.world import world_from_dataset
    from testkit.paths import STREAM_DATA

    d = tmp_path_factory.mktemp("gru-stream")
    world = world_from_dataset(STREAM_DATA, n_users=100, seed=5)
    simulate_logs(world, d / "logs", LogSettings(days=2, seed=5))
    pred = Predictor.load(astec_predictor)
    v = load_visits(d / "logs", pred, k=10)
    cfg = TrainConfig(epochs=2, threads=1)
    w, report = train_policy(
        v, pred.classifier_rows(np.arange(pred.num_labels)), cfg, progress=False
    )
    return w, report, cfg


def _views(titles, n, users, tag):
    return [
        {
            "event_id": f"{tag}-{i}",
            "user_id": f"{tag}-u{i % users}",
            "ts": time.time() + i,
            "url": f"https://example.org/{i}",
            "title": titles[(7 * i) % len(titles)],
        }
        for i in range(n)
    ]


def _read(settings, n, timeout=90.0):
    c = make_consumer(settings, [settings.topics.ad_queries], None)
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            out.extend(decode("ad_query", r.value, 1 << 20) for r in recs)
    c.close()
    return out


def test_gru_policy_in_the_stream_with_hot_reload(
    stream_settings, astec_predictor, stream_corpus, gru_weights, tmp_path
):
    s = stream_settings
    w, report, cfg = gru_weights
    root = tmp_path / "gru"
    v1, _ = publish(root, w, cfg, {"train": report})
    # greedy here (exploration is tested in test_personalization_policy): what is served must be
    # the policy's own top choice, with every candidate it ranked logged beside it; the stream's
    # registry watcher follows the GRU registry (the same rule as the engine model's)
    policy = make_policy("gru", root, epsilon=0.0, settings=s, check_every_s=0.1)
    worker = StreamWorker(s, ModelHandle.open(astec_predictor), policy, "w-gru")
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    tag = uuid.uuid4().hex[:6]
    try:
        msgs = _views(stream_corpus[0], 120, users=12, tag=tag)
        produce_views(s, msgs)
        ads = _read(s, len(msgs))
        assert worker.policy.version == v1
        w2 = dict(w, **{"mlp.b2": w["mlp.b2"] + 0.5})
        v2, _ = publish(root, w2, cfg, {"train": report})
        time.sleep(0.5)
        produce_views(s, _views(stream_corpus[0], 10, users=2, tag=tag + "b"))
        more = _read(s, len(msgs) + 10)
        reloaded = worker.policy.version
        v3, p3 = publish(root, w, cfg, {"train": report})
        (p3 / WEIGHTS).write_bytes(b"not a safetensors file")
        time.sleep(0.5)
        produce_views(s, _views(stream_corpus[0], 10, users=2, tag=tag + "c"))
        _read(s, len(msgs) + 20)
        after_corrupt = worker.policy.version
    finally:
        worker.stop()
        t.join(30)
    assert {a["event_id"] for a in ads} == {m["event_id"] for m in msgs}
    assert all(a["policy"] == "gru" for a in more)
    # each visit's stored state holds the query the stream published for it
    store = StateStore.from_settings(connect(s.redis.url.reveal()), s)
    users = sorted({m["user_id"] for m in msgs})
    stored = {st.event_id: st.shown for h in store.histories(users) for st in h}
    published = {a["event_id"]: a["query_id"] for a in ads}
    assert stored == published and all(q >= 0 for q in published.values())
    # each ad logs the candidates the GRU ranked (the union of the window's top-k: more than one
    # page's k once a user has history), best first; greedy serving shows the first, with
    # propensity 1, and the logged scores are the policy's, in its order
    for a in ads:
        assert a["query_id"] == a["candidate_ids"][0] and a["propensity"] == 1.0
        assert not a["explored"] and len(a["candidate_scores"]) == len(a["candidate_ids"])
        assert a["candidate_scores"] == sorted(a["candidate_scores"], reverse=True)
    assert any(len(a["candidate_ids"]) > 10 for a in ads)  # the window, not just the page
    assert reloaded == v2 and after_corrupt == v2 and v3 != v2
    assert list(policy.refused) == [v3] and worker.metrics.snapshot()["refused_versions"] == 1
