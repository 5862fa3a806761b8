"""`astec stream log-clicks`: ad-queries + ad-clicks -> the durable click log (engine.clicklog).

Each polled record is decoded, converted and encoded on its own: whatever fails there is the
record's fault (schema, an empty url, a ts of 1e20, a lone surrogate, a field too long) and sends
it to the dead-letter topic with its reason while the rest of the poll goes on. The records that
are new are then written with fsync, the dead letters acknowledged, and only then the offsets
committed. Anything that is not one record's fault (the broker, Redis or the disk failing) raises:
the process exits, its supervisor (`supervise`) starts it again with backoff, and it resumes at
the last committed offset, so nothing is lost or skipped.

Duplicates (a worker's at-least-once replay repeats ad queries; this logger's own restarts replay
its uncommitted poll) are dropped by event id: within a poll the first copy wins, across polls and
restarts a per-user window of the last N event ids in Redis (stream.state_store.EventWindow,
bounded memory) is checked before the write and updated after the fsync. A kill between the two
can write a record twice, never lose one; engine.clicklog.ad_outcomes reads each impression once.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from engine.clicklog import ClickLogError, ClickLogWriter
from stream.schemas import SchemaError, dead_letter, decode
from stream.settings import Settings
from stream.state_store import EventWindow, connect, user_key
from stream.topics import make_consumer, make_producer

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 1 << 20
COUNTS = ("ad_impressions", "ad_clicks", "duplicates", "dead_letters")

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
    "source_visits_ago",
    "source_event_id",
    "margin",
)


def _impression(m: dict) -> dict:
    return {k: m[k] for k in _IMPRESSION_FIELDS if m.get(k) is not None}


def _click(m: dict) -> dict:
    return {k: m[k] for k in ("event_id", "user_id", "query", "clicked", "ts")}


def _reason(exc: BaseException) -> str:
    """The dead-letter reason of a record that could not be logged."""
    if isinstance(exc, SchemaError):
        return str(exc)
    if isinstance(exc, ClickLogError):
        return f"click log: {exc}"
    return f"click log failed: {type(exc).__name__}: {exc}"


def run_click_logger(
    settings: Settings,
    log_dir: str,
    max_seconds: float | None = None,
    stop_event: threading.Event | None = None,
    dedup_n: int | None = None,
    counts: dict | None = None,
) -> dict:
    """Consume until SIGTERM/SIGINT (or max_seconds / stop_event); returns counts (kept up to
    date in `counts` when given: each polled record is counted once, as logged, duplicate or
    dead letter). Raises on what is not a record's fault (the caller, usually `supervise`,
    starts it again). The dedupe window is dedup_n event ids per user and kind (default: the
    settings' dedup_n, the workers' window)."""
    stop_event = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop_event.set())
    wid = f"{socket.gethostname()}-{os.getpid()}"
    topics: dict[str, tuple[str, str, Callable[[dict], dict]]] = {
        settings.topics.ad_queries: ("ad_query", "ad_impressions", _impression),
        settings.topics.ad_clicks: ("ad_click", "ad_clicks", _click),
    }
    consumer = make_consumer(
        settings,
        list(topics),
        f"{settings.consumer.group}-click-log",
        client_id=f"astec-clicklog-{wid}",
    )
    producer = make_producer(settings)
    r = connect(settings.redis.url.reveal())
    window = EventWindow(
        r, settings.state.dedup_n if dedup_n is None else dedup_n, settings.state.dedup_ttl_s
    )
    writers = {
        kind: ClickLogWriter(log_dir, kind, writer_id=wid, fsync=True)
        for _, kind, _ in topics.values()
    }
    counts = counts if counts is not None else {}
    counts.update(dict.fromkeys(COUNTS, 0))
    futures: list = []

    def to_dead(rec: Any, reason: str) -> None:
        counts["dead_letters"] += 1
        futures.append(
            producer.send(
                settings.topics.dead_letters,
                key=rec.key[:1024] if rec.key else None,
                value=dead_letter(
                    rec.value, reason, rec.topic, rec.partition, rec.offset, f"click-log-{wid}"
                ),
            )
        )

    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    try:
        while not stop_event.is_set() and (deadline is None or time.monotonic() < deadline):
            polled = consumer.poll(timeout_ms=200, max_records=1000)
            records = [rec for rs in polled.values() for rec in rs]
            if not records:
                continue
            # kind -> (user id, event id) -> (Kafka record, (date, line)); the first copy wins
            batch: dict[str, dict[tuple[str, str], tuple[Any, tuple[str, bytes]]]] = {
                kind: {} for kind in writers
            }
            for rec in records:
                schema, kind, convert = topics[rec.topic]
                try:
                    x = convert(decode(schema, rec.value, MAX_MESSAGE_BYTES))
                    item = (rec, writers[kind].encode(x))
                except Exception as exc:  # noqa: BLE001 - any failure here is the record's fault
                    to_dead(rec, _reason(exc))
                    continue
                if batch[kind].setdefault((x["user_id"], x["event_id"]), item) is not item:
                    counts["duplicates"] += 1
            for kind, items in batch.items():
                if items:
                    written, dups = _log_new(items, kind, writers[kind], window, settings, to_dead)
                    counts[kind] += written
                    counts["duplicates"] += dups
            producer.flush()
            for f in futures:
                f.get(timeout=30)
            futures.clear()
            consumer.commit()
    finally:
        for w in writers.values():
            w.close()
        producer.close(timeout=10)
        consumer.close(autocommit=False)
        r.close()
    return counts


def _log_new(
    items: dict[tuple[str, str], tuple[Any, tuple[str, bytes]]],
    kind: str,
    writer: ClickLogWriter,
    window: EventWindow,
    settings: Settings,
    to_dead: Callable[[Any, str], None],
) -> tuple[int, int]:
    """Write the records of one kind that their users' dedupe windows have not seen, durably,
    then remember them; returns (written, duplicates)."""
    ids = list(items)
    keys = [user_key(settings.redis.key_prefix, u, f"clicklog:{kind}") for u, _ in ids]
    new, dups = [], 0
    for i, s in enumerate(window.seen(keys, [e for _, e in ids])):
        if isinstance(s, str):  # Redis refused this record's lookup (not an outage or OOM)
            to_dead(items[ids[i]][0], s)
        elif s:
            dups += 1
        else:
            new.append(i)
    writer.write_encoded([items[ids[i]][1] for i in new])  # flush + fsync inside
    remembered = window.remember([keys[i] for i in new], [ids[i][1] for i in new])
    for i, ok in zip(new, remembered, strict=True):
        if isinstance(ok, str):  # written and durable; a replay of it is dropped when read
            log.warning("click log: %s %r written but not remembered: %s", kind, ids[i][1], ok)
    return len(new), dups


def _logger_main(settings: Settings, log_dir: str, deadline: float | None, conn: Any) -> None:
    """One click-logger process under `supervise`: runs until SIGTERM or the wall-clock
    deadline, then sends its counts to the supervisor."""
    logging.basicConfig(
        level=int(os.environ.get("ASTEC_LOG_LEVEL", logging.INFO)),
        format="%(asctime)s %(levelname)s click-log %(name)s: %(message)s",
    )
    max_s = None if deadline is None else max(0.0, deadline - time.time())
    conn.send(run_click_logger(settings, log_dir, max_seconds=max_s))
    conn.close()


def supervise(
    settings: Settings, log_dir: str, max_seconds: float | None = None, restart: bool = True
) -> dict:
    """Run the click logger in a child process until SIGTERM/SIGINT (forwarded to it) or
    max_seconds, starting it again with backoff (0.5 s doubling to 10 s, reset after a minute
    up) whenever it dies abnormally, as stream.runner does for the page-view workers. Returns
    the counts of the runs that ended cleanly (a killed run's counts die with it) and
    "restarts"."""
    ctx = mp.get_context("spawn")
    deadline = None if max_seconds is None else time.time() + max_seconds
    total: Counter = Counter()
    restarts, backoff, stopping = 0, 0.5, False

    def start() -> tuple[Any, Any, float]:
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_logger_main, args=(settings, log_dir, deadline, send), name="astec-click-log"
        )
        p.start()
        send.close()
        log.info("started click logger pid %s", p.pid)
        return p, recv, time.monotonic()

    def collect(recv: Any) -> None:
        try:
            if recv.poll(0):
                total.update(recv.recv())
        except (EOFError, OSError):  # died before reporting
            pass
        recv.close()

    def on_signal(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    p, recv, up_since = start()
    try:
        while not stopping:
            p.join(0.2)
            if p.exitcode is None:
                continue
            collect(recv)
            if p.exitcode == 0 or not restart:
                log.info("click logger exited (%s)", p.exitcode)
                break
            if time.monotonic() - up_since > 60:
                backoff = 0.5
            log.warning("click logger died (exit %s); restarting in %.1fs", p.exitcode, backoff)
            wake = time.monotonic() + backoff
            while not stopping and time.monotonic() < wake:
                time.sleep(0.05)
            if stopping:
                break
            backoff = min(backoff * 2, 10.0)
            p, recv, up_since = start()
            restarts += 1
    finally:
        if p.exitcode is None:
            p.terminate()  # SIGTERM: the logger finishes its poll, commits and leaves the group
            p.join(60)
            if p.exitcode is None:
                log.error("click logger did not stop in 60s; killing it")
                p.kill()
                p.join()
            collect(recv)
        for sig, h in old.items():
            signal.signal(sig, h)
    return {**{k: total[k] for k in COUNTS}, "restarts": restarts}
