"""Kafka clients built from Settings, and idempotent topic creation.

Tansu's memory storage loses topics when the broker restarts, so every stream command calls
`ensure_topics` first; on a managed cluster the call is a no-op when the topics exist.
"""
from __future__ import annotations

import time

from infra.config import Settings


def ensure_topics(settings: Settings, topics: list[str] | None = None,
                  timeout_s: float = 20.0) -> None:
    """Create the stream's topics (settings.partitions each) unless they already exist."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    wanted = topics or settings.topics()
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap,
                             request_timeout_ms=int(timeout_s * 1000))
    try:
        missing = [t for t in wanted if t not in set(admin.list_topics())]
        if missing:
            try:
                admin.create_topics([NewTopic(t, settings.partitions, settings.replication_factor)
                                     for t in missing])
            except TopicAlreadyExistsError:
                pass
        deadline = time.monotonic() + timeout_s
        while set(wanted) - set(admin.list_topics()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"topics {sorted(set(wanted) - set(admin.list_topics()))} "
                                   f"not visible on {settings.kafka_bootstrap} after {timeout_s}s")
            time.sleep(0.1)
    finally:
        admin.close()


def make_producer(settings: Settings, **overrides):
    """An acks=all producer; batching via linger keeps produce cheap per event."""
    from kafka import KafkaProducer
    cfg = dict(bootstrap_servers=settings.kafka_bootstrap, acks="all", linger_ms=2,
               retries=5, max_in_flight_requests_per_connection=5, batch_size=65536,
               max_request_size=max(1048576, 4 * settings.max_message_bytes))
    cfg.update(overrides)
    return KafkaProducer(**cfg)


def make_stream_producer(settings: Settings, client_id: str):
    """The workers' producer: librdkafka unless settings.producer_client is "kafka-python"
    (both with kafka-python's send / flush / close and futures)."""
    if settings.producer_client == "kafka-python":
        return make_producer(settings, client_id=client_id, linger_ms=settings.producer_linger_ms)
    from stream.rdkafka_producer import RdProducer
    return RdProducer(settings, client_id, settings.producer_linger_ms)


def make_consumer(settings: Settings, topics: list[str], group_id: str | None, **overrides):
    """A manually committing consumer with Tansu-friendly group timeouts."""
    from kafka import KafkaConsumer
    cfg = dict(bootstrap_servers=settings.kafka_bootstrap, group_id=group_id,
               enable_auto_commit=False, auto_offset_reset="earliest",
               session_timeout_ms=settings.session_timeout_ms,
               heartbeat_interval_ms=settings.heartbeat_interval_ms,
               max_poll_interval_ms=settings.max_poll_interval_ms,
               max_poll_records=settings.batch_max,
               fetch_max_wait_ms=max(1, settings.poll_timeout_ms),
               retry_backoff_ms=max(1, settings.consumer_retry_backoff_ms))
    cfg.update(overrides)
    return KafkaConsumer(*topics, **cfg)


def make_stream_consumer(settings: Settings, topic: str, group_id: str, client_id: str,
                         on_revoke):
    """The workers' group consumer on `settings.consumer_client`, subscribed to `topic`;
    `on_revoke()` runs before partitions move to another member."""
    if settings.consumer_client == "kafka-python":
        from kafka import ConsumerRebalanceListener

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked) -> None:
                on_revoke()

            def on_partitions_assigned(self, assigned) -> None:
                pass

        c = make_consumer(settings, [], group_id, client_id=client_id)
        c.subscribe([topic], listener=_Listener())
        return c
    from stream.rdkafka_consumer import RdConsumer
    return RdConsumer(settings, [topic], group_id, client_id, on_revoke=on_revoke)
