"""A new engine whose label ids moved, promoted under a running stream (real Kafka + Redis, real
Astec predictors): no ad is ever chosen through the old id mapping. Until a policy trained on the
new engine is promoted every page gets its own top query under the new engine (one error line,
the consumer metric `refused_versions`); then the GRU serves again, reading only the states
written under the new engine."""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from engine.manifest import label_space_of
from engine.predictor import Predictor
from engine.registry import Registry
from personalization.train import TrainConfig, publish
from stream.model_handle import ModelHandle
from stream.policy_handle import make_policy
from stream.schemas import decode
from stream.topics import make_consumer
from stream.worker import StreamWorker
from testkit.astec_cli import astec
from testkit.paths import STREAM_DATA
from testkit.policy_data import policy_weights
from testkit.stream_run import produce_views

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def permuted_predictor(tmp_path_factory) -> tuple[str, np.ndarray]:
    """(predictor dir, perm) of an engine trained on tests/data/stream with its labels in
    another order: its label j is the fixture engine's label perm[j]."""
    d = tmp_path_factory.mktemp("permuted")
    src = Path(STREAM_DATA)
    names = (src / "labels.txt").read_text(encoding="utf-8").split("\n")[:-1]
    perm = np.random.default_rng(3).permutation(len(names))
    new_id = np.argsort(perm)  # fixture id a -> permuted id new_id[a]
    (d / "labels.txt").write_text("".join(names[p] + "\n" for p in perm), encoding="utf-8")
    lines = []
    for line in (src / "train.tsv").read_text(encoding="utf-8").splitlines():
        text, ids = line.split("\t")
        lines.append(text + "\t" + ",".join(str(new_id[int(a)]) for a in ids.split(",")))
    (d / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    astec("train", "--train", str(d / "train.tsv"), "--labels", str(d / "labels.txt"),
          "--out", str(d / "model"), "--threads", "1", "--quiet")  # fmt: skip
    astec("export", "--model", str(d / "model"), "--out", str(d / "predictor"), "--threads", "1")
    return str(d / "predictor"), perm


def promote_engine(root: Path, predictor_dir: str) -> str:
    """A registry version holding a copy of the predictor, promoted; returns its id."""
    reg = Registry(root)
    st = reg.stage()
    shutil.copytree(predictor_dir, st.path / "predictor")
    reg.commit(st, {"kind": "astec"})
    reg.promote(st.version)
    return st.version


def permute_policy(w: dict[str, np.ndarray], perm: np.ndarray) -> dict[str, np.ndarray]:
    """The same policy over the permuted engine's ids (its query-indexed tensors reordered):
    what training it on the new engine's states would index the same way."""
    out = dict(w)
    out["query_table"], out["log_pop"] = w["query_table"][perm], w["log_pop"][perm]
    out["sim_table"] = np.concatenate([w["sim_table"][perm], w["sim_table"][-1:]])
    return out


def views(titles, n, users, tag, t0):
    return [
        {
            "event_id": f"{tag}-{i}",
            "user_id": f"u{i % users}-{tag[:6]}",
            "ts": t0 + 10.0 * i,
            "url": f"https://example.org/{i}",
            "title": titles[(7 * i) % len(titles)],
        }
        for i in range(n)
    ]


def read_ads(settings, event_ids: set[str], timeout=90.0) -> dict[str, dict]:
    c = make_consumer(settings, [settings.topics.ad_queries], None)
    out: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while not event_ids <= out.keys() and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            for r in recs:
                a = decode("ad_query", r.value, 1 << 20)
                out[a["event_id"]] = a
    c.close()
    return {e: out[e] for e in event_ids if e in out}


def test_new_engine_with_moved_label_ids_never_serves_through_the_old_mapping(
    stream_settings, astec_predictor, permuted_predictor, stream_corpus, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="stream.policy_handle")
    s = stream_settings
    perm_dir, perm = permuted_predictor
    pred_a, pred_b = Predictor.load(astec_predictor), Predictor.load(perm_dir)
    assert label_space_of(pred_a) != label_space_of(pred_b)
    assert [pred_b.label_names[j] for j in range(5)] == [pred_a.label_names[p] for p in perm[:5]]
    engines, grus = tmp_path / "models", tmp_path / "models" / "gru"
    promote_engine(engines, astec_predictor)
    w_a = policy_weights(pred_a)
    cfg = TrainConfig(hidden=8, query_dim=4, mlp_hidden=8)
    pol_a, _ = publish(grus, w_a, cfg, {"engine_label_space": label_space_of(pred_a)})
    handle = ModelHandle.open(engines, check_every_s=0.1)
    policy = make_policy("gru", grus, epsilon=0.0, settings=s, check_every_s=0.1, engine=handle)
    worker = StreamWorker(s, handle, policy, "w-coherence")
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    tag, titles, t0 = uuid.uuid4().hex, stream_corpus[0], time.time()
    metric = f"{s.redis.key_prefix}:metrics:consumer:w-coherence"
    try:
        before = views(titles, 60, 10, tag + "a", t0)
        produce_views(s, before)
        ads_a = read_ads(s, {m["event_id"] for m in before})
        engine_b = promote_engine(engines, perm_dir)
        time.sleep(0.5)
        during = views(titles[3:], 60, 10, tag + "b", t0 + 1000)
        produce_views(s, during)
        ads_b = read_ads(s, {m["event_id"] for m in during})
        time.sleep(s.ops.metrics_interval_s + 1.0)
        refused_metric = int(worker.redis.hget(metric, "refused_versions") or 0)
        refused = dict(policy.refused)
        pol_b, _ = publish(
            grus, permute_policy(w_a, perm), cfg, {"engine_label_space": label_space_of(pred_b)}
        )
        time.sleep(0.5)
        after = views(titles[5:], 60, 10, tag + "c", t0 + 2000)
        produce_views(s, after)
        ads_c = read_ads(s, {m["event_id"] for m in after})
        refused_after = dict(policy.refused)
    finally:
        worker.stop()
        t.join(30)
    assert len(ads_a) == len(before) and len(ads_b) == len(during) and len(ads_c) == len(after)
    assert any(
        len(a["candidates"]) > s.prediction.top_k for a in ads_a.values()
    )  # the GRU's window
    # engine B under policy A: every page gets its own top query under engine B, nothing else
    top_b = pred_b.predict([m["title"] for m in during], s.prediction.top_k)[0]
    for m, ids in zip(during, top_b, strict=True):
        a = ads_b[m["event_id"]]
        assert a["model_version"] == engine_b and a["query"] == pred_b.label_names[ids[0]]
        assert a["propensity"] == 1.0 and len(a["candidates"]) <= s.prediction.top_k
        assert a["source_visits_ago"] == 0 and a["source_event_id"] == m["event_id"]
        assert a["margin"] == 0.0  # the page's own top query
    assert list(refused) == [pol_a] and "label space" in refused[pol_a] and refused_metric == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "label" in r.message]
    assert len(errors) == 1 and engine_b in errors[0].message
    # policy B (engine B's ids) serves again, from the states written under engine B only:
    # every candidate is among engine B's queries for the user's pages since the switch
    assert refused_after == {} and pol_b != pol_a
    assert any("serving it again" in r.message for r in caplog.records)
    seen: dict[str, set[str]] = {}
    user_of = {m["event_id"]: m["user_id"] for m in during + after}
    titles_b = [m["title"] for m in during + after]
    wide = pred_b.predict(titles_b, 2 * s.prediction.top_k)[
        0
    ]  # twice top_k: no near-tie at the edge
    for i, (m, ids) in enumerate(zip(during + after, wide, strict=True)):
        seen.setdefault(m["user_id"], set()).update(pred_b.label_names[j] for j in ids)
        if i >= len(during):
            a = ads_c[m["event_id"]]
            assert a["model_version"] == engine_b and a["policy"] == "gru"
            assert set(a["candidates"]) <= seen[m["user_id"]], m["event_id"]
            # where the query came from: one of the user's visits under engine B, and the
            # greedy policy's probability of it is at least that of the page's top query
            assert user_of[a["source_event_id"]] == m["user_id"] and a["margin"] >= 0.0
    assert any(
        len(a["candidates"]) > s.prediction.top_k for a in ads_c.values()
    )  # the window again
