"""Kafka clients built from Settings (with its security options), and idempotent topic creation.

Every stream command calls `ensure_topics` first, so a fresh broker (or a cluster without
auto-creation) has the topics with the configured partitions; it is a no-op when they exist.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from stream.settings import Settings

TXN_TIMEOUT_MS = 60000  # the workers' transaction.timeout.ms (the broker aborts older ones)


class KafkaUnavailable(RuntimeError):
    """No broker answered, or it refused the credentials: one line saying what to do."""


def check_kafka(settings: Settings, timeout_s: float = 5.0) -> None:
    """One metadata round trip, bounded in time: a missing broker or refused credentials is one
    clear error within timeout_s, instead of a client that keeps reconnecting."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    errors: list = []
    conf: dict[str, Any] = {
        **settings.kafka.librdkafka_options(),
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
    where = settings.kafka.bootstrap
    if refused:
        raise KafkaUnavailable(
            f"the Kafka broker at {where} refused the credentials of user "
            f"{settings.kafka.sasl_username!r} ({settings.kafka.security_protocol}, "
            f"{settings.kafka.sasl_mechanism}): check KAFKA_SASL_USERNAME / KAFKA_SASL_PASSWORD "
            f"or the services directory (`astec infra env`)"
        )
    raise KafkaUnavailable(
        f"no Kafka broker answers at {where} within {timeout_s:.0f}s: start one "
        f"with `astec infra up` or set KAFKA_BOOTSTRAP (or --services-dir)"
    )


class TopicMismatch(RuntimeError):
    """An existing topic's partitions or replication differ from the settings, or its
    min.insync.replicas is below theirs: one line naming the topic, what it has and what the
    settings expect (never silently used as it is)."""


def replication_for(settings: Settings, brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for new topics: the settings' where set, else
    3 / 2 on a cluster of 3+ brokers (a write survives one broker lost; an election never drops
    an acknowledged one), min(brokers, 3) / 1 on smaller ones."""
    rf = settings.topics.replication_factor or min(3, max(1, brokers))
    isr = settings.topics.min_insync_replicas or max(1, rf - 1)
    return rf, min(isr, rf)


def ensure_topics(
    settings: Settings, topics: list[str] | None = None, timeout_s: float = 20.0
) -> None:
    """Create the stream's topics unless they exist (settings.topics.partitions each,
    replication and min.insync.replicas from replication_for); raise TopicMismatch when an
    existing one has another partition count or replication factor than the settings give, or a
    lower min.insync.replicas (acks=all would then acknowledge a write held by fewer replicas than
    the settings promise: a leader lost could lose it)."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    check_kafka(settings, min(timeout_s, 5.0))
    wanted = topics or settings.topics.names()
    conf: dict[str, Any] = {
        **settings.kafka.librdkafka_options(),
        "log_level": 0,
        "logger": logging.getLogger("stream.librdkafka.admin"),
    }
    admin = AdminClient(conf)
    meta = admin.list_topics(timeout=timeout_s)
    rf, isr = replication_for(settings, len(meta.brokers))
    missing = [t for t in wanted if t not in meta.topics]
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(
                    t, settings.topics.partitions, rf, config={"min.insync.replicas": str(isr)}
                )
                for t in missing
            ],
            request_timeout=timeout_s,
        )
        for topic, fut in futures.items():
            try:
                fut.result(timeout_s)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # another was first
                    raise RuntimeError(f"creating topic {topic!r}: {exc.args[0].str()}") from None
    deadline = time.monotonic() + timeout_s
    while True:
        meta = admin.list_topics(timeout=timeout_s)
        absent = [t for t in wanted if t not in meta.topics or not meta.topics[t].partitions]
        if not absent:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"topics {sorted(absent)} not visible on {settings.kafka.bootstrap} "
                f"after {timeout_s}s"
            )
        time.sleep(0.1)
    for t in wanted:
        parts = meta.topics[t].partitions
        replicas = {len(p.replicas) for p in parts.values()}
        # derived (replication_factor 0): fewer than the cluster's size calls for is refused,
        # more is a cluster with a broker down right now
        wrong_rf = replicas != {rf} if settings.topics.replication_factor else min(replicas) < rf
        if len(parts) != settings.topics.partitions or wrong_rf:
            raise TopicMismatch(
                f"topic {t!r} on {settings.kafka.bootstrap} has {len(parts)} partitions with "
                f"replication {'/'.join(map(str, sorted(replicas)))}, the settings expect "
                f"{settings.topics.partitions} with replication {rf} (partitions / "
                f"replication_factor): recreate the topic or change the settings"
            )
    _check_min_isr(admin, settings, wanted, isr, timeout_s)


