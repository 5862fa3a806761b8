"""Readers for the Redis fault tests: every message of a topic out, the answers per event id, a
worker in a thread (traffic in and `astec stream run`: testkit.stream_run)."""

from __future__ import annotations

import threading
import time
from collections import Counter

from stream.schemas import decode
from stream.topics import make_consumer


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
        settings.topics.ad_queries,
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
