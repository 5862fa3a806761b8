"""A librdkafka (confluent-kafka) producer behind kafka-python's producer interface.

The workers hand every ad query to a producer while their main thread predicts. kafka-python's
sender is a Python thread: it waits for the GIL, and spends ~170 us of CPU per message on these
2 cores (41 us with librdkafka, whose threads run without the GIL; `astec bench stream`'s load
generator measured both). `send` returns a `Delivery` with kafka-python's future interface
(`is_done`, `get`), so the worker's settle-then-commit logic is unchanged: an offset is committed
only after the broker acknowledged every message its batch produced.
"""

from __future__ import annotations

import logging
import time

from stream.settings import Settings


class DeliveryError(RuntimeError):
    """The broker refused a message (or librdkafka gave up on it)."""


class TransactionAborted(RuntimeError):
    """The transaction could not commit and was aborted: its messages are never visible to
    read-committed readers and its input offsets were not committed, so the batch is replayed."""


class TransactionFatal(RuntimeError):
    """The producer cannot go on (fenced by a newer incarnation of the same transactional id,
    or a fatal broker error): the process must restart and re-initialise its transactions."""


class Delivery:
    """One message's acknowledgement; delivery reports are served by polling the producer."""

    __slots__ = ("_producer", "done", "error")

    def __init__(self, producer):
        self._producer = producer
        self.done = False
        self.error = None

    def _report(self, err, _msg) -> None:
        self.done, self.error = True, err

    @property
    def is_done(self) -> bool:
        if not self.done:
            self._producer.poll(0)
        return self.done

    def get(self, timeout: float = 30.0) -> Delivery:
        deadline = time.monotonic() + timeout
        while not self.done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeliveryError(f"no acknowledgement within {timeout}s")
            self._producer.poll(min(left, 0.05))
        if self.error is not None:
            raise DeliveryError(str(self.error))
        return self


class RdProducer:
    """Idempotent, acks=all, retried without limit within producer.delivery_timeout_ms (a leader
    election or a broker restart is waited out; the broker drops the retries' duplicates), the
    same batching as stream.topics.make_producer, murmur2 partitioner (a key's partition is the
    one kafka-python and Java clients pick); `librdkafka` adds or overrides librdkafka settings.
    A message still unacknowledged after the timeout fails its Delivery: the worker stops
    without committing, and its restart replays the batch (never a loss)."""

    def __init__(
        self, settings: Settings, client_id: str = "astec", linger_ms: int = 2, **librdkafka: object
    ):
        from confluent_kafka import Producer

        self._p = Producer(
            {
                **settings.kafka.librdkafka_options(),
                "client.id": client_id,
                "acks": "all",
                "enable.idempotence": True,
                "message.timeout.ms": settings.producer.delivery_timeout_ms,
                "linger.ms": linger_ms,
                "batch.size": 65536,
                "max.in.flight.requests.per.connection": 5,
                "message.max.bytes": max(1048576, 4 * settings.topics.max_message_bytes),
                "partitioner": "murmur2_random",
                # small requests must not wait out Nagle + delayed ACK (~40 ms on loopback):
                # they doubled a transaction commit's time, and the plain produce's tail with it
                "socket.nagle.disable": True,
                # librdkafka's own log lines go through logging (the worker's format), not stderr
                "logger": logging.getLogger("stream.librdkafka"),
                **librdkafka,
            }
        )

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> Delivery:
        d = Delivery(self._p)
        while True:
            try:
                self._p.produce(topic, value, key, on_delivery=d._report)
                break
            except BufferError:  # librdkafka's local queue is full: let it drain
                self._p.poll(0.01)
        self._p.poll(0)
        return d

    # ---- transactions (exactly-once output) -------------------------------------------------
    def init_transactions(self, timeout: float = 60.0) -> None:
        """Register the transactional id; aborts what an earlier incarnation left open."""
        self._call(self._p.init_transactions, timeout)

    def begin_transaction(self) -> None:
        self._call(self._p.begin_transaction)

    def commit_transaction(self, offsets: dict, group_metadata, timeout: float = 120.0) -> None:
        """Commit the produced messages together with the consumer's input offsets
        ({TopicPartition: next offset}) under `group_metadata` (the consumer's
        consumer_group_metadata(): the broker refuses offsets of a stale generation).
        Retriable errors (a broker restarting) are retried for up to `timeout` seconds; a
        transaction the broker can no longer commit (its messages timed out, the group moved
        on) is aborted and TransactionAborted raised."""
        from confluent_kafka import KafkaException
        from confluent_kafka import TopicPartition as CkTopicPartition

        parts = [
            CkTopicPartition(tp.topic, tp.partition, int(getattr(o, "offset", o)))
            for tp, o in offsets.items()
        ]
        deadline = time.monotonic() + timeout
        step = "offsets" if parts else "commit"
        while True:
            try:
                if step == "offsets":
                    self._p.send_offsets_to_transaction(parts, group_metadata, 10.0)
                    step = "commit"
                self._p.commit_transaction(10.0)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal():
                    raise TransactionFatal(f"transactional producer: {err.str()}") from exc
                if err.retriable() and not err.txn_requires_abort() and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                self.abort_transaction()
                raise TransactionAborted(f"transaction aborted: {err.str()}") from exc

    def abort_transaction(self, timeout: float = 120.0) -> None:
        """Abort the open transaction (its messages are purged or marked aborted); retried
        while the broker is unreachable, for up to `timeout` seconds."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + timeout
        while True:
            try:
                self._p.abort_transaction(10.0)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal() or not err.retriable() or time.monotonic() > deadline:
                    raise TransactionFatal(f"cannot abort the transaction: {err.str()}") from exc
                time.sleep(0.2)

    @staticmethod
    def _call(fn, *args) -> None:
        from confluent_kafka import KafkaException

        try:
            fn(*args)
        except KafkaException as exc:
            raise TransactionFatal(f"transactional producer: {exc.args[0].str()}") from exc

    def flush(self, timeout: float | None = None) -> None:
        left = self._p.flush(-1 if timeout is None else timeout)
        if left:
            raise DeliveryError(f"{left} messages unacknowledged after {timeout}s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, then release librdkafka's threads and sockets (a producer left open keeps
        reconnecting to a broker that went away)."""
        if self._p.flush(-1 if timeout is None else timeout):
            self._p.purge()  # unacknowledged: their batches were never committed, so they replay
            self._p.flush(0)
        self._p.close()
