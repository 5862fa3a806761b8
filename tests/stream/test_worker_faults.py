"""Faults on the real services, each counting events in against events out: a worker killed with
SIGKILL mid-stream and restarted, the broker killed with SIGKILL and restarted, a worker added
mid-stream (a rebalance with batches in flight), Redis restarted mid-stream. Nothing acknowledged
is lost, no visit is counted twice in user state, and in exactly-once mode a read-committed
reader sees no duplicate ad query."""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections import Counter

import pytest

from stream.state_store import StateStore, connect
from testkit.stream_run import (
    assert_state_exact,
    collect_ads,
    live_consumers,
    produce_paced,
    start_stream,
    stored_visits,
    tail,
    wait_for,
    wait_sharing,
)

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]


@pytest.mark.parametrize("delivery", ["exactly-once", "at-least-once"])
def test_kill9_worker_mid_stream_loses_nothing_counts_nothing_twice(
    stream_settings, stream_corpus, astec_predictor, delivery
):
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2, batch_max=64, delivery=delivery)
    users, n = 50, 2500
    sup = start_stream(s, astec_predictor)
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(
        target=lambda: result.update(
            ids=produce_paced(s, stream_corpus[0], n, users, rate=250, tag=tag)
        )
    )
    try:
        wait_sharing(s, 2)
        prod.start()
        wait_for(
            lambda: min((int(m["events"]) for m in live_consumers(s)), default=0) >= 100,
            60,
            "both workers busy",
        )
        victim = live_consumers(s)[0]
        os.kill(int(victim["pid"]), signal.SIGKILL)  # mid-stream, mid-batch likely
        # the supervisor restarts it: a new consumer joins and takes partitions again
        wait_for(
            lambda: (
                any(
                    m["consumer"] not in (victim["consumer"],) and int(m["events"]) > 0
                    for m in live_consumers(s)
                )
                and len(live_consumers(s)) == 2
            ),
            90,
            "the restarted worker",
        )
        prod.join(60)
        seen = collect_ads(s, set(result["ids"]))
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(60)
    ids = result["ids"]
    assert len(ids) == n, "the broker refused page views"
    missing = set(ids) - set(seen)
    assert not missing, f"{len(missing)} events lost\n{tail(sup)}"
    dup = sum(seen.values()) - len(seen)
    print(
        f"\nkill -9 test ({delivery}): {len(ids)} events, 0 lost, {dup} duplicate ad queries "
        f"seen by a read-committed reader"
    )
    if delivery == "exactly-once":
        assert dup == 0
    else:
        # at most what the victim had answered but not committed: its batches in flight (up to
        # max_in_flight + 1 of batch_max) and one commit interval of its share of the traffic
        bound = 5 * s.consumer.batch_max + 250 * s.consumer.commit_interval_ms / 1000
        assert dup <= bound, f"{dup} duplicates > {bound}"
    assert_state_exact(s, users, ids)
    assert rc == 0, tail(sup)
    assert "1 worker restarts" in tail(sup)


def test_broker_kill9_and_restart_mid_stream_loses_no_acknowledged_event(
    stream_settings, stream_corpus, services, astec_predictor
):
    """The broker dies (SIGKILL) mid-stream and comes back on the same port after a few seconds:
    every page view it acknowledged is answered exactly once, and the workers recover by
    themselves (no worker restart)."""
    from infra.services import read_info, restart_kafka

    if read_info(services.services_dir) is None:
        pytest.skip("broker not started by this test session (KAFKA_BOOTSTRAP/REDIS_URL given)")
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2, delivery="exactly-once")
    users, n = 40, 2000
    sup = start_stream(s, astec_predictor)
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(
        target=lambda: result.update(
            ids=produce_paced(s, stream_corpus[0], n, users, rate=100, tag=tag)
        )
    )
    try:
        wait_sharing(s, 2)
        prod.start()
        wait_for(
            lambda: sum(int(m["events"]) for m in live_consumers(s)) >= 300, 60, "events flowing"
        )
        restart_kafka(services.services_dir, kill=True, down_s=2.0)
        prod.join(240)
        seen = collect_ads(s, set(result["ids"]), timeout=150)
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(90)
    ids = result["ids"]
    assert len(ids) >= 0.9 * n, f"only {len(ids)} of {n} page views acknowledged"
    missing = set(ids) - set(seen)
    assert not missing, f"{len(missing)} acknowledged events lost\n{tail(sup)}"
    assert sum(seen.values()) == len(seen), "duplicate ad queries after the broker restart"
    store = StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, s.state.k)
    stored = Counter(
        st.event_id for h in store.histories([f"u{u}" for u in range(users)]) for st in h
    )
    assert not [e for e, c in stored.items() if c > 1], "a visit was counted twice"
    assert set(ids) <= set(stored)
    assert rc == 0 and "0 worker restarts" in tail(sup), tail(sup)


