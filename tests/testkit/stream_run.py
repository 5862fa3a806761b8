"""`astec stream run` driven as a user drives it, for the fault tests: start it configured
through the environment, feed it paced page views, read its answers read-committed, and check
the users' state (shared by tests/stream/test_worker_faults.py and test_cluster_faults.py)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

import psutil

from stream.consumer_metrics import partitions_shared, read_all
from stream.schemas import decode, encode
from stream.settings import settings_env
from stream.state_store import StateStore, connect
from stream.topics import make_consumer, make_producer
from testkit.paths import REPO

ROOT = REPO


def start_astec(settings, *args: str) -> subprocess.Popen:
    """`astec ARGS...` as a user or operator starts it, configured through the environment; its
    output goes to a file (`p.log`, read by `tail`), not a pipe: a chatty process never blocks."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process (p.log)
    env = {**os.environ, **settings_env(settings), "ASTEC_LOG_LEVEL": "30"}
    p = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    p.log = log  # type: ignore[attr-defined]
    return p


def start_stream(settings, predictor, workers=2):
    """`astec stream run` with `workers` workers serving `predictor`."""
    return start_astec(settings, "stream", "run", "--workers", str(workers), "--model", predictor)


def tail(p, chars: int = 3000) -> str:
    """The last `chars` characters of a process' output (start_astec)."""
    p.log.seek(0)
    return p.log.read().decode(errors="replace")[-chars:]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_consumers(settings) -> list[dict]:
    """Metrics of the consumers whose process still runs."""
    return [
        m
        for m in read_all(connect(settings.redis.url.reveal()), settings.redis.key_prefix)
        if running(int(m["pid"]))
    ]


def wait_for(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_sharing(settings, workers: int, timeout: float = 90) -> None:
    """Until the live consumers have settled (stream.consumer_metrics.partitions_shared)."""

    def shared() -> bool:
        return partitions_shared(live_consumers(settings), workers, settings.topics.partitions)

    wait_for(shared, timeout, f"{workers} worker(s) sharing the partitions")


def stored_visits(settings) -> int:
    """Distinct visits the live workers have stored (a replayed batch counts as duplicates)."""
    return sum(int(m["events"]) - int(m["duplicates"]) for m in live_consumers(settings))


def page_view(i: int, users: int, title: str, tag: str) -> dict:
    return {
        "event_id": f"{tag}-{i}",
        "user_id": f"u{i % users}",
        "ts": time.time(),
        "url": f"https://example.org/{i}",
        "title": title,
    }


def produce_views(settings, msgs: list[dict]) -> None:
    """Send page views as they are, keyed by user, and wait until the broker has them all."""
    p = make_producer(settings)
    for m in msgs:
        p.send(settings.topics.page_views, key=m["user_id"].encode(), value=encode("page_view", m))
    p.flush()
    p.close()


def produce_paced(settings, titles, n, users, rate, tag, stop=None):
    """n page views at ~rate/s; returns the ids of those the broker acknowledged (librdkafka
    retries through a broker restart for up to two minutes; idempotent, as a front end should
    be, so a retried produce never stores a page view twice)."""
    from stream.rdkafka_producer import RdProducer

    p = RdProducer(
        settings, "test-load", 2, **{"message.timeout.ms": 120000, "enable.idempotence": True}
    )
    sent = []
    t0 = time.monotonic()
    for i in range(n):
        if stop is not None and stop.is_set():
            break
        msg = page_view(i, users, titles[i % len(titles)], tag)
        sent.append(
            (
                msg["event_id"],
                p.send(
                    settings.topics.page_views, encode("page_view", msg), msg["user_id"].encode()
                ),
            )
        )
        ahead = (i + 1) / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    try:
        p.flush(timeout=150)
    finally:
        p.close(timeout=5)
    return [eid for eid, d in sent if d.done and d.error is None]


def collect_ads(
    settings,
    want: set,
    timeout=90.0,
    answered_at: list | None = None,
    answers: list | None = None,
) -> Counter:
    """Ad queries per event id, read committed (what the ads pipeline would see); the time each
    was produced (its `ts`) is appended to `answered_at` when given, (event id, ts) to
    `answers`."""
    c = make_consumer(settings, [settings.topics.ad_queries], None)
    seen: Counter = Counter()
    deadline = time.monotonic() + timeout
    while not want <= set(seen) and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            ads = [decode("ad_query", r.value, 1 << 20) for r in recs]
            seen.update(a["event_id"] for a in ads)
            if answered_at is not None:
                answered_at.extend(a["ts"] for a in ads)
            if answers is not None:
                answers.extend((a["event_id"], a["ts"]) for a in ads)
    c.close()
    return seen


def view_partitions(settings, ids: set, timeout=60.0) -> dict:
    """The `page-views` partition each page view of `ids` landed in (read back from the topic)."""
    c = make_consumer(settings, [settings.topics.page_views], None)
    where: dict = {}
    deadline = time.monotonic() + timeout
    while not ids <= set(where) and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            for r in recs:
                where[decode("page_view", r.value, 1 << 20)["event_id"]] = r.partition
    c.close()
    return where


def partition_gaps(answers: list, partition_of: dict, since: float, until: float) -> dict:
    """Per partition: the longest time between two answers (ad queries' `ts`) to its page views
    within [since, until], the window's edges counted (a partition answering nothing in it has
    the whole window as its gap)."""
    times: dict = {}
    for eid, ts in answers:
        if since <= ts <= until and eid in partition_of:
            times.setdefault(partition_of[eid], []).append(ts)
    gaps = {}
    for p in set(partition_of.values()):
        t = sorted([since, *times.get(p, []), until])
        gaps[p] = max(b - a for a, b in itertools.pairwise(t))
    return gaps


def assert_state_exact(settings, users, ids):
    """Every visit is in its user's state exactly once (state_k holds a user's whole stream)."""
    store = StateStore(
        connect(settings.redis.url.reveal()), settings.redis.key_prefix, settings.state.k
    )
    stored = [s.event_id for h in store.histories([f"u{u}" for u in range(users)]) for s in h]
    counts = Counter(stored)
    assert not [e for e, c in counts.items() if c > 1], "a visit was counted twice"
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} visits missing from state"
