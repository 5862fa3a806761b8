"""Faults on the real services: a worker killed with SIGKILL mid-stream and restarted loses no
event and counts no visit twice in user state; Redis restarted mid-stream keeps its state (AOF)
and the consumers reconnect and go on."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict

import pytest

from stream.metrics import read_all
from stream.schemas import decode, encode
from stream.state import StateStore, connect
from stream.topics import make_consumer, make_producer

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# A worker process as `astec stream run` starts one, with the tests' kNN model.
WORKER = """
import json, sys
sys.path.insert(0, sys.argv[3])
from conftest import KnnPredictor, read_stream_corpus
from infra.config import Settings
from stream.model import ModelHandle
from stream.policy import Top1Policy
from stream.worker import StreamWorker
knn = KnnPredictor(*read_stream_corpus())
w = StreamWorker(Settings(**json.loads(sys.argv[1])), ModelHandle.open(sys.argv[3], loader=lambda p: knn),
                 Top1Policy(), sys.argv[2])
w.install_signal_handlers()
w.run()
"""


def spawn_worker(settings, cid):
    log = tempfile.TemporaryFile()   # a file, not a pipe: a chatty worker never blocks
    p = subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(asdict(settings)), cid, TESTS],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
    p.log = log
    return p


def tail(p) -> str:
    p.log.seek(0)
    return p.log.read().decode(errors="replace")[-2000:]


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


def events_of(settings, cid) -> int:
    for m in read_all(connect(settings.redis_url), settings.redis_key_prefix):
        if m["consumer"] == cid:
            return int(m["events"])
    return 0


def assert_state_exact(settings, users, ids):
    """Every visit is in its user's state exactly once (state_k holds a user's whole stream)."""
    store = StateStore(connect(settings.redis_url), settings.redis_key_prefix, settings.state_k)
    stored = [s.event_id for h in store.histories([f"u{u}" for u in range(users)]) for s in h]
    counts = Counter(stored)
    assert not [e for e, c in counts.items() if c > 1], "a visit was counted twice"
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} visits missing from state"


def test_kill9_worker_mid_stream_loses_nothing_counts_nothing_twice(stream_settings, stream_corpus):
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2, batch_max=64)
    users, n = 50, 2500
    procs = {cid: spawn_worker(s, cid) for cid in ("fa-0", "fa-1")}
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(target=lambda: result.update(
        ids=produce_paced(s, stream_corpus[0], n, users, rate=250, tag=tag)))
    try:
        prod.start()
        deadline = time.monotonic() + 60
        while events_of(s, "fa-0") < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert events_of(s, "fa-0") >= 300, tail(procs["fa-0"])
        procs["fa-0"].send_signal(signal.SIGKILL)          # mid-stream, mid-batch likely
        procs["fa-0"].wait(10)
        procs["fa-0b"] = spawn_worker(s, "fa-0b")           # the restart
        prod.join(60)
        seen = collect_ads(s, set(result["ids"]))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)
    ids = result["ids"]
    missing = set(ids) - set(seen)
    assert not missing, f"{len(missing)} events lost"
    dup = sum(seen.values()) - len(seen)
    print(f"\nkill -9 test: {len(ids)} events, 0 lost, {dup} duplicate ad queries on the output")
    assert_state_exact(s, users, ids)
    assert procs["fa-1"].returncode == 0 and procs["fa-0b"].returncode == 0   # graceful SIGTERM


def test_redis_restart_mid_stream_keeps_state_and_consumers_reconnect(stream_settings,
                                                                       stream_corpus, services):
    from infra.services import read_info, restart_redis
    if read_info(services.services_dir) is None:
        pytest.skip("Redis not started by this test session (KAFKA_BOOTSTRAP/REDIS_URL given)")
    s = stream_settings.replace(state_k=64, metrics_interval_s=0.2)
    users, n = 40, 1200
    procs = {cid: spawn_worker(s, cid) for cid in ("rr-0", "rr-1")}
    tag = uuid.uuid4().hex[:6]
    result = {}
    prod = threading.Thread(target=lambda: result.update(
        ids=produce_paced(s, stream_corpus[0], n, users, rate=200, tag=tag)))
    try:
        prod.start()
        deadline = time.monotonic() + 60
        while events_of(s, "rr-0") + events_of(s, "rr-1") < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        before = StateStore(connect(s.redis_url), s.redis_key_prefix, s.state_k).histories(
            [f"u{u}" for u in range(users)])
        restart_redis(services.services_dir)                 # SIGTERM: AOF flushed; same port
        after = StateStore(connect(s.redis_url), s.redis_key_prefix, s.state_k).histories(
            [f"u{u}" for u in range(users)])
        kept = {e.event_id for h in before for e in h}
        assert kept and kept <= {e.event_id for h in after for e in h}   # state survived
        prod.join(60)
        seen = collect_ads(s, set(result["ids"]))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)
    assert set(result["ids"]) <= set(seen), "events lost across the Redis restart"
    assert_state_exact(s, users, result["ids"])
    assert all(p.returncode == 0 for p in procs.values()), \
        [tail(p) for p in procs.values()]
