"""A librdkafka (confluent-kafka) group consumer behind the part of kafka-python's consumer
interface the workers use: `poll(timeout_ms, max_records)` -> {TopicPartition: [records]},
`commit({tp: OffsetAndMetadata})`, `assignment()`, `close()`.

kafka-python's consumer cost the workers about 30% of their CPU at 1,000 events/s (py-spy: its
I/O thread and the fetch parsing under `poll`), all of it competing for the GIL with the
predictor; librdkafka fetches and parses in its own threads. Records keep kafka-python's field
names (topic, partition, offset, key, value, timestamp) and offsets stay kafka-python's
`TopicPartition`s, so the worker's settle-then-commit logic is the same for both clients.

`poll` waits for the first message only, then drains what librdkafka already holds without
waiting: `Consumer.consume(n, timeout)` would wait out its whole timeout unless n messages come.
"""

from __future__ import annotations

import logging
from collections import namedtuple
from collections.abc import Callable

from stream.settings import Settings

log = logging.getLogger(__name__)

Record = namedtuple("Record", "topic partition offset key value timestamp")
# how often librdkafka asks which broker coordinates the group (a tenth of it while that broker
# is down): with its default (10 min, so 1 min while down) a member whose coordinator froze kept
# reconnecting to it after the cluster had moved the group, and the stream waited for the node
COORDINATOR_QUERY_MS = 10000


