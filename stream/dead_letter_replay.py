"""`astec stream replay-dead-letters`: send dead letters back to the topic they came from once
their cause is fixed (a Redis outage of an older release, a model that failed on some titles).

The dead-letter topic is read from its start to its end as it is when the replay starts (no
consumer group: nothing is committed, the topic is left as it is). A dead letter is replayed
when its reason contains `reason` and it was written at or after `since`; its original bytes
(the dead letter's raw_b64) go to its source topic under its key. Each event is sent once per
run (by source topic and event id; a record without one by its bytes' hash); across runs a
replay is idempotent where it lands: the workers store a visit once per event id and the click
logger logs an impression or click once per event id, so replaying twice cannot count a visit
twice. A dead letter whose raw bytes were truncated (over DEAD_LETTER_RAW_MAX) cannot be
replayed and is counted as such.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from stream.schemas import SchemaError, dead_letter_raw, decode
from stream.settings import Settings


def _event_id(raw: bytes) -> str:
    try:
        msg = json.loads(raw)
        if isinstance(msg, dict) and isinstance(msg.get("event_id"), str):
            return msg["event_id"]
    except ValueError:
        pass
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def _end_offsets(consumer: Any, topic: str) -> dict[int, int]:
    """The topic's partitions and their high watermarks now (where this replay stops)."""
    from confluent_kafka import TopicPartition as CkTopicPartition

    meta = consumer.list_topics(topic, timeout=10)
    parts = sorted(meta.topics[topic].partitions)
    return {
        p: consumer.get_watermark_offsets(CkTopicPartition(topic, p), timeout=10)[1] for p in parts
    }


def replay_dead_letters(
    settings: Settings,
    reason: str,
    since: float = 0.0,
    dry_run: bool = False,
    timeout_s: float = 60.0,
) -> dict:
    """Replay the dead letters whose reason contains `reason`, written at or after `since`
    (seconds since the epoch); returns the counts (and, per source topic, how many were sent)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer
    from confluent_kafka import TopicPartition as CkTopicPartition

    from stream.topics import make_producer

    topic = settings.topics.dead_letters
    c = Consumer(
        {
            **settings.kafka.librdkafka_options(),
            "group.id": f"astec-replay-{int(time.time() * 1000)}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": False,
        }
    )
    counts: dict[str, Any] = {
        "read": 0,
        "matched": 0,
        "sent": 0,
        "repeated_in_run": 0,
        "truncated": 0,
        "unreadable": 0,
        "by_topic": {},
    }
    producer = None if dry_run else make_producer(settings)
    sent: set[tuple[str, str]] = set()
    futures = []
    try:
        ends = {p: e for p, e in _end_offsets(c, topic).items() if e > 0}
        c.assign([CkTopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None or m.error() is not None:
                continue
            part, off = int(m.partition() or 0), int(m.offset() or 0)
            if off + 1 >= ends.get(part, 0):
                ends.pop(part, None)
            counts["read"] += 1
            try:
                dl = decode("dead_letter", m.value() or b"", 1 << 22)
            except SchemaError:
                counts["unreadable"] += 1
                continue
            if reason not in dl["reason"] or dl["ts"] < since:
                continue
            counts["matched"] += 1
            if dl.get("raw_truncated"):
                counts["truncated"] += 1
                continue
            raw = dead_letter_raw(dl)
            ident = (dl["source_topic"], _event_id(raw))
            if ident in sent:
                counts["repeated_in_run"] += 1
                continue
            sent.add(ident)
            by = counts["by_topic"]
            by[dl["source_topic"]] = by.get(dl["source_topic"], 0) + 1
            if producer is not None:
                futures.append(producer.send(dl["source_topic"], key=m.key(), value=raw))
        if ends:
            raise TimeoutError(
                f"the dead-letter topic {topic!r} was not read to its end within {timeout_s:.0f}s"
            )
        if producer is not None:
            producer.flush()
            for f in futures:
                f.get(timeout=30)  # raises if the broker refused one: nothing is reported sent
        counts["sent"] = len(sent) if producer is not None else 0
    finally:
        c.close()
        if producer is not None:
            producer.close(timeout=10)
    return counts
