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

from infra.config import Settings


class DeliveryError(RuntimeError):
    """The broker refused a message (or librdkafka gave up on it)."""


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

    def get(self, timeout: float = 30.0) -> "Delivery":
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
    """acks=all, the same batching as stream.topics.make_producer, murmur2 partitioner (a key's
    partition is the one kafka-python and Java clients pick); `librdkafka` adds or overrides
    librdkafka settings (e.g. message.timeout.ms)."""

    def __init__(self, settings: Settings, client_id: str = "astec", linger_ms: int = 2,
                 **librdkafka: object):
        from confluent_kafka import Producer
        self._p = Producer({
            "bootstrap.servers": settings.kafka_bootstrap, "client.id": client_id, "acks": "all",
            "linger.ms": linger_ms, "batch.size": 65536, "retries": 5,
            "max.in.flight.requests.per.connection": 5,
            "message.max.bytes": max(1048576, 4 * settings.max_message_bytes),
            "partitioner": "murmur2_random",
            # librdkafka's own log lines go through logging (the worker's format), not raw stderr
            "logger": logging.getLogger("stream.librdkafka"), **librdkafka})

    def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> Delivery:
        d = Delivery(self._p)
        while True:
            try:
                self._p.produce(topic, value, key, on_delivery=d._report)
                break
            except BufferError:   # librdkafka's local queue is full: let it drain
                self._p.poll(0.01)
        self._p.poll(0)
        return d

    def flush(self, timeout: float | None = None) -> None:
        left = self._p.flush(-1 if timeout is None else timeout)
        if left:
            raise DeliveryError(f"{left} messages unacknowledged after {timeout}s")

    def close(self, timeout: float | None = None) -> None:
        """Flush, then release librdkafka's threads and sockets (a producer left open keeps
        reconnecting to a broker that went away)."""
        if self._p.flush(-1 if timeout is None else timeout):
            self._p.purge()   # unacknowledged: their batches were never committed, so they replay
            self._p.flush(0)
        self._p.close()