class RdConsumer:
    """One consumer-group member (manual commits, earliest reset) on librdkafka.

    Cooperative-sticky assignment: a rebalance moves only the partitions that change owner, the
    others keep flowing. `instance_id` makes the member static (KIP-345): a restart within the
    session timeout gets the same partitions back without a rebalance; a static member does not
    leave the group on close, its partitions move after the session timeout.
    `on_revoke(partitions)` runs before partitions move away, `on_lost(partitions)` when they
    already belong to another member (both with kafka-python's TopicPartitions). A partition
    assigned comes unpaused, as in the Java and kafka-python clients (librdkafka alone keeps the
    pause of a partition revoked or lost and assigned back: fetched never again)."""

    def __init__(
        self,
        settings: Settings,
        topics: list[str],
        group_id: str,
        client_id: str = "astec",
        on_revoke: Callable[[set], None] | None = None,
        instance_id: str | None = None,
        on_lost: Callable[[set], None] | None = None,
    ):
        from confluent_kafka import Consumer

        static = {"group.instance.id": instance_id} if instance_id else {}
        self._c = Consumer(
            {
                **settings.kafka.librdkafka_options(),
                **static,
                "group.id": group_id,
                "partition.assignment.strategy": "cooperative-sticky",
                "isolation.level": "read_committed",
                "client.id": client_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": settings.consumer.session_timeout_ms,
                "heartbeat.interval.ms": settings.consumer.heartbeat_interval_ms,
                "max.poll.interval.ms": max(
                    settings.consumer.max_poll_interval_ms, settings.consumer.session_timeout_ms
                ),
                "fetch.wait.max.ms": max(1, settings.consumer.fetch_wait_max_ms),
                "enable.partition.eof": False,
                "coordinator.query.interval.ms": COORDINATOR_QUERY_MS,
                "socket.nagle.disable": True,
                "logger": logging.getLogger("stream.librdkafka"),
                "on_commit": self._committed,
            }
        )
        self.async_commit_failures = 0  # commit_async results, reported under poll
        self._on_revoke = on_revoke
        self._on_lost = on_lost
        self._assigned: set = set()
        self._fresh: set = set()  # assigned in a poll's callback: resumed once the poll returns
        if topics:
            self.subscribe(topics)

    # ---- group membership --------------------------------------------------------------------
    def subscribe(self, topics: list[str]) -> None:
        self._c.subscribe(
            list(topics), on_assign=self._assign, on_revoke=self._revoke, on_lost=self._lost
        )

    def assign_from_start(self, topic: str, partitions: int) -> None:
        """Read partitions 0..partitions-1 of `topic` from their first offset, outside any group
        (a reader that commits nothing; `group_id` then only names it to the broker)."""
        from confluent_kafka import OFFSET_BEGINNING
        from confluent_kafka import TopicPartition as CkTopicPartition
        from kafka.structs import TopicPartition

        self._c.assign([CkTopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self._assigned = {TopicPartition(topic, p) for p in range(partitions)}

    @staticmethod
    def _tps(partitions) -> set:
        from kafka.structs import TopicPartition

        return {TopicPartition(p.topic, p.partition) for p in partitions}

    # incremental (cooperative): each callback names only the partitions that change; librdkafka
    # applies the incremental assign / unassign itself once the callback returns
    def _assign(self, _consumer, partitions) -> None:
        tps = self._tps(partitions)
        self._assigned |= tps
        self._fresh |= tps

    def _revoke(self, _consumer, partitions) -> None:
        # before the partitions move: the owner drains and commits what it has on them (its
        # callback must not raise: an exception here would come out of the next poll)
        tps = self._tps(partitions)
        if self._on_revoke is not None:
            self._on_revoke(tps)
        self._assigned -= tps

    def _lost(self, _consumer, partitions) -> None:
        tps = self._tps(partitions)  # already someone else's: committing now would be refused
        if self._on_lost is not None:
            self._on_lost(tps)
        self._assigned -= tps

    def assignment(self) -> set:
        return set(self._assigned)

    def pause(self, *partitions) -> None:
        """Fetch nothing more from these (owned) partitions; poll keeps the membership alive."""
        self._c.pause(self._owned(partitions))

    def resume(self, *partitions) -> None:
        self._c.resume(self._owned(partitions))

    def _owned(self, partitions) -> list:
        from confluent_kafka import TopicPartition as CkTopicPartition

        return [
            CkTopicPartition(tp.topic, tp.partition) for tp in partitions if tp in self._assigned
        ]

    # ---- records and offsets -----------------------------------------------------------------
    def poll(self, timeout_ms: int = 0, max_records: int = 500) -> dict:
        """Up to max_records messages: wait up to timeout_ms for the first, take the rest that are
        already fetched. Returns {TopicPartition: [Record]} in offset order per partition."""
        from confluent_kafka import KafkaError
        from kafka.structs import TopicPartition

        first = self._c.poll(max(0.0, timeout_ms / 1000.0))
        msgs = [] if first is None else [first]
        if first is not None and max_records > 1:
            msgs += self._c.consume(max_records - 1, 0)
        if self._fresh:  # the poll's callbacks ran and librdkafka applied their assignment
            fresh, self._fresh = self._fresh & self._assigned, set()
            self.resume(*fresh)
        out: dict = {}
        for m in msgs:
            err = m.error()
            if err is not None:
                # a fatal error comes as an error event of code _FATAL whose fatal() is False
                # (e.g. a static member fenced after its max.poll.interval ran out): the
                # consumer fetches nothing ever again, so the worker must stop and be restarted
                if err.fatal() or err.code() == KafkaError._FATAL:
                    raise RuntimeError(f"librdkafka consumer: {err}")
                log.warning("consumer error: %s", err)
                continue
            tp = TopicPartition(m.topic(), m.partition())
            out.setdefault(tp, []).append(
                Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1])
            )
        return out

    def commit(self, offsets: dict | None = None) -> None:
        """Synchronous commit of {TopicPartition: OffsetAndMetadata (or int)} (next offsets).

        A refused commit (the partitions moved to another member, the group went away) raises
        kafka-python's CommitFailedError, which the worker already treats as "will be replayed"."""
        from confluent_kafka import KafkaException
        from confluent_kafka import TopicPartition as CkTopicPartition
        from kafka.errors import CommitFailedError

        if not offsets:
            return
        parts = [
            CkTopicPartition(tp.topic, tp.partition, int(getattr(o, "offset", o)))
            for tp, o in offsets.items()
        ]
        try:
            self._c.commit(offsets=parts, asynchronous=False)
        except KafkaException as exc:
            raise CommitFailedError(f"librdkafka refused the commit: {exc.args[0]}") from exc

    def commit_async(self, offsets: dict) -> None:
        """Commit without waiting for the coordinator's answer (the worker's periodic commit: a
        synchronous one held every event that arrived meanwhile for a broker round trip). A
        refusal is logged and counted when a later poll serves its report; the batches it
        covered are replayed by the partitions' next owner, as after any failed commit."""
        from confluent_kafka import TopicPartition as CkTopicPartition

        if offsets:
            parts = [
                CkTopicPartition(tp.topic, tp.partition, int(getattr(o, "offset", o)))
                for tp, o in offsets.items()
            ]
            self._c.commit(offsets=parts, asynchronous=True)

    def _committed(self, err, _partitions) -> None:
        if err is not None:
            self.async_commit_failures += 1
            log.warning("asynchronous commit failed (%s); its batches may be replayed", err)

    def lag(self) -> int | None:
        """Messages between this member's positions and its partitions' ends (high watermarks
        as last fetched: no broker round trip), or None before it owns anything."""
        from confluent_kafka import KafkaException
        from confluent_kafka import TopicPartition as CkTopicPartition

        if not self._assigned:
            return None
        try:
            parts = [CkTopicPartition(tp.topic, tp.partition) for tp in self._assigned]
            total = 0
            for p in self._c.position(parts):
                _low, high = self._c.get_watermark_offsets(p, cached=True)
                if high >= 0 and p.offset >= 0:
                    total += max(0, high - p.offset)
            return total
        except KafkaException:
            return None

    def group_metadata(self):
        """The group generation a transactional producer commits offsets under (fencing)."""
        return self._c.consumer_group_metadata()

    def committed(self, tps, timeout: float = 30.0) -> dict:
        """{TopicPartition: offset} the group's coordinator holds now for `tps` (those with none
        left out). Read-committed, so librdkafka asks for stable offsets: a transaction still
        being completed is waited for, never read half-way."""
        from confluent_kafka import TopicPartition as CkTopicPartition
        from kafka.structs import TopicPartition

        got = self._c.committed(
            [CkTopicPartition(tp.topic, tp.partition) for tp in tps], timeout=timeout
        )
        return {
            TopicPartition(r.topic, r.partition): r.offset
            for r in got
            if r.error is None and r.offset >= 0
        }

    def rewind(self, offsets: dict) -> None:
        """Fetch again from {TopicPartition: offset} (an aborted batch's first offsets), for the
        partitions this member still owns; others are replayed by their new owner."""
        from confluent_kafka import KafkaException
        from confluent_kafka import TopicPartition as CkTopicPartition

        for tp, off in offsets.items():
            if tp in self._assigned:
                try:
                    self._c.seek(CkTopicPartition(tp.topic, tp.partition, int(off)))
                except KafkaException as exc:
                    # lost meanwhile (the rebalance callback has not run yet): its next owner
                    # starts from the committed offset, which the aborted batch never moved
                    log.warning("rewind of %s[%d] skipped: %s", tp.topic, tp.partition, exc)

    def close(self, autocommit: bool = False) -> None:
        """Leave the group (auto commit is off: nothing is committed here), free the handle."""
        self._c.close()