def _check_min_isr(admin, settings: Settings, topics: list[str], isr: int, timeout_s: float):
    """Refuse a topic whose min.insync.replicas (its own or the broker default) is below `isr`;
    a higher one is stricter, and accepted. A topic just created may not be known yet to the
    broker answering (UNKNOWN_TOPIC_OR_PART): asked again until timeout_s. Where the
    credentials may not describe configs, one warning says the check was skipped."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import ConfigResource

    deadline = time.monotonic() + timeout_s
    for t in topics:
        res = ConfigResource(ConfigResource.Type.TOPIC, t)
        while True:
            try:
                entry = admin.describe_configs([res])[res].result(timeout_s)
                break
            except KafkaException as exc:
                code = exc.args[0].code()
                if code == KafkaError.UNKNOWN_TOPIC_OR_PART and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                if code in (
                    KafkaError.TOPIC_AUTHORIZATION_FAILED,
                    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
                ):
                    logging.getLogger(__name__).warning(
                        "min.insync.replicas of topic %r not checked: %s", t, exc.args[0].str()
                    )
                    entry = None
                    break
                raise
        if entry is None:
            continue
        cfg = entry.get("min.insync.replicas")
        have = int(cfg.value) if cfg is not None and cfg.value else 1
        if have < isr:
            raise TopicMismatch(
                f"topic {t!r} on {settings.kafka.bootstrap} has min.insync.replicas "
                f"{have}, the settings expect at least {isr} (min_insync_replicas): raise the "
                f"topic's min.insync.replicas or change the settings"
            )


def make_producer(settings: Settings, **overrides):
    """An idempotent acks=all producer, retried without limit within delivery_timeout_ms (as
    stream.rdkafka_producer's); batching via linger keeps produce cheap per event."""
    from kafka import KafkaProducer

    cfg = dict(
        **settings.kafka.kafka_python_options(),
        acks="all",
        enable_idempotence=True,
        delivery_timeout_ms=settings.producer.delivery_timeout_ms,
        linger_ms=2,
        max_in_flight_requests_per_connection=5,
        batch_size=65536,
        max_request_size=max(1048576, 4 * settings.topics.max_message_bytes),
    )
    cfg.update(overrides)
    return KafkaProducer(**cfg)


def make_stream_producer(settings: Settings, client_id: str, transactional_id: str | None = None):
    """The workers' producer: librdkafka unless settings.producer.client is "kafka-python"
    (both with kafka-python's send / flush / close and futures); transactional (exactly-once)
    when given a transactional id (librdkafka only)."""
    if settings.producer.client == "kafka-python":
        return make_producer(settings, client_id=client_id, linger_ms=settings.producer.linger_ms)
    from stream.rdkafka_producer import RdProducer

    txn = (
        {}
        if transactional_id is None
        else {
            "transactional.id": transactional_id,
            # a transaction left open by a supervisor that vanished for good holds back
            # read-committed readers of the partitions it wrote for at most this long; its
            # messages' produce timeout cannot exceed it
            "transaction.timeout.ms": TXN_TIMEOUT_MS,
            "message.timeout.ms": min(TXN_TIMEOUT_MS, settings.producer.delivery_timeout_ms),
            # back-to-back transactions: the next one's AddOffsetsToTxn / AddPartitionsToTxn is
            # refused (CONCURRENT_TRANSACTIONS) until the broker has written the previous one's
            # markers, and retried after retry.backoff.ms: librdkafka's 100 ms default put that
            # wait into the commit's tail (docs/decisions.md)
            "retry.backoff.ms": 5,
            "retry.backoff.max.ms": 500,
        }
    )
    return RdProducer(settings, client_id, settings.producer.linger_ms, **txn)


def make_consumer(
    settings: Settings, topics: list[str], group_id: str | None, cls: Any = None, **overrides
):
    """A manually committing consumer that reads committed data only (outputs of exactly-once
    workers: an aborted transaction's messages are never seen); `cls`: a KafkaConsumer
    subclass to build instead."""
    from kafka import KafkaConsumer

    cfg = dict(
        **settings.kafka.kafka_python_options(),
        group_id=group_id,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=settings.consumer.session_timeout_ms,
        heartbeat_interval_ms=settings.consumer.heartbeat_interval_ms,
        max_poll_interval_ms=settings.consumer.max_poll_interval_ms,
        max_poll_records=settings.consumer.batch_max,
        # the broker answers a fetch as soon as a record arrives: a long wait costs no latency,
        # a short one makes every idle consumer send ~50 empty fetches a second
        fetch_max_wait_ms=max(1, settings.consumer.fetch_wait_max_ms),
        retry_backoff_ms=max(1, settings.consumer.retry_backoff_ms),
        # a topic created just before the subscription may be missing from the first
        # metadata: the group then assigns nothing until the next refresh (5 min by
        # default), so refresh often
        metadata_max_age_ms=5000,
    )
    cfg.update(overrides)
    return (cls or KafkaConsumer)(*topics, **cfg)


def _await_stranded_join(coordinator: Any) -> None:
    """kafka-python 3.0: a leader that rejoins because its metadata changed stops needing to
    rejoin once it has computed the assignment, so a poll that times out while its SyncGroup is
    in flight leaves the join unfinished: later polls never wait for it, its heartbeats stay
    off, the broker evicts it, and it goes on believing it owns every partition (a two-worker
    group stayed unsplit for 90 s, about 1 run in 20). Asking to rejoin makes the next poll wait
    for that join (or start a new one if it has ended)."""
    if getattr(coordinator, "_join_task", None) is not None and not coordinator.need_rejoin():
        logging.getLogger(__name__).warning(
            "group %s: kafka-python left its join unfinished; finishing it", coordinator.group_id
        )
        coordinator.request_rejoin()


def make_stream_consumer(
    settings: Settings,
    topic: str,
    group_id: str,
    client_id: str,
    on_revoke: Callable[[set], None],
    instance_id: str | None = None,
    on_lost: Callable[[set], None] | None = None,
):
    """The workers' group consumer on `settings.consumer.client`, subscribed to `topic`, with
    cooperative-sticky assignment and, given `instance_id`, static membership;
    `on_revoke(partitions)` runs before partitions move to another member, `on_lost(partitions)`
    when they already have."""
    if settings.consumer.client == "kafka-python":
        from kafka import ConsumerRebalanceListener, KafkaConsumer
        from kafka.coordinator.assignors.cooperative_sticky import (
            CooperativeStickyAssignor,
        )

        # kafka-python runs rebalance listeners on its I/O thread, and a blocking commit there
        # waits for that same thread: it raised, and the worker died at every scale-out with
        # batches in flight. Commits made inside the listener are sent without waiting: they
        # are queued on the coordinator's connection ahead of the follow-up JoinGroup that
        # hands the revoked partitions over, so the new owner still starts after them.
        in_listener = threading.local()

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked) -> None:
                in_listener.on = True
                try:
                    on_revoke(set(revoked))
                finally:
                    in_listener.on = False

            def on_partitions_assigned(self, assigned) -> None:
                pass

            def on_partitions_lost(self, lost) -> None:
                (on_lost or on_revoke)(set(lost))

        class _Consumer(KafkaConsumer):
            def commit(self, offsets=None, timeout_ms=None):
                if getattr(in_listener, "on", False):
                    return self.commit_async(offsets)
                return super().commit(offsets, timeout_ms)

            def poll(self, timeout_ms=0, max_records=None, update_offsets=True):
                records = super().poll(timeout_ms, max_records, update_offsets)
                _await_stranded_join(self._coordinator)
                return records

        c = make_consumer(
            settings,
            [],
            group_id,
            cls=_Consumer,
            client_id=client_id,
            group_instance_id=instance_id,
            partition_assignment_strategy=(CooperativeStickyAssignor,),
        )
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

    return RdConsumer(
        settings,
        [topic],
        group_id,
        client_id,
        on_revoke=on_revoke,
        instance_id=instance_id,
        on_lost=on_lost,
    )
