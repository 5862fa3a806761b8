"""Kafka clients built from Settings (with its security options), and idempotent topic creation.

Every stream command calls `ensure_topics` first, so a fresh broker (or a cluster without
auto-creation) has the topics with the configured partitions; it is a no-op when they exist.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from stream.settings import Settings


class KafkaUnavailable(RuntimeError):
    """No broker answered, or it refused the credentials: one line saying what to do."""


def check_kafka(settings: Settings, timeout_s: float = 5.0) -> None:
    """One metadata round trip, bounded in time: a missing broker or refused credentials is one
    clear error within timeout_s, instead of a client that keeps reconnecting."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    errors: list = []
    conf: dict[str, Any] = {
        **settings.librdkafka_options(),
        "error_cb": errors.append,
        "log_level": 0,
        "logger": logging.getLogger("stream.librdkafka.check"),
    }
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout_s
    refused = False
    while time.monotonic() < deadline and not refused:
        try:
            admin.list_topics(timeout=min(0.5, max(0.05, deadline - time.monotonic())))
            return
        except KafkaException:
            admin.poll(0)  # error callbacks are served here
            refused = any(e.code() == KafkaError._AUTHENTICATION for e in errors)
    where = settings.kafka_bootstrap
    if refused:
        raise KafkaUnavailable(
            f"the Kafka broker at {where} refused the credentials of user "
            f"{settings.kafka_sasl_username!r} ({settings.kafka_security_protocol}, "
            f"{settings.kafka_sasl_mechanism}): check KAFKA_SASL_USERNAME / KAFKA_SASL_PASSWORD "
            f"or the services directory (`astec infra env`)"
        )
    raise KafkaUnavailable(
        f"no Kafka broker answers at {where} within {timeout_s:.0f}s: start one "
        f"with `astec infra up` or set KAFKA_BOOTSTRAP (or --services-dir)"
    )


def ensure_topics(
    settings: Settings, topics: list[str] | None = None, timeout_s: float = 20.0
) -> None:
    """Create the stream's topics (settings.partitions each) unless they already exist."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    check_kafka(settings, min(timeout_s, 5.0))
    wanted = topics or settings.topics()
    admin = KafkaAdminClient(
        **settings.kafka_python_options(), request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        missing = [t for t in wanted if t not in set(admin.list_topics())]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):  # another process was first
                admin.create_topics(
                    [NewTopic(t, settings.partitions, settings.replication_factor) for t in missing]
                )
        deadline = time.monotonic() + timeout_s
        while set(wanted) - set(admin.list_topics()):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"topics {sorted(set(wanted) - set(admin.list_topics()))} "
                    f"not visible on {settings.kafka_bootstrap} after {timeout_s}s"
                )
            time.sleep(0.1)
    finally:
        admin.close()


def make_producer(settings: Settings, **overrides):
    """An acks=all producer; batching via linger keeps produce cheap per event."""
    from kafka import KafkaProducer

    cfg = dict(
        **settings.kafka_python_options(),
        acks="all",
        linger_ms=2,
        retries=5,
        max_in_flight_requests_per_connection=5,
        batch_size=65536,
        max_request_size=max(1048576, 4 * settings.max_message_bytes),
    )
    cfg.update(overrides)
    return KafkaProducer(**cfg)


def make_stream_producer(settings: Settings, client_id: str, transactional_id: str | None = None):
    """The workers' producer: librdkafka unless settings.producer_client is "kafka-python"
    (both with kafka-python's send / flush / close and futures); transactional (exactly-once)
    when given a transactional id (librdkafka only)."""
    if settings.producer_client == "kafka-python":
        return make_producer(settings, client_id=client_id, linger_ms=settings.producer_linger_ms)
    from stream.rdkafka_producer import RdProducer

    txn = (
        {}
        if transactional_id is None
        else {
            "transactional.id": transactional_id,
            "enable.idempotence": True,
            # also the produce timeout of its messages: a broker restart shorter than this is
            # waited out; a transaction left open by a supervisor that vanished for good holds
            # back read-committed readers of the partitions it wrote for at most this long
            "transaction.timeout.ms": 60000,
            # back-to-back transactions: the next one's AddOffsetsToTxn / AddPartitionsToTxn is
            # refused (CONCURRENT_TRANSACTIONS) until the broker has written the previous one's
            # markers, and retried after retry.backoff.ms: librdkafka's 100 ms default put that
            # wait into the commit's tail (docs/decisions.md)
            "retry.backoff.ms": 5,
            "retry.backoff.max.ms": 500,
        }
    )
    return RdProducer(settings, client_id, settings.producer_linger_ms, **txn)


def make_consumer(settings: Settings, topics: list[str], group_id: str | None, **overrides):
    """A manually committing consumer that reads committed data only (outputs of exactly-once
    workers: an aborted transaction's messages are never seen)."""
    from kafka import KafkaConsumer

    cfg = dict(
        **settings.kafka_python_options(),
        group_id=group_id,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.session_timeout_ms,
        heartbeat_interval_ms=settings.heartbeat_interval_ms,
        max_poll_interval_ms=settings.max_poll_interval_ms,
        max_poll_records=settings.batch_max,
        # the broker answers a fetch as soon as a record arrives: a long wait costs no latency,
        # a short one makes every idle consumer send ~50 empty fetches a second
        fetch_max_wait_ms=max(1, settings.fetch_wait_max_ms),
        retry_backoff_ms=max(1, settings.consumer_retry_backoff_ms),
        # a topic created just before the subscription may be missing from the first
        # metadata: the group then assigns nothing until the next refresh (5 min by
        # default), so refresh often
        metadata_max_age_ms=5000,
    )
    cfg.update(overrides)
    return KafkaConsumer(*topics, **cfg)


def make_stream_consumer(settings: Settings, topic: str, group_id: str, client_id: str, on_revoke):
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
        # the group's leader assigns partitions from its own metadata: a topic created moments
        # before may be missing there, and the group then split nothing until a later
        # rebalance (a two-worker group in CI stayed unassigned for 90 s). Join once this
        # member's metadata holds the topic's partitions (bounded: a missing topic is the
        # worker's unassigned warning to report, not a hang here)
        deadline = time.monotonic() + 10.0
        while not c.partitions_for_topic(topic) and time.monotonic() < deadline:
            time.sleep(0.1)
        c.subscribe([topic], listener=_Listener())
        return c
    from stream.rdkafka_consumer import RdConsumer

    return RdConsumer(settings, [topic], group_id, client_id, on_revoke=on_revoke)
