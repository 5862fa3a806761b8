"""The worker's stages alone (no broker, no Redis): each drops the events it fails on to the dead
letters with a reason naming the stage and lets the rest of the batch through; and the one
registry watcher behind both hot-reloaded artefacts refuses a bad version once, keeps the old."""

from __future__ import annotations

import json
import logging
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest

from personalization.policy import Served
from stream.batch_stages import (
    Batch,
    Outbox,
    choose_stage,
    decode_stage,
    emit_stage,
    predict_stage,
    state_stage,
)
from stream.policy_handle import Top1Policy
from stream.registry_watch import RegistryWatcher
from stream.schemas import decode, encode

Record = namedtuple("Record", "topic partition offset key value")
K = 3


def records(n, bad=()):
    out = []
    for i in range(n):
        msg = {
            "event_id": f"e{i}",
            "user_id": f"u{i % 2}",
            "ts": 1.7e9 + i,
            "url": f"https://example.org/{i}",
            "title": f"page {i}",
        }
        out.append(Record("pv", 0, i, b"k", b"{oops" if i in bad else encode("page_view", msg)))
    return out


def outbox():
    sent = []
    return Outbox(lambda topic, key, value: sent.append((topic, value)), "dl", "w-test"), sent


def reasons(sent):
    return {
        decode("dead_letter", v, 1 << 20)["offset"]: decode("dead_letter", v, 1 << 20)["reason"]
        for t, v in sent
        if t == "dl"
    }


@dataclass
class Model:
    """A predictor handle whose predictor fails on titles named in `fail` (alone or batched)."""

    fail: tuple = ()
    version: str = "m1"

    @property
    def predictor(self):
        return self

    label_names = tuple(f"q{i}" for i in range(10))
    refused: tuple = ()

    def maybe_reload(self):
        return False

    def predict_with_features(self, titles, k):
        if any(t in self.fail for t in titles):
            raise RuntimeError("bad title")
        n = len(titles)
        ids = np.tile(np.arange(k), (n, 1))
        scores = np.tile(np.linspace(0.9, 0.1, k), (n, 1))
        return ids, scores, np.ones((n, 4))


def decoded(n, bad=()):
    b, (out, sent) = Batch(records(n, bad)), outbox()
    decode_stage(b, out, max_bytes=4096)
    return b, out, sent


def test_decode_dead_letters_bad_records_and_keeps_the_rest():
    b, out, sent = decoded(5, bad={1, 3})
    assert [m["event_id"] for m in b.msgs] == ["e0", "e2", "e4"] and len(b) == 3
    assert out.dead == 2 and set(reasons(sent)) == {1, 3}
    assert all("not JSON" in r for r in reasons(sent).values())


def test_predict_falls_back_to_event_by_event_and_drops_only_the_failing_event():
    b, out, sent = decoded(4)
    predict_stage(b, out, model=Model(fail=("page 2",)), top_k=K)
    assert [m["event_id"] for m in b.msgs] == ["e0", "e1", "e3"]
    assert b.ids.shape == (3, K) and b.z.shape == (3, 4) and b.model_version == "m1"
    assert reasons(sent)[2].startswith("predict failed: RuntimeError: bad title")


def test_state_drops_events_redis_refused_and_counts_duplicates():
    b, out, sent = decoded(4)
    predict_stage(b, out, model=Model(), top_k=K)
    calls = []

    def append(user_ids, states, with_history):
        calls.append((user_ids, with_history))
        fresh = [True, False, True, True]  # e1 was stored before (a replay)
        errors = [None, None, "Redis: ResponseError: refused", None]
        return fresh, [[st] for st in states], errors

    state_stage(b, out, append=append, with_history=True)
    assert calls == [(["u0", "u1", "u0", "u1"], True)]  # one call for the whole batch
    assert [s.event_id for s in b.states] == ["e0", "e1", "e3"] and len(b.hists) == 3
    assert b.duplicates == 1 and reasons(sent) == {2: "Redis: ResponseError: refused"}


def test_choose_falls_back_to_event_by_event_and_emit_sends_one_ad_query_per_event():
    b, out, sent = decoded(3)
    predict_stage(b, out, model=Model(), top_k=K)
    b.states, b.hists = [None, "poison", None], [[], [], []]

    class Picky:  # fails on a batch holding the poisoned state
        name, needs_history, version, refused = "picky", False, "p1", {}

        def serve_batch(self, h, states, ids, scores):
            if "poison" in states:
                raise ValueError("poisoned state")
            return Top1Policy().serve_batch(h, states, ids, scores)

        def maybe_reload(self):
            return False

    choose_stage(b, out, policy=Picky())
    assert b.query.tolist() == [0, 0] and [m["event_id"] for m in b.msgs] == ["e0", "e2"]
    assert reasons(sent)[1].startswith("policy failed: ValueError: poisoned state")
    b.query[1] = -1  # a page without a query: answered, nothing sent
    emit_stage(b, out, topic="ads", policy_name="picky")
    ads = [decode("ad_query", v, 1 << 20) for t, v in sent if t == "ads"]
    assert [a["event_id"] for a in ads] == ["e0"] and b.no_query == 1
    assert ads[0]["query"] == "q0" and ads[0]["candidates"] == ["q0", "q1", "q2"]
    assert ads[0]["model_version"] == "m1" and ads[0]["policy"] == "picky"
    assert b.answered_ts == [1.7e9, 1.7e9 + 2]


