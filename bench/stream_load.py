"""The load side of `astec bench stream`: a page-view producer and an ad-queries reader.

The producer stands in for the web front ends, which run off this box in production; here it
shares the two cores with the broker, Redis and the workers. On librdkafka (confluent-kafka) it
costs about a quarter of kafka-python's CPU per page view (41 vs 172 us at 1,000/s, both
acks=all, linger 5 ms), so the figures measure less of the load generator.
`--load-client kafka-python` keeps the pure-Python producer.
"""

from __future__ import annotations

import json
import threading
import time

from stream.settings import Settings
from stream.topics import make_consumer, make_producer

CLIENTS = ("confluent", "kafka-python")


def default_client() -> str:
    try:
        import confluent_kafka  # noqa: F401

        return "confluent"
    except ImportError:
        return "kafka-python"


class ConfluentProducer:
    """`send(topic, key, value)` / `flush` / `close` on librdkafka; a refused page view raises at
    the next flush, so a phase never reports latency over events the broker did not take."""

    def __init__(self, settings: Settings, linger_ms: int = 5):
        from stream.rdkafka_producer import RdProducer

        self.p = RdProducer(settings, "astec-bench-load", linger_ms)
        self.sent: list = []

    def send(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append(self.p.send(topic, value, key))

    def flush(self, timeout: float = 60.0) -> None:
        self.p.flush(timeout)
        failed = [d.error for d in self.sent if d.error is not None]
        self.sent = []
        if failed:
            raise RuntimeError(
                f"load generator: {len(failed)} page views refused (first: {failed[0]})"
            )

    def close(self, timeout: float = 10.0) -> None:
        self.p.close(timeout)


class KafkaPythonProducer:
    def __init__(self, settings: Settings, linger_ms: int = 5):
        self.p = make_producer(settings, linger_ms=linger_ms)

    def send(self, topic: str, key: bytes, value: bytes) -> None:
        self.p.send(topic, key=key, value=value)

    def flush(self, timeout: float = 60.0) -> None:
        self.p.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.p.close(timeout=timeout)


def make_load_producer(client: str, settings: Settings):
    return ConfluentProducer(settings) if client == "confluent" else KafkaPythonProducer(settings)


class AdReader(threading.Thread):
    """Reads ad-queries from the start of a fresh topic; records per-event arrival times.

    It stands in for the ad servers, off this box in production, so it follows the load client:
    librdkafka (its fetches off the GIL, and off most of the CPU a Python client spends) or
    kafka-python. An earlier note here said librdkafka's consumer got messages ~500 ms late on
    Tansu; that was the probe's `Consumer.consume(10, 0.5)`, which waits its whole timeout unless
    10 messages come (polled one at a time: ~3 ms, as kafka-python)."""

    def __init__(self, settings: Settings, client: str = "kafka-python"):
        super().__init__(daemon=True)
        if client == "confluent":
            from stream.rdkafka_consumer import RdConsumer

            self.consumer = RdConsumer(
                settings,
                [],
                f"astec-bench-reader-{settings.topics.ad_queries}",
                "astec-bench-reader",
            )
            self.consumer.assign_from_start(settings.topics.ad_queries, settings.topics.partitions)
        else:
            self.consumer = make_consumer(
                settings, [settings.topics.ad_queries], None, max_poll_records=5000
            )
        self.stop_event = threading.Event()
        self.arrivals: dict[str, tuple[float, float, float]] = {}  # eid -> (recv, event_ts, ad ts)
        self.duplicates = 0

    def run(self) -> None:
        while not self.stop_event.is_set():
            polled = self.consumer.poll(timeout_ms=50, max_records=5000)
            now = time.time()
            for recs in polled.values():
                for r in recs:
                    m = json.loads(r.value)
                    if m["event_id"] in self.arrivals:
                        self.duplicates += 1
                    else:
                        self.arrivals[m["event_id"]] = (now, m["event_ts"], m["ts"])
        self.consumer.close()

    def wait(self, ids: list[str], timeout: float) -> bool:
        """Whether every one of `ids` arrived within `timeout` s (arrivals of other ids, such
        as a phase's warm-up, do not count)."""
        deadline = time.monotonic() + timeout
        pending = list(ids)
        while time.monotonic() < deadline:
            pending = [e for e in pending if e not in self.arrivals]
            if not pending:
                return True
            time.sleep(0.02)
        return False
