"""Traffic and readers for the Redis fault tests: page views in at a pace, every message of a
topic out, a worker in a thread, `astec stream run` as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

from stream.schemas import decode, encode
from stream.settings import settings_env
from stream.topics import make_consumer
from testkit.paths import REPO


def wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def page_view(i: int, users: int, title: str, tag: str) -> dict:
    return {
        "event_id": f"{tag}-{i}",
        "user_id": f"u{i % users}",
        "ts": time.time(),
        "url": f"https://example.org/{i}",
        "title": title,
    }


def produce_paced(settings, titles, n, users, rate, tag, stop=None) -> list[str]:
    """n page views at ~rate/s (idempotent librdkafka producer); the ids the broker acked."""
    from stream.rdkafka_producer import RdProducer

    p = RdProducer(
        settings, "test-load", 2, **{"message.timeout.ms": 60000, "enable.idempotence": True}
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
                    settings.topic_page_views, encode("page_view", msg), msg["user_id"].encode()
                ),
            )
        )
        ahead = (i + 1) / rate - (time.monotonic() - t0)
        if ahead > 0:
            time.sleep(ahead)
    try:
        p.flush(timeout=90)
    finally:
        p.close(timeout=5)
    return [eid for eid, d in sent if d.done and d.error is None]


def read_all_messages(settings, topic: str, schema: str, until=None, timeout=60.0) -> list[dict]:
    """Every message of `topic` (read committed, no group), until `until(msgs)` or timeout."""
    c = make_consumer(settings, [topic], None)
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (until is not None and until(out)):
        for recs in c.poll(timeout_ms=200).values():
            out.extend(decode(schema, r.value, 1 << 20) for r in recs)
    c.close()
    return out


def answered(settings, ids, timeout=90.0) -> Counter:
    """Ad queries per event id, until every id in `ids` has one (or timeout)."""
    want = set(ids)
    msgs = read_all_messages(
        settings,
        settings.topic_ad_queries,
        "ad_query",
        until=lambda ms: want <= {m["event_id"] for m in ms},
        timeout=timeout,
    )
    return Counter(m["event_id"] for m in msgs)


def worker_thread(settings, model, policy, cid: str, metrics_port: int = 0):
    """A StreamWorker running in a daemon thread; returns (worker, thread)."""
    from stream.worker import StreamWorker

    w = StreamWorker(settings, model, policy, cid, metrics_port)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    return w, t


def start_stream(settings, predictor: str, workers: int = 2) -> subprocess.Popen:
    """`astec stream run` as a user starts it, configured through the environment; its output
    goes to a temporary file (`tail`)."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
    env = {**os.environ, **settings_env(settings), "ASTEC_LOG_LEVEL": "30"}
    argv = ["stream", "run", "--workers", str(workers), "--model", predictor]
    p = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", *argv],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    p.log = log  # type: ignore[attr-defined]
    return p


def tail(p) -> str:
    p.log.seek(0)
    return p.log.read().decode(errors="replace")[-3000:]