def test_an_event_that_cannot_be_emitted_is_dead_lettered_by_the_emit_stage():
    b, out, sent = decoded(2)
    predict_stage(b, out, model=Model(), top_k=K)
    b.states, b.hists = [None, None], [[], []]
    choose_stage(b, out, policy=Top1Policy())
    del b.served[1]["candidate_ids"]  # a policy's log fields without the candidates
    emit_stage(b, out, topic="ads", policy_name="top1")
    assert [decode("ad_query", v, 1 << 20)["event_id"] for t, v in sent if t == "ads"] == ["e0"]
    assert reasons(sent)[1] == "emit failed: KeyError: 'candidate_ids'"


def test_served_fields_survive_keep():
    sv = Top1Policy().serve_batch(None, None, np.array([[1, 2], [3, 4]]), np.ones((2, 2)))
    assert isinstance(sv, Served)
    b = Batch([1, 2], msgs=[{}, {}], query=sv.query, served=[sv.fields(0), sv.fields(1)])
    b.keep([1])
    assert b.query.tolist() == [3] and b.served[0]["query_id"] == 3 and b.records == [2]


# ---- the registry watcher -----------------------------------------------------------------
def promote(root, version, ok=True):
    d = root / "versions" / version
    d.mkdir(parents=True)
    (d / "version.json").write_text("{}")
    (d / "artefact").write_text("good" if ok else "corrupt")
    (root / "CURRENT").write_text(json.dumps({"version": version}))


def test_watcher_refuses_a_bad_version_once_and_keeps_the_old(tmp_path, caplog):
    loads = []

    def load(vdir):
        loads.append(vdir.name)
        if (vdir / "artefact").read_text() != "good":
            raise ValueError(f"{vdir / 'artefact'}: corrupt")
        return vdir.name

    promote(tmp_path, "v1")
    w = RegistryWatcher(tmp_path, load, "thing", check_every_s=0.0)
    assert w.open() == "v1" and w.version == "v1"
    assert w.poll() is None  # nothing new
    promote(tmp_path, "v2", ok=False)
    with caplog.at_level(logging.ERROR):
        for _ in range(5):
            assert w.poll() is None
    assert w.version == "v1" and list(w.refused) == ["v2"] and "corrupt" in w.refused["v2"]
    assert loads == ["v1", "v2"]  # the refused version was not loaded again on later polls
    assert len([r for r in caplog.records if "v2 refused" in r.message]) == 1
    promote(tmp_path, "v3")
    assert w.poll() == "v3" and w.version == "v3" and w.reloads == 1


def test_watcher_polls_at_most_every_check_interval_and_survives_a_torn_pointer(tmp_path, caplog):
    promote(tmp_path, "v1")
    w = RegistryWatcher(tmp_path, lambda d: d.name, "thing", check_every_s=3600)
    w.open()
    promote(tmp_path, "v2")
    assert w.poll() is None and w.poll(force=True) == "v2"
    (tmp_path / "CURRENT").write_text("{torn")
    with caplog.at_level(logging.ERROR):
        assert w.poll(force=True) is None and w.poll(force=True) is None
    assert w.version == "v2"
    assert len([r for r in caplog.records if "unreadable" in r.message]) == 1


def test_watcher_open_without_a_promoted_version_names_the_file(tmp_path):
    (tmp_path / "versions").mkdir()
    with pytest.raises(FileNotFoundError, match="CURRENT: no promoted thing version yet"):
        RegistryWatcher(tmp_path, lambda d: d, "thing").open()


# ---- the worker with injected clients -------------------------------------------------------
class Future:
    is_done = True

    def get(self, timeout=None):
        return None


class Producer:
    def __init__(self):
        self.sent = []

    def send(self, topic, key=None, value=None):
        self.sent.append((topic, value))
        return Future()


class Consumer:
    def __init__(self):
        self.commits = []

    def commit(self, offsets):
        self.commits.append({tp.partition: o.offset for tp, o in offsets.items()})


