"""Redis faults that are not an event's fault, on real redis-servers and the real broker:
infrastructure replies (READONLY from a replica) raised for a retry instead of dead-lettering;
a batch not stored until a replica acknowledges it (WAIT; on Cluster, on each primary it wrote
to); a stored state the policy cannot decode dead-letters that one event and the worker goes on;
Redis down for 30 s: the worker keeps its partitions (paused, polling), reports not-ready, loses
nothing and drains its lag after; the Sentinel primary, or one Cluster primary, killed
mid-stream: a failover, every committed visit in the state, nothing dead-lettered."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections import Counter
from urllib.error import HTTPError
from urllib.request import urlopen

import numpy as np
import pytest
import redis

from infra.redis_topologies import (
    kill_node,
    online_replicas,
    start_cluster,
    start_node,
    start_sentinel,
    stop_topology_procs,
)
from infra.services import _terminate, free_port
from personalization.state import UserState
from stream.model_handle import ModelHandle
from stream.policy_handle import Top1Policy
from stream.schemas import dead_letter_raw
from stream.state_store import RedisUnavailable, StateStore, connect, infra_error
from testkit.stream_load import answered, read_all_messages, worker_thread
from testkit.stream_run import produce_paced, start_stream, tail, wait_for

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]
PASSWORD = "test-" + uuid.uuid4().hex[:12]


def test_redis_urls_pick_the_topology():
    from stream.redis_connect import RedisUrlError, parse_redis_url
    from stream.state_store import redis_address

    t = parse_redis_url("redis+sentinel://:p%40ss@s0:26379,s1:26380,s2/astec/2")
    assert (t.topology, t.service, t.db, t.password) == ("sentinel", "astec", 2, "p@ss")
    assert t.nodes == (("s0", 26379), ("s1", 26380), ("s2", 26379))
    assert t.sentinel_password == "p@ss"
    t = parse_redis_url("redis+cluster://:pw@n0:7000,n1:7001")
    assert t.topology == "cluster" and t.nodes == (("n0", 7000), ("n1", 7001))
    assert parse_redis_url("redis://:pw@h:6380/1").topology == "single"
    assert redis_address("redis+cluster://:secret@n0:7000,n1:7001") == "n0:7000,n1:7001"
    with pytest.raises(RedisUrlError, match="names the primary's service"):
        parse_redis_url("redis+sentinel://:pw@s0:26379")
    with pytest.raises(RedisUrlError, match="scheme 'http' is not one of"):
        parse_redis_url("http://h:6379")
    with pytest.raises(RedisUrlError, match="bad port"):
        parse_redis_url("redis+cluster://n0:70x0")


def visit(i: int) -> UserState:
    return UserState.from_visit(
        f"e{i}", 1.7e9 + i, f"https://x/{i}", f"t{i}", np.ones(4), np.arange(3), np.ones(3)
    )


def url(port: int) -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{port}/0"


@pytest.mark.parametrize(
    "reply",
    [
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.exceptions.ResponseError("MOVED 3999 127.0.0.1:6381"),
        redis.exceptions.ResponseError("TRYAGAIN Multiple keys request during rehashing"),
        redis.exceptions.ResponseError("CLUSTERDOWN The cluster is down"),
        redis.exceptions.ResponseError("MASTERDOWN Link with MASTER is down"),
        redis.exceptions.ResponseError("NOPERM this user has no permissions"),
        redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.exceptions.ResponseError("ERR READONLY You can't write against a replica"),
    ],
)
def test_infrastructure_replies_are_not_the_events_fault(reply):
    assert infra_error(reply)


@pytest.mark.parametrize(
    "reply",
    [
        redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind"),
        redis.exceptions.ResponseError("ERR Error running script: user_script:3: bad argument"),
    ],
)
def test_a_commands_own_error_stays_the_events(reply):
    assert not infra_error(reply)


def test_readonly_replica_raises_for_a_retry_and_wait_needs_a_replica(tmp_path):
    """A store pointed at a replica (what a demoted primary answers) raises RedisUnavailable
    instead of one refusal per event; against the primary with one replica the batch is stored
    once the replica holds it, and with the replica gone it is not counted as stored."""
    primary = start_node(tmp_path, PASSWORD)
    replica = start_node(tmp_path, PASSWORD, None, "--replicaof", "127.0.0.1", str(primary.port))
    try:
        wait_for(lambda: online_replicas(connect(url(primary.port))) == 1, 20, "replica in sync")
        on_replica = StateStore(connect(url(replica.port)), "t", wait_replicas=0)
        with pytest.raises(RedisUnavailable, match="ReadOnlyError"):
            on_replica.append_batch_checked(["a", "b"], [visit(1), visit(2)])

        store = StateStore(connect(url(primary.port)), "t", wait_replicas=-1)
        fresh, _, errors = store.append_batch_checked(["a", "b"], [visit(1), visit(2)])
        assert store.wait_replicas == 1  # auto: the primary has a replica
        store.wait_timeout_ms = 300
        assert fresh == [True, True] and errors == [None, None]
        # the replica has it: a failover to it would keep both visits
        assert [s.event_id for s in on_replica.history("a")] == ["e1"]
        kill_node(replica)
        with pytest.raises(RedisUnavailable, match="0 of 1 replica"):
            store.append_batch_checked(["a"], [visit(3)])
    finally:
        for p in (replica, primary):
            _terminate(p.pid)


def test_cluster_batch_waits_for_each_primarys_replica(tmp_path):
    """On Redis Cluster a batch spanning the three primaries is stored once each primary's
    replica acknowledged it: WAIT is sent on every primary the batch wrote to and each replica
    holds its users' visits when the append returns. With one replica killed the batch is not
    counted as stored; once the cluster marks that replica failed, its primary has no replica
    to wait for and the retry stores the batch."""
    topo = start_cluster(tmp_path, PASSWORD)
    try:
        client = connect(topo.url)
        # 3 s: the replica answers within milliseconds on a quiet machine, not always under
        # the full suite's load
        store = StateStore(client, "t", wait_replicas=-1, wait_timeout_ms=3000)
        users = [f"u{i}" for i in range(30)]
        primaries = {client.get_node_from_key(store.states_key(u)).name for u in users}
        assert len(primaries) == 3
        before = {p: _waits(topo, p) for p in primaries}
        fresh, _, errors = store.append_batch_checked(users, [visit(i) for i in range(30)])
        assert fresh == [True] * 30 and errors == [None] * 30
        assert all(_waits(topo, p) == before[p] + 1 for p in primaries), "WAIT not sent"
        for i, u in enumerate(users):  # read on the replica itself, right away
            r = redis.Redis(port=_replica_port(client, store.states_key(u)), password=PASSWORD)
            r.execute_command("READONLY")
            assert [UserState.decode(x).event_id for x in r.lrange(store.states_key(u), 0, -1)] == [
                f"e{i}"
            ]
            r.close()

        # one primary's replica killed: that primary's users are not stored until the
        # cluster has marked it failed
        victim = _replica_port(client, store.states_key("u0"))
        kill_node(next(n for n in topo.nodes if n.port == victim))
        with pytest.raises(RedisUnavailable, match="0 of 1 replica"):
            store.append_batch_checked(["u0"], [visit(100)])
        t0 = time.monotonic()
        while True:
            try:
                fresh, _, errors = store.append_batch_checked(["u0"], [visit(100)])
                break
            except RedisUnavailable:
                assert time.monotonic() - t0 < 30, "the failed replica is still waited for"
                time.sleep(0.5)
        assert errors == [None]
        assert [s.event_id for s in store.history("u0")] == ["e0", "e100"]
        client.close()
    finally:
        stop_topology_procs(topo)


def _replica_port(client, key: str) -> int:
    """The port of the replica of the cluster primary that owns the key (its INFO)."""
    primary = client.get_redis_connection(client.get_node_from_key(key))
    return int(primary.info("replication")["slave0"]["port"])


def _waits(topo, node_name: str) -> int:
    """WAIT commands one cluster node has run (INFO commandstats)."""
    port = int(node_name.rsplit(":", 1)[1])
    c = redis.Redis(port=port, password=PASSWORD)
    try:
        return int(c.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
    finally:
        c.close()


def test_undecodable_stored_state_is_one_dead_letter_and_the_worker_goes_on(
    stream_settings, knn_predictor, stream_corpus, tmp_path
):
    """A user's stored list holds bytes no UserState decodes (another format's writer): that
    user's event is dead-lettered with the reason, the user's window starts afresh, every other
    event is answered, and the worker runs on."""
    s = stream_settings
    store = StateStore.from_settings(connect(s.redis.url.reveal()), s)
    store.client.lpush(store.states_key("u0"), b"\xffnot-a-state")
    w, t = worker_thread(
        s,
        ModelHandle.open(tmp_path, loader=lambda _p: knn_predictor),
        Top1Policy(needs_history=True),
        "w-hostile",
    )
    try:
        titles = stream_corpus[0]
        ids = produce_paced(s, titles, 40, 4, rate=400, tag="h1")
        dead = read_all_messages(
            s, s.topics.dead_letters, "dead_letter", until=lambda m: len(m) >= 1, timeout=30
        )
        ads = answered(s, [i for i in ids if not i.endswith("-0")], timeout=60)
        assert t.is_alive()
        # the user's next visit starts a new window that decodes
        more = produce_paced(s, titles, 4, 4, rate=100, tag="h2")
        ads2 = answered(s, more, timeout=60)
    finally:
        w.stop()
        t.join(30)
    assert len(dead) == 1 and "cannot be decoded" in dead[0]["reason"], dead
    refused = json.loads(dead_letter_raw(dead[0]))["event_id"]
    assert set(ids) - set(ads) == {refused}
    assert set(more) <= set(ads2)
    # the window went on with what decodes: the user's answered visits, nothing else
    u0_events = [e for e in ids if int(e.split("-")[1]) % 4 == 0 and e != refused] + ["h2-0"]
    assert [v.event_id for v in store.history("u0")] == u0_events


def test_redis_down_30s_worker_keeps_its_partitions_and_loses_nothing(
    stream_settings, knn_predictor, stream_corpus, tmp_path
):
    """Redis stops for 30 s (three times max.poll.interval) under traffic: the worker keeps its
    partitions throughout (paused and polling, never evicted), /readyz says 503 naming redis,
    nothing is dead-lettered, and once Redis is back every page view is answered and stored."""
    node = start_node(tmp_path / "r", PASSWORD)
    s = stream_settings.replace(redis_url=url(node.port), metrics_interval_s=0.2)
    port = free_port()
    w, t = worker_thread(
        s,
        ModelHandle.open(tmp_path, loader=lambda _p: knn_predictor),
        Top1Policy(),
        "w-outage",
        port,
    )
    result: dict = {}
    assignments: list[int] = []
    try:
        wait_for(
            lambda: len(w.consumer.assignment()) == s.topics.partitions, 60, "partitions assigned"
        )
        assert urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status == 200
        prod = threading.Thread(
            target=lambda: result.update(
                ids=produce_paced(s, stream_corpus[0], 2000, 30, rate=50, tag="o")
            )
        )
        prod.start()
        wait_for(lambda: w.metrics.events >= 100, 60, "events flowing")
        _terminate(node.pid)
        t_down = time.monotonic()
        ready_codes, body = [], {}
        while time.monotonic() - t_down < 30:
            assignments.append(len(w.consumer.assignment()))
            try:
                ready_codes.append(urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status)
            except HTTPError as e:
                ready_codes.append(e.code)
                body = json.loads(e.read())
            time.sleep(0.5)
        members = _group_members(s)  # the broker's view, 30 s into the outage
        alive = urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status  # still polling
        node = start_node(tmp_path / "r", PASSWORD, node.port)  # same port, same AOF
        prod.join(60)
        ads = answered(s, result["ids"], timeout=90)
        wait_for(lambda: w.consumer.lag() == 0, 30, "the lag drained")
        ready_after = urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status
        prom = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        w.stop()
        t.join(30)
        _terminate(node.pid)
    assert min(assignments) == s.topics.partitions, (
        "the worker lost its partitions during the outage"
    )
    assert members == 1, "the worker left the group during the outage"
    assert 503 in ready_codes and body["redis"] is False and body["assigned"] is True
    assert ready_after == 200 and alive == 200
    retries = f'astec_stream_redis_retries_total{{consumer="w-outage"}} {w.health.redis_retries}'
    assert (
        retries + ".0" in prom
        and 'astec_stream_commit_failures_total{consumer="w-outage"} 0.0' in prom
    )
    assert w.metrics.dead_letters == 0 and w.commit_failures == 0
    assert w.health.redis_retries > 0
    assert set(result["ids"]) <= set(ads), "page views lost across the outage"
    print(f"\nRedis down 30 s: {len(result['ids'])} events, 0 lost, 0 dead letters")


@pytest.mark.parametrize("topology", ["sentinel", "cluster"])
def test_primary_kill9_mid_stream_loses_no_committed_visit(
    stream_settings, stream_corpus, astec_predictor, tmp_path, topology
):
    """`astec stream run` (2 workers) on a Sentinel or Cluster URL; a primary is killed with
    SIGKILL mid-stream. A replica is promoted (by the sentinels, or by the cluster's other
    primaries), the workers follow it: every acknowledged page view is answered, every visit is
    in its user's state exactly once, nothing is dead-lettered: each batch waited for a replica
    (under Sentinel the primary's, on Cluster each written primary's) before its offsets were
    committed, so the promoted replica holds every committed visit."""
    topo = (start_sentinel if topology == "sentinel" else start_cluster)(tmp_path, PASSWORD)
    s = stream_settings.replace(redis_url=topo.url, state_k=64, metrics_interval_s=0.2)
    users, n = 40, 1600
    sup = start_stream(s, astec_predictor, workers=2)
    result: dict = {}
    store = StateStore.from_settings(connect(s.redis.url.reveal()), s)
    try:
        wait_for(lambda: len(_live_ids(store, s)) >= 2, 90, "both workers publishing")
        prod = threading.Thread(
            target=lambda: result.update(
                ids=produce_paced(s, stream_corpus[0], n, users, rate=200, tag="sf")
            )
        )
        prod.start()
        wait_for(lambda: _stored(store, users) >= 300, 60, "visits stored")
        t_kill = time.monotonic()
        kill_node(topo.nodes[0])
        prod.join(90)
        want = set(result["ids"])
        msgs = read_all_messages(
            s,
            s.topics.ad_queries,
            "ad_query",
            until=lambda ms: want <= {m["event_id"] for m in ms},
            timeout=120,
        )
        ads = Counter(m["event_id"] for m in msgs)
        failover_s = time.monotonic() - t_kill
        gap = float(np.diff(np.sort([m["ts"] for m in msgs])).max())
        dead = read_all_messages(s, s.topics.dead_letters, "dead_letter", timeout=3)
        hists = store.histories([f"u{u}" for u in range(users)])
        waits = sum(_waits(topo, f"127.0.0.1:{node.port}") for node in topo.nodes[1:])
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(60)
        stop_topology_procs(topo)
    ids = result["ids"]
    assert len(ids) == n
    assert not set(ids) - set(ads), f"{len(set(ids) - set(ads))} page views unanswered"
    assert not dead, f"{len(dead)} dead letters: {dead[0]['reason']}"
    counts = Counter(st.event_id for h in hists for st in h)
    assert not [e for e, c in counts.items() if c > 1], "a visit was counted twice"
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} visits missing from state"
    assert rc == 0, tail(sup)
    assert waits > 0, "no batch waited for a replica"
    print(
        f"\n{topology} primary kill -9: {n} events, 0 lost, 0 dead letters, "
        f"{failover_s:.1f}s from the kill to the last answer, longest gap between two answers "
        f"{gap:.2f}s"
    )


def _group_members(s) -> int:
    """Members of the settings' consumer group, as the group coordinator sees them."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(s.kafka.librdkafka_options())
    group = admin.describe_consumer_groups([s.consumer.group])[s.consumer.group].result(10)
    return len(group.members) if group.state == ConsumerGroupState.STABLE else 0


def _live_ids(store: StateStore, s) -> list:
    return list(store.client.smembers(f"{s.redis.key_prefix}:metrics:consumers"))


def _stored(store: StateStore, users: int) -> int:
    return sum(map(len, store.histories([f"u{u}" for u in range(users)])))
