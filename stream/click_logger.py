"""`astec stream log-clicks`: ad-queries + ad-clicks -> the durable click log (engine.clicklog).

Each batch is written with fsync before the offsets are committed, so an acknowledged offset
always has its records on disk. Replayed messages (worker crashes produce duplicate ad queries)
are skipped through Redis idempotence keys, checked before the write and set after the fsync:
a crash between the two can still duplicate a record, never lose one. Impressions are joined
with clicks by event_id when read (engine.clicklog.ad_outcomes).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

from engine.clicklog import ClickLogWriter
from stream.settings import Settings
from stream.schemas import SchemaError, dead_letter, decode
from stream.state_store import connect, key_part
from stream.topics import make_consumer, make_producer

log = logging.getLogger(__name__)

_IMPRESSION_FIELDS = (
    "event_id",
    "user_id",
    "ts",
    "query",
    "candidates",
    "url",
    "title",
    "score",
    "propensity",
    "policy",
    "model_version",
    "session_id",
    "query_id",
    "candidate_ids",
    "candidate_scores",
    "candidate_propensities",
    "explored",
)


def _impression(m: dict) -> dict:
    return {k: m[k] for k in _IMPRESSION_FIELDS if m.get(k) is not None}


def _click(m: dict) -> dict:
    return {k: m[k] for k in ("event_id", "user_id", "query", "clicked", "ts")}


def run_click_logger(
    settings: Settings,
    log_dir: str,
    max_seconds: float | None = None,
    stop_event: threading.Event | None = None,
) -> dict:
    """Consume until SIGTERM/SIGINT (or max_seconds / stop_event); returns counts."""
    stop_event = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop_event.set())
    wid = f"{socket.gethostname()}-{os.getpid()}"
    topics = {
        settings.topic_ad_queries: ("ad_query", "ad_impressions", _impression),
        settings.topic_ad_clicks: ("ad_click", "ad_clicks", _click),
    }
    consumer = make_consumer(
        settings,
        list(topics),
        f"{settings.consumer_group}-click-log",
        client_id=f"astec-clicklog-{wid}",
    )
    producer = make_producer(settings)
    r = connect(settings.redis_url)
    writers = {
        kind: ClickLogWriter(log_dir, kind, writer_id=wid, fsync=True)
        for _, kind, _ in topics.values()
    }
    counts = {"ad_impressions": 0, "ad_clicks": 0, "duplicates": 0, "dead_letters": 0}
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    try:
        while not stop_event.is_set() and (deadline is None or time.monotonic() < deadline):
            polled = consumer.poll(timeout_ms=200, max_records=1000)
            records = [rec for rs in polled.values() for rec in rs]
            if not records:
                continue
            batch = {kind: [] for kind in writers}
            futures = []
            for rec in records:
                schema, kind, convert = topics[rec.topic]
                try:
                    batch[kind].append(convert(decode(schema, rec.value, 1 << 20)))
                except Exception as exc:  # noqa: BLE001 - no single record stops the logger
                    reason = (
                        str(exc)
                        if isinstance(exc, SchemaError)
                        else f"click log failed: {type(exc).__name__}: {exc}"
                    )
                    counts["dead_letters"] += 1
                    futures.append(
                        producer.send(
                            settings.topic_dead_letters,
                            key=rec.key[:1024] if rec.key else None,
                            value=dead_letter(
                                rec.value,
                                reason,
                                rec.topic,
                                rec.partition,
                                rec.offset,
                                f"click-log-{wid}",
                            ),
                        )
                    )
            for kind, recs in batch.items():
                if not recs:
                    continue
                # the same event twice in one poll (a replayed at-least-once output) is one record
                unique = list({x["event_id"]: x for x in reversed(recs)}.values())[::-1]
                counts["duplicates"] += len(recs) - len(unique)
                recs = unique
                keys = [
                    f"{settings.redis_key_prefix}:clicklog:{kind}:{key_part(x['event_id'])}"
                    for x in recs
                ]
                pipe = r.pipeline(transaction=False)
                for k in keys:
                    pipe.exists(k)
                seen = pipe.execute()
                new = [(k, x) for k, x, s in zip(keys, recs, seen) if not s]
                counts["duplicates"] += len(recs) - len(new)
                writers[kind].write_many([x for _, x in new])  # flush + fsync inside
                pipe = r.pipeline(transaction=False)
                for k, _ in new:
                    pipe.set(k, 1, ex=settings.dedup_ttl_s)
                pipe.execute()
                counts[kind] += len(new)
            producer.flush()
            for f in futures:
                f.get(timeout=30)
            consumer.commit()
    finally:
        for w in writers.values():
            w.close()
        producer.close(timeout=10)
        consumer.close(autocommit=False)
        r.close()
    return counts