@pytest.mark.parametrize(
    ("delivery", "client"),
    [
        ("exactly-once", "confluent"),
        ("at-least-once", "confluent"),
        ("at-least-once", "kafka-python"),  # its rebalance listener runs on its I/O thread
    ],
)
def test_worker_added_mid_stream_rebalances_without_loss_or_double_count(
    stream_settings, stream_corpus, astec_predictor, delivery, client
):
    """A second `astec stream run` joins the group while the first has batches in flight: the
    partitions are split between them (cooperative: only the moving ones pause), nothing is
    lost, and nothing is answered twice in exactly-once mode; in at-least-once mode the first
    worker drains its batches in flight and commits before it hands partitions over, so
    repeats stay within that in-flight bound."""
    s = stream_settings.replace(
        state_k=256, metrics_interval_s=0.2, batch_max=32, delivery=delivery, consumer_client=client
    )
    users, n = 50, 12000
    first = start_stream(s, astec_predictor, workers=1)
    tag = uuid.uuid4().hex[:6]
    result = {}
    enough = threading.Event()  # traffic goes on until the added worker has taken some
    prod = threading.Thread(
        target=lambda: result.update(
            ids=produce_paced(s, stream_corpus[0], n, users, rate=200, tag=tag, stop=enough)
        )
    )
    second = None
    try:
        wait_sharing(s, 1)
        prod.start()
        wait_for(
            lambda: sum(int(m["events"]) for m in live_consumers(s)) >= 400, 60, "events flowing"
        )
        second = start_stream(s, astec_predictor, workers=1)
        wait_sharing(s, 2)
        wait_for(
            lambda: len([m for m in live_consumers(s) if int(m["events"]) > 0]) == 2,
            60,
            "the added worker answering",
        )
        enough.set()
        prod.join(120)
        seen = collect_ads(s, set(result["ids"]))
        busy = [m for m in live_consumers(s) if int(m["events"]) > 0]
    finally:
        for sup in (first, second):
            if sup is not None:
                sup.send_signal(signal.SIGTERM)
        rcs = [sup.wait(60) for sup in (first, second) if sup is not None]
    ids = result["ids"]
    assert 400 < len(ids) < n
    assert not set(ids) - set(seen), f"{len(set(ids) - set(seen))} events lost"
    dup = sum(seen.values()) - len(seen)
    print(f"\nworker added mid-stream ({delivery}, {client}): {len(ids)} events, {dup} duplicates")
    if delivery == "exactly-once":
        assert dup == 0, "an event answered twice across the rebalance"
    else:
        # the batches one worker can have unacknowledged: max_in_flight + 1 of batch_max
        assert dup <= 5 * s.consumer.batch_max, f"{dup} duplicates > the in-flight bound"
    assert len(busy) == 2, "the added worker took no traffic"
    assert_state_exact(s, users, ids)
    assert rcs == [0, 0]
    for sup in (first, second):  # a rebalance callback that raised kills the worker
        assert "0 worker restarts" in tail(sup), tail(sup)


def test_redis_kill9_mid_stream_keeps_state_and_consumers_reconnect(
    stream_settings, stream_corpus, services, astec_predictor
):
    """Redis is killed (SIGKILL, no AOF flush on the way out) and restarted mid-stream: every
    visit whose input offset was committed is in the state (the AOF is fsynced before Redis
    answers), the workers reconnect by themselves."""
    from infra.services import read_info, restart_redis

    if read_info(services.services_dir) is None:
        pytest.skip("Redis not started by this test session (KAFKA_BOOTSTRAP/REDIS_URL given)")
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2)
    users, n = 40, 1500
    sup = start_stream(s, astec_predictor)
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(
        target=lambda: result.update(
            ids=produce_paced(s, stream_corpus[0], n, users, rate=200, tag=tag)
        )
    )

    def store() -> StateStore:
        return StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, s.state.k)

    try:
        wait_sharing(s, 2)
        prod.start()
        wait_for(lambda: stored_visits(s) >= 300, 60, "events flowing")
        before = stored_visits(s)
        restart_redis(services.services_dir, kill=True)  # SIGKILL; same port and AOF
        after = store().histories([f"u{u}" for u in range(users)])
        assert sum(map(len, after)) >= before  # state survived the restart
        prod.join(60)
        seen = collect_ads(s, set(result["ids"]))
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(60)
    assert set(result["ids"]) <= set(seen), "events lost across the Redis restart"
    assert_state_exact(s, users, result["ids"])
    assert rc == 0 and "0 worker restarts" in tail(sup), tail(sup)  # reconnected, no crash