def test_worker_runs_its_stages_on_injected_clients_and_commits_settled_offsets():
    """No broker, no Redis: the worker's batch (stages, dead letters, metrics) and its
    at-least-once settle/commit over clients it was given."""
    from stream.batch_stages import default_stages
    from stream.consumer_metrics import STAGES
    from stream.settings import Settings
    from stream.worker import Clients, StreamWorker

    s = Settings().replace(top_k=K, commit_interval_ms=0)
    model, policy = Model(), Top1Policy()

    def append(user_ids, states, with_history):
        return [True] * len(states), [[] for _ in states], [None] * len(states)

    producer, consumer = Producer(), Consumer()
    clients = Clients(consumer, producer, None, Producer)
    w = StreamWorker(
        s, model, policy, "w-inj", clients=clients, stages=default_stages(s, model, policy, append)
    )
    recs = records(6, bad={4})
    b = w.process(recs)
    assert b.events == 5 and b.dead == 1 and len(b.futures) == 6
    assert set(b.stages) == set(STAGES)
    assert {tp.partition: o for tp, o in b.offsets.items()} == {0: 6}
    assert {tp.partition: o for tp, o in b.first.items()} == {0: 0}
    topics = [t for t, _ in producer.sent]
    assert topics.count(s.topics.ad_queries) == 5 and topics.count(s.topics.dead_letters) == 1
    w.inflight.append(b)
    assert w.settle() == 1 and consumer.commits == [{0: 6}]
    assert w.metrics.events == 5 and w.metrics.dead_letters == 1


class Knowing(Model):
    """The fake predictor, knowing no word of titles that contain 'zz'."""

    def has_evidence(self, titles):
        return np.array(["zz" not in t for t in titles])


def test_a_page_the_model_knows_nothing_of_gets_no_ad_even_from_history():
    b, out, sent = decoded(3)
    b.msgs[1]["title"] = "zzqxv blorfx"
    predict_stage(b, out, model=Knowing(), top_k=K, skip_unknown=True)
    assert b.known.tolist() == [True, False, True] and (b.ids[1] == -1).all()
    state_stage(
        b, out, append=lambda u, s, h: ([True] * 3, [[]] * 3, [None] * 3), with_history=True
    )
    assert b.states[1].query_ids.size == 0  # its state keeps no prior guesses for later windows

    class FromHistory:  # like the GRU: would pick a query from the user's earlier pages
        name, needs_history, version, refused = "hist", True, "p1", {}

        def serve_batch(self, h, states, ids, scores):
            sv = Top1Policy().serve_batch(h, states, np.full_like(ids, 7), scores)
            return sv

        def maybe_reload(self):
            return False

    choose_stage(b, out, policy=FromHistory())
    emit_stage(b, out, topic="ads", policy_name="hist")
    ads = [decode("ad_query", v, 1 << 20)["event_id"] for t, v in sent if t == "ads"]
    assert ads == ["e0", "e2"] and b.no_query == 1 and len(b.answered_ts) == 3


def test_no_evidence_prior_serves_the_predictions_as_they_are():
    b, out, _ = decoded(2)
    b.msgs[0]["title"] = "zzqxv"
    predict_stage(b, out, model=Knowing(), top_k=K, skip_unknown=False)
    assert b.known.size == 0 and (b.ids >= 0).all()


def test_stream_metrics_without_redis_is_one_line_that_says_what_to_do(tmp_path):
    import socket
    import time

    from click.testing import CliRunner

    from stream.cli_stream import stream

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"REDIS_URL": f"redis://:hunter2@127.0.0.1:{port}/0", "ASTEC_SERVICES_DIR": str(tmp_path)}
    t0 = time.monotonic()
    res = CliRunner().invoke(stream, ["metrics"], env=env)
    assert res.exit_code == 1 and time.monotonic() - t0 < 10
    assert res.output.startswith(f"Error: no Redis answers at 127.0.0.1:{port}")
    assert "astec infra up" in res.output and "hunter2" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def _child_blas(q):
    import os

    q.put(os.environ.get("OPENBLAS_NUM_THREADS"))


def test_workers_get_their_blas_threads_without_changing_the_supervisors_environment(
    monkeypatch,
):
    import multiprocessing as mp
    import os

    from stream.runner import blas_threads

    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with blas_threads(3):
        p = ctx.Process(target=_child_blas, args=(q,))
        p.start()
    assert q.get(timeout=60) == "3"
    p.join(30)
    assert "OPENBLAS_NUM_THREADS" not in os.environ and os.environ["OMP_NUM_THREADS"] == "5"


def test_the_group_has_settled_only_when_every_worker_owns_partitions():
    from stream.consumer_metrics import partitions_shared

    snap = [{"partitions": "4"}, {"partitions": "0"}]  # the second published before joining
    assert not partitions_shared(snap, 2, 4)
    assert partitions_shared([{"partitions": "1"}, {"partitions": "3"}], 2, 4)
    assert not partitions_shared([{"partitions": "4"}], 2, 4)
