"""Faults on the real services: a worker killed with SIGKILL mid-stream and restarted loses no
event and counts no visit twice in user state; Redis restarted mid-stream keeps its state (AOF)
and the consumers reconnect and go on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter

import psutil
import pytest

from infra.config import settings_env
from stream.metrics import read_all
from stream.schemas import decode, encode
from stream.state import StateStore, connect
from stream.topics import make_consumer, make_producer

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_stream(settings, predictor, workers=2):
    """`astec stream run` as a user starts it, configured through the environment."""
    log = tempfile.TemporaryFile()   # a file, not a pipe: a chatty worker never blocks
    env = {**os.environ, **settings_env(settings), "ASTEC_LOG_LEVEL": "30"}
    p = subprocess.Popen([sys.executable, "-m", "infra.cli", "stream", "run", "--workers",
                          str(workers), "--model", predictor], cwd=ROOT, env=env,
                         stdout=log, stderr=subprocess.STDOUT)
    p.log = log
    return p


def tail(p) -> str:
    p.log.seek(0)
    return p.log.read().decode(errors="replace")[-3000:]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_consumers(settings) -> list[dict]:
    """Metrics of the consumers whose process still runs."""
    return [m for m in read_all(connect(settings.redis_url), settings.redis_key_prefix)
            if running(int(m["pid"]))]


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def produce_paced(settings, titles, n, users, rate, tag):
    """n page views at ~rate/s; returns the event ids."""
    p = make_producer(settings)
    ids = []
    t0 = time.monotonic()
    for i in range(n):
        eid = f"{tag}-{i}"
        msg = {"event_id": eid, "user_id": f"u{i % users}", "ts": time.time(),
               "url": f"https://example.org/{i}", "title": titles[i % len(titles)]}
        p.send(settings.topic_page_views, key=msg["user_id"].encode(), value=encode("page_view", msg))
        ids.append(eid)
        ahead = (i + 1) / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    p.flush()
    p.close()
    return ids


def collect_ads(settings, want: set, timeout=90.0) -> Counter:
    c = make_consumer(settings, [settings.topic_ad_queries], None)
    seen: Counter = Counter()
    deadline = time.monotonic() + timeout
    while not want <= set(seen) and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            seen.update(decode("ad_query", r.value, 1 << 20)["event_id"] for r in recs)
    c.close()
    return seen


def assert_state_exact(settings, users, ids):
    """Every visit is in its user's state exactly once (state_k holds a user's whole stream)."""
    store = StateStore(connect(settings.redis_url), settings.redis_key_prefix, settings.state_k)
    stored = [s.event_id for h in store.histories([f"u{u}" for u in range(users)]) for s in h]
    counts = Counter(stored)
    assert not [e for e, c in counts.items() if c > 1], "a visit was counted twice"
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} visits missing from state"


def test_kill9_worker_mid_stream_loses_nothing_counts_nothing_twice(stream_settings, stream_corpus,
                                                                     astec_predictor):
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2, batch_max=64)
    users, n = 50, 2500
    sup = start_stream(s, astec_predictor)
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(target=lambda: result.update(
        ids=produce_paced(s, stream_corpus[0], n, users, rate=250, tag=tag)))
    try:
        wait_for(lambda: sum(int(m["partitions"]) for m in live_consumers(s)) == s.partitions
                 and len(live_consumers(s)) == 2, 90, "two workers sharing the partitions")
        prod.start()
        wait_for(lambda: min((int(m["events"]) for m in live_consumers(s)), default=0) >= 100, 60,
                 "both workers busy")
        victim = live_consumers(s)[0]
        os.kill(int(victim["pid"]), signal.SIGKILL)          # mid-stream, mid-batch likely
        # the supervisor restarts it: a new consumer joins and takes partitions again
        wait_for(lambda: any(m["consumer"] not in (victim["consumer"],) and int(m["events"]) > 0
                             for m in live_consumers(s)) and len(live_consumers(s)) == 2, 90,
                 "the restarted worker")
        prod.join(60)
        seen = collect_ads(s, set(result["ids"]))
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(60)
    ids = result["ids"]
    missing = set(ids) - set(seen)
    assert not missing, f"{len(missing)} events lost"
    dup = sum(seen.values()) - len(seen)
    print(f"\nkill -9 test: {len(ids)} events, 0 lost, {dup} duplicate ad queries on the output")
    assert_state_exact(s, users, ids)
    assert rc == 0, tail(sup)
    assert "1 worker restarts" in tail(sup)


def test_redis_restart_mid_stream_keeps_state_and_consumers_reconnect(stream_settings,
                                                                       stream_corpus, services,
                                                                       astec_predictor):
    from infra.services import read_info, restart_redis
    if read_info(services.services_dir) is None:
        pytest.skip("Redis not started by this test session (KAFKA_BOOTSTRAP/REDIS_URL given)")
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2)
    users, n = 40, 1500
    sup = start_stream(s, astec_predictor)
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(target=lambda: result.update(
        ids=produce_paced(s, stream_corpus[0], n, users, rate=200, tag=tag)))
    store = lambda: StateStore(connect(s.redis_url), s.redis_key_prefix, s.state_k)
    try:
        wait_for(lambda: sum(int(m["partitions"]) for m in live_consumers(s)) == s.partitions
                 and len(live_consumers(s)) == 2, 90, "two workers sharing the partitions")
        prod.start()
        wait_for(lambda: sum(int(m["events"]) for m in live_consumers(s)) >= 300, 60,
                 "events flowing")
        restart_redis(services.services_dir)                 # SIGTERM: AOF flushed; same port
        after = store().histories([f"u{u}" for u in range(users)])
        assert sum(map(len, after)) >= 300                    # state survived the restart
        prod.join(60)
        seen = collect_ads(s, set(result["ids"]))
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(60)
    assert set(result["ids"]) <= set(seen), "events lost across the Redis restart"
    assert_state_exact(s, users, result["ids"])
    assert rc == 0 and "0 worker restarts" in tail(sup), tail(sup)   # reconnected, no crash
