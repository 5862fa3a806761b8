"""The stream worker against the real broker and Redis: every event yields an ad query, workers
split partitions, bad messages go to the dead-letter topic, user state and metrics are written,
and a promoted model is picked up between batches (a broken one refused)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from stream.consumer_metrics import read_all
from stream.model_handle import ModelHandle
from stream.policy_handle import Top1Policy
from stream.schemas import dead_letter_raw, decode, encode
from stream.state_store import StateStore, connect
from stream.topics import make_consumer, make_producer
from stream.worker import StreamWorker

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]


def page_views(titles, n, users=20, tag=None):
    tag = tag or uuid.uuid4().hex[:6]
    return [
        {
            "event_id": f"{tag}-{i}",
            "user_id": f"u{i % users}",
            "ts": time.time(),
            "url": f"https://example.org/{i}",
            "title": titles[i % len(titles)],
        }
        for i in range(n)
    ]


def produce(settings, msgs, raw: list[bytes] = ()):
    p = make_producer(settings)
    for m in msgs:
        fresh = {**m, "ts": time.time()}
        p.send(
            settings.topics.page_views,
            key=fresh["user_id"].encode(),
            value=encode("page_view", fresh),
        )
    for r in raw:
        p.send(settings.topics.page_views, key=b"bad", value=r)
    p.flush()
    p.close()


def read_topic(settings, topic, until_n, timeout=60.0):
    """All messages of a topic (no group), until `until_n` arrived or timeout."""
    c = make_consumer(settings, [topic], None)
    out, deadline = [], time.monotonic() + timeout
    while len(out) < until_n and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            out.extend(recs)
    c.close()
    return out


def wait_until(cond, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def start_worker(settings, model_path, cid, metrics_port=0):
    """A worker thread on the real exported predictor (or a model registry root)."""
    model = ModelHandle.open(model_path, check_every_s=0.1, background=True)
    w = StreamWorker(settings, model, Top1Policy(), cid, metrics_port)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    return w, t


def test_every_event_yields_one_ad_query_and_state(stream_settings, astec_predictor, stream_corpus):
    s = stream_settings
    titles, _, names = stream_corpus
    msgs = page_views(titles, 300, users=25)
    produce(s, msgs)
    from urllib.request import urlopen

    from infra.services import free_port

    port = free_port()
    w, t = start_worker(s, astec_predictor, "w-test-0", metrics_port=port)
    try:
        got = read_topic(s, s.topics.ad_queries, len(msgs))
        time.sleep(0.2)
        prom = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        w.stop()
        t.join(30)
    ads = [decode("ad_query", r.value, 1 << 20) for r in got]
    assert {a["event_id"] for a in ads} == {m["event_id"] for m in msgs}
    by_id = {m["event_id"]: m for m in msgs}
    pred = w.model.predictor
    ids, scores, _ = pred.predict_with_features([by_id[a["event_id"]]["title"] for a in ads], 10)
    assert (np.diff(scores, axis=1) <= 0).all()
    for a, row in zip(ads, ids, strict=True):
        assert a["query_id"] == row[0] and a["query"] == names[row[0]]  # top1 of this page
        assert a["candidates"] == [names[j] for j in row]
        assert a["model_version"] == pred.version and a["event_ts"] <= a["ts"]
        assert {r.key for r in got} <= {f"u{i}".encode() for i in range(25)}

    # user state: last K visits per user, newest last, each with its features and top-k
    store = StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, s.state.k)
    hist = store.history("u3")
    mine = [m for m in msgs if m["user_id"] == "u3"]
    assert [h.event_id for h in hist] == [m["event_id"] for m in mine][-s.state.k :]
    assert hist[-1].z.shape == (pred.dim,) and hist[-1].query_ids.shape == (10,)
    z_now = pred.features([mine[-1]["title"]])[0]
    assert np.allclose(
        hist[-1].z.astype(np.float32), z_now, atol=1e-2 * max(1, np.abs(z_now).max())
    )
    assert store.client.ttl(store.states_key("u3")) > 0

    # metrics for the dashboard
    snap = [m for m in read_all(store.client, s.redis.key_prefix) if m["consumer"] == "w-test-0"]
    assert snap and int(snap[0]["events"]) == len(msgs)
    assert snap[0]["model_version"] == pred.version and float(snap[0]["e2a_ms_p99"]) > 0
    # the same figures on the Prometheus endpoint
    assert f'astec_stream_events_total{{consumer="w-test-0"}} {float(len(msgs))}' in prom
    assert f'version="{pred.version}"' in prom and "astec_stream_event_to_ad_seconds_bucket" in prom


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_two_workers_split_partitions(stream_settings, astec_predictor, stream_corpus, client):
    # group membership, the partition split and delivery are what differs between the clients
    # (exactly-once needs librdkafka's transactions: kafka-python's consumer runs at-least-once)
    s = stream_settings.replace(
        consumer_client=client,
        delivery="exactly-once" if client == "confluent" else "at-least-once",
    )
    workers = [start_worker(s, astec_predictor, f"w-split-{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # wait until the group settled on both members
            a = [w.consumer.assignment() for w, _ in workers]
            if all(a) and len(a[0] | a[1]) == s.topics.partitions and not (a[0] & a[1]):
                break
            time.sleep(0.2)
        a0, a1 = (w.consumer.assignment() for w, _ in workers)
        assert a0 and a1 and not (a0 & a1) and len(a0 | a1) == s.topics.partitions
        msgs = page_views(stream_corpus[0], 200, users=40)
        produce(s, msgs)
        got = read_topic(s, s.topics.ad_queries, len(msgs))
    finally:
        for w, _ in workers:
            w.stop()
        for _, t in workers:
            t.join(30)
    assert {decode("ad_query", r.value, 1 << 20)["event_id"] for r in got} == {
        m["event_id"] for m in msgs
    }
    assert all(w.metrics.events > 0 for w, _ in workers)
    assert sum(w.metrics.events for w, _ in workers) == len(msgs)


def test_bad_messages_go_to_dead_letters_and_stream_goes_on(
    stream_settings, astec_predictor, stream_corpus
):
    s = stream_settings
    good = page_views(stream_corpus[0], 50)
    bad = [
        b"{not json",
        b"\xff\xfe\x00garbage",
        json.dumps({"v": 1, "event_id": "x"}).encode(),
        encode("page_view", {**good[0], "title": "x" * (s.topics.max_message_bytes + 10)}),
        json.dumps({**good[0], "v": 99}).encode(),
    ]
    produce(s, good[:25], raw=bad)
    produce(s, good[25:])
    w, t = start_worker(s, astec_predictor, "w-dlq")
    try:
        got = read_topic(s, s.topics.ad_queries, len(good))
        dls = read_topic(s, s.topics.dead_letters, len(bad))
    finally:
        w.stop()
        t.join(30)
    assert {decode("ad_query", r.value, 1 << 20)["event_id"] for r in got} == {
        m["event_id"] for m in good
    }
    letters = [decode("dead_letter", r.value, 1 << 22) for r in dls]
    assert sorted(dead_letter_raw(d) for d in letters) == sorted(bad)
    reasons = " | ".join(d["reason"] for d in letters)
    for expected in ("not JSON", "not UTF-8", "missing field 'user_id'", "oversized", "version 99"):
        assert expected in reasons
    assert all(d["source_topic"] == s.topics.page_views for d in letters)
    assert w.metrics.dead_letters == len(bad)


def test_hot_reload_switches_between_batches_and_refuses_broken(
    stream_settings, stream_corpus, astec_predictor, tmp_path
):
    import shutil

    from engine.registry import Registry

    s = stream_settings
    reg = Registry(tmp_path / "models")

    def add_version(broken=False):
        st = reg.stage()
        shutil.copytree(astec_predictor, st.path / "predictor")
        if broken:  # a corrupted file: the verifying loader must refuse the whole version
            victim = max(
                (p for p in (st.path / "predictor").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size,
            )
            victim.write_bytes(victim.read_bytes()[:-8] + b"corrupt!")
        reg.commit(st)
        reg.promote(st.version)
        return st.version

    v1 = add_version()
    w, t = start_worker(s, reg.root, "w-reload")
    try:
        produce(s, page_views(stream_corpus[0], 20, tag="a"))
        first = read_topic(s, s.topics.ad_queries, 20)
        v2 = add_version()
        # loaded and warmed on the watcher's thread, swapped in before the next batch
        wait_until(lambda: w.model.watcher._latest == v2, "v2 loaded in the background")
        produce(s, page_views(stream_corpus[0], 20, tag="b"))
        second = read_topic(s, s.topics.ad_queries, 40)
        v3 = add_version(broken=True)
        wait_until(lambda: v3 in w.model.refused, "v3 refused in the background")
        produce(s, page_views(stream_corpus[0], 20, tag="c"))
        third = read_topic(s, s.topics.ad_queries, 60)
    finally:
        w.stop()
        t.join(30)

    def version_of(recs, tag):
        return {
            decode("ad_query", r.value, 1 << 20)["model_version"]
            for r in recs
            if r.value and f'"{tag}-' in r.value.decode()
        }

    assert version_of(first, "a") == {v1}
    assert version_of(second, "b") == {v2}
    assert version_of(third, "c") == {v2}  # corrupted v3 refused, v2 kept
    assert v3 in w.model.refused and w.model.version == v2


@dataclass
class OffsetRun:
    """One worker over 120 page views in batches of <= 16, commit interval 60 s."""

    settings: Any
    msgs: list
    worker: StreamWorker
    committed: Callable[[], int]  # the group's committed offsets, summed over partitions
    after_stop: int = -1  # the same, once the worker stopped gracefully


@contextlib.contextmanager
def offset_run(stream_settings, astec_predictor, titles, cid, delivery, interval_ms=60_000):
    from kafka import KafkaConsumer, TopicPartition

    s = stream_settings.replace(commit_interval_ms=interval_ms, batch_max=16, delivery=delivery)
    msgs = page_views(titles, 120)
    produce(s, msgs)
    w, t = start_worker(s, astec_predictor, cid)
    tps = [TopicPartition(s.topics.page_views, p) for p in range(s.topics.partitions)]
    probe = KafkaConsumer(
        **s.kafka.kafka_python_options(), group_id=s.consumer.group, enable_auto_commit=False
    )
    run = OffsetRun(s, msgs, w, lambda: sum(probe.committed(tp) or 0 for tp in tps))
    try:
        yield run
    finally:
        w.stop()
        t.join(30)
        run.after_stop = run.committed()
        probe.close()


def test_offsets_committed_at_interval_and_on_graceful_stop(
    stream_settings, astec_predictor, stream_corpus
):
    """At-least-once: offsets are committed at most every commit_interval_ms (not per batch), and
    a graceful stop commits everything settled: a restarted group resumes after the last event."""
    with offset_run(
        stream_settings, astec_predictor, stream_corpus[0], "w-commit", "at-least-once"
    ) as run:
        read_topic(run.settings, run.settings.topics.ad_queries, len(run.msgs))
        time.sleep(0.5)
        # all 120 events answered in batches of <= 16, yet nothing committed yet (interval 60 s)
        assert run.committed() == 0
        assert run.worker.pending_offsets
    assert run.after_stop == len(run.msgs)


def test_exactly_once_transaction_spans_the_commit_interval(
    stream_settings, astec_predictor, stream_corpus
):
    """Exactly-once: one transaction holds every batch of a commit interval with their input
    offsets: until it commits a read-committed reader sees none of its ad queries and the group
    has no offset; once it commits, all of them and the offsets that produced them at once."""
    with offset_run(
        stream_settings, astec_predictor, stream_corpus[0], "w-eos", "exactly-once", 8000
    ) as run:
        s, w = run.settings, run.worker
        wait_until(
            lambda: w.txn is not None and sum(b.events for b in w.txn.batches) == len(run.msgs),
            "all page views processed inside the open transaction",
        )
        assert len(w.txn.batches) >= len(run.msgs) // s.consumer.batch_max  # many batches, one txn
        assert run.committed() == 0
        assert read_topic(s, s.topics.ad_queries, 1, timeout=1) == []
        got = read_topic(s, s.topics.ad_queries, len(run.msgs), timeout=30)
        committed = run.committed()
        # the commit returns on its own thread; the worker notes it at its next poll
        wait_until(lambda: w.transactions == 1, "the commit seen by the worker")
        assert not run.worker.pending_offsets
    assert len(got) == len(run.msgs) and committed == len(run.msgs)
    assert run.after_stop == len(run.msgs)


class SlowCommit:
    """The worker's real transactional producer, each commit held back `delay_s` first; with
    `refuse`, the first commit is aborted instead (as when the broker refuses one)."""

    def __init__(self, producer, delay_s: float, refuse: bool):
        self._p, self.delay_s, self.refuse = producer, delay_s, refuse

    def __getattr__(self, name):
        return getattr(self._p, name)

    def commit_transaction(self, offsets, group_metadata):
        from stream.rdkafka_producer import TransactionAborted

        time.sleep(self.delay_s)
        if self.refuse:
            self.refuse = False
            self._p.abort_transaction()
            raise TransactionAborted("transaction aborted: refused by the test")
        self._p.commit_transaction(offsets, group_metadata)


@pytest.mark.parametrize("refused", [False, True], ids=["committed", "refused"])
def test_exactly_once_next_interval_is_processed_while_a_commit_runs(
    stream_settings, astec_predictor, stream_corpus, refused
):
    """Exactly-once: while one interval's transaction commits (held back 4 s here) the worker
    goes on answering the next interval's page views, holding their ad queries; a read-committed
    reader sees them once that commit returned. If it is refused instead, both intervals are
    processed again: every page view still answered exactly once, no visit stored twice."""
    s = stream_settings.replace(delivery="exactly-once", commit_interval_ms=1000, batch_max=16)
    first, second = page_views(stream_corpus[0], 40), page_views(stream_corpus[0], 40)
    model = ModelHandle.open(astec_predictor, background=True)
    w = StreamWorker(s, model, Top1Policy(), "w-eos-overlap")
    w.producer = SlowCommit(w.producer, 4.0, refused)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        produce(s, first)
        wait_until(lambda: w.committing is not None, "the first interval's commit started")
        commit, txn = w.committing, w._committing_txn
        assert sum(b.events for b in txn.batches) == len(first)
        produce(s, second)
        wait_until(
            lambda: (
                w.txn is not None
                and w.txn.held is not None
                and sum(b.events for b in w.txn.batches) == len(second)
            ),
            "the second interval answered while the first commits",
            timeout=30,
        )
        assert not commit.done.is_set(), "the commit returned before the test could look"
        got = read_topic(s, s.topics.ad_queries, 2 * len(first), timeout=60)
        wait_until(lambda: w.txn is None and w.committing is None, "everything committed")
    finally:
        w.stop()
        t.join(30)
    ids = [decode("ad_query", r.value, 1 << 20)["event_id"] for r in got]
    assert sorted(ids) == sorted(m["event_id"] for m in first + second)  # each exactly once
    assert len(read_topic(s, s.topics.ad_queries, len(ids) + 1, timeout=3)) == len(ids)
    assert w.aborted == (1 if refused else 0)
    store = StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, s.state.k)
    for u in {m["user_id"] for m in first + second}:
        stored = [h.event_id for h in store.history(u)]
        assert len(stored) == len(set(stored)) == 4  # 80 visits over 20 users, none twice
