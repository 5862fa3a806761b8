"""One stream consumer: page views -> top-k queries -> user state -> one ad query.

Per batch: poll -> reload the model / policy if a new version was promoted -> the stages of
stream.batch_stages: decode (bad -> dead-letter topic) -> predict (batched) -> state (Redis: one
pipelined, idempotent append per event) -> choose (the policy) -> emit (produce ad queries).
Clients (Kafka consumer and producer, Redis) are built from the settings or injected.

Exactly-once (`delivery = "exactly-once"`): each polled batch is one Kafka
transaction holding its ad queries, its dead letters and its input offsets (Kafka's
consume-transform-produce). A crash or a refused commit aborts it: read-committed readers never
see its messages and the batch is processed again, so the output holds each answer once. Redis
state is idempotent by event id, so the replay never appends a visit twice.

At-least-once (the default: exactly-once's per-batch commit costs more latency than the targets
allow on 2 cores, docs/benchmarks-stream.md): the broker's acknowledgement wait overlaps the next
batch (at most `max_in_flight` batches, settled strictly in order); settled offsets are
committed every `commit_interval_ms`, on SIGTERM and before a rebalance. A crash replays the
uncommitted batches: duplicates can appear on `ad-queries` (counted), never a lost event.
SIGTERM/SIGINT: finish the batch, commit, leave the group.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
from kafka.structs import TopicPartition

from stream.batch_stages import Batch, Outbox, Stage, default_stages
from stream.consumer_metrics import ConsumerMetrics, PromExporter, publish
from stream.model_handle import ModelHandle, load_predictor
from stream.policy_handle import Policy, make_policy
from stream.rdkafka_producer import TransactionAborted
from stream.settings import Settings
from stream.state_store import StateStore, connect
from stream.topics import make_stream_consumer, make_stream_producer
from stream.worker_health import WorkerHealth

log = logging.getLogger(__name__)
TXN_STALL_S = 20.0  # a transaction commit blocked this long is stuck (_commit_or_replace)


@dataclass
class InFlight:
    """A processed batch whose produced messages may not be acknowledged yet."""

    futures: list
    offsets: dict  # TopicPartition -> next offset to read
    first: dict  # TopicPartition -> the batch's first offset (where a replay rewinds to)
    t0: float  # perf_counter at the start of the batch
    event_ts: np.ndarray
    events: int = 0
    dead: int = 0
    duplicates: int = 0
    stages: dict = field(default_factory=dict)


def offset_range(records) -> tuple[dict, dict]:
    """Per partition of a batch: (its first offset, the next offset to read after it)."""
    first: dict = {}
    nxt: dict = {}
    for r in records:
        tp = TopicPartition(r.topic, r.partition)
        first[tp] = min(first.get(tp, r.offset), r.offset)
        nxt[tp] = max(nxt.get(tp, 0), r.offset + 1)
    return first, nxt


@dataclass
class Clients:
    """The worker's connections: built by `connect`, or injected (StreamWorker(clients=...)).
    An injected consumer must call the worker's `commit_before_rebalance` when its partitions
    are revoked; `new_producer` makes a producer with the same transactional id (exactly-once:
    it replaces one stuck in a commit)."""

    consumer: Any
    producer: Any
    redis: redis.Redis
    new_producer: Callable[[], Any]

    @classmethod
    def connect(
        cls,
        settings: Settings,
        client_id: str,
        transactional_id: str | None,
        on_revoke: Callable[[], None],
    ) -> Clients:
        def new_producer() -> Any:
            p = make_stream_producer(settings, client_id, transactional_id)
            if transactional_id:
                p.init_transactions()
            return p

        redis_client = connect(settings.redis_url)
        producer = new_producer()
        consumer = make_stream_consumer(
            settings,
            settings.topic_page_views,
            settings.consumer_group,
            client_id,
            on_revoke=on_revoke,
        )
        return cls(consumer, producer, redis_client, new_producer)


class StreamWorker:
    """A consumer-group member over `page-views`; `run()` until stop() or SIGTERM.

    `clients` (Kafka consumer and producer, Redis) and `stages` (stream.batch_stages) are built
    from the settings unless given."""

    def __init__(
        self,
        settings: Settings,
        model: ModelHandle,
        policy: Policy,
        consumer_id: str | None = None,
        metrics_port: int = 0,
        transactional_id: str | None = None,
        clients: Clients | None = None,
        stages: list[tuple[str, Stage]] | None = None,
    ):
        self.s = settings
        self.model = model
        self.policy = policy
        self.cid = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.exactly_once = settings.delivery == "exactly-once"
        if self.exactly_once and "kafka-python" in (
            settings.producer_client,
            settings.consumer_client,
        ):
            raise ValueError(
                "delivery = exactly-once needs the confluent (librdkafka) consumer and "
                "producer; set producer_client/consumer_client to confluent or "
                "delivery to at-least-once"
            )
        self.stop_event = threading.Event()
        # a stable transactional id per worker slot: a restarted worker fences its dead
        # predecessor and aborts the transaction it left open (which would otherwise hold back
        # read-committed readers of the partitions it wrote until the transaction timed out)
        self.transactional_id = (
            transactional_id or f"{settings.consumer_group}-{self.cid}"
            if self.exactly_once
            else None
        )
        # the broker was checked once by the command that started the workers (ensure_topics)
        self.clients = clients or Clients.connect(
            settings, f"astec-{self.cid}", self.transactional_id, self.commit_before_rebalance
        )
        self.consumer = self.clients.consumer
        self.producer = self.clients.producer
        self.redis = self.clients.redis
        self.store = StateStore.from_settings(self.redis, settings)
        self.stages = stages or default_stages(settings, model, policy, self._append_with_backoff)
        self.aborted = 0  # transactions aborted and replayed (exactly-once)
        self.pending_offsets: dict = {}  # settled but not yet committed (commit_interval_ms)
        self._last_commit = time.monotonic()
        self.metrics = ConsumerMetrics(self.cid, policy.name, model.version)
        self.commit_failures = 0
        self.max_in_flight = 4
        self.inflight: deque[InFlight] = deque()
        self.health = WorkerHealth(self)  # Redis outages held in the group; /healthz, /readyz
        self.prom = (
            PromExporter(metrics_port, self.cid, settings.metrics_host, self.health)
            if metrics_port
            else None
        )
        self._last_publish = 0.0
        self._unassigned_since: float | None = None  # owning no partition since (monotonic)
        self._last_unassigned_warning = 0.0

    # ---- lifecycle ----------------------------------------------------------------------
    def stop(self, *_args) -> None:
        self.stop_event.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)

    def run(self, max_seconds: float | None = None) -> None:
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        try:
            while not self.stop_event.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    break
                # with batches awaiting acks, poll again within poll_timeout_ms to settle them;
                # polling faster (it was a quarter of that) only woke the loop and kafka-python's
                # I/O threads more often (README: paced p99 medians 90 -> 53 ms at 500/s)
                wait = self.s.poll_timeout_ms if self.inflight else self.s.poll_timeout_ms * 5
                polled = self.consumer.poll(timeout_ms=max(1, wait), max_records=self.s.batch_max)
                self.health.polled()
                records = [r for rs in polled.values() for r in rs]
                if self.exactly_once:
                    if records:
                        self.process_transaction(records)
                else:
                    if records:
                        self.inflight.append(self.process(records))
                    self.settle(block=len(self.inflight) > self.max_in_flight)
                self._maybe_publish()
            if not self.exactly_once:
                self.settle(block=True)  # graceful stop: everything acknowledged and committed
        finally:
            self.close()

    def close(self) -> None:
        """Leave the group (fast rebalance for the others), flush, publish final metrics."""
        with contextlib.suppress(redis.RedisError):
            self._maybe_publish(force=True)
        try:
            if not self.exactly_once:
                self.producer.flush(timeout=10)
            self.producer.close(timeout=10)
        finally:
            self.consumer.close(autocommit=False)
            self.redis.close()

    def process_transaction(self, records) -> bool:
        """One batch as one transaction: outputs and input offsets commit together, or the
        transaction is aborted and the batch's partitions are rewound to be processed again.
        Returns whether it committed."""
        self.producer.begin_transaction()
        b = self.process(records)
        t_commit = time.perf_counter()
        try:
            self._commit_or_replace(b.offsets)
        except TransactionAborted as exc:
            self.aborted += 1
            log.warning("%s: %s; replaying %d events", self.cid, exc, len(records))
            self.consumer.rewind(b.first)
            return False
        self._record(b, time.perf_counter() - t_commit)
        return True

    def _record(self, b: InFlight, kafka_wait_s: float) -> None:
        """A settled batch into the metrics: its ack (or commit) wait counts as the kafka stage,
        its events' latency runs from their timestamps to now."""
        now_pc, now = time.perf_counter(), time.time()
        b.stages["kafka"] = b.stages.get("kafka", 0.0) + kafka_wait_s
        e2a = (now - b.event_ts) * 1000.0
        self.metrics.record_batch(b.events, b.dead, b.duplicates, now_pc - b.t0, e2a, b.stages)
        if self.prom:
            self.prom.observe(b.events, b.dead, now_pc - b.t0, e2a, self.model.version)

    def _commit_or_replace(self, offsets: dict) -> None:
        """Commit the open transaction with `offsets` on the committer thread.

        librdkafka's send_offsets_to_transaction can block far past its timeout when the group
        coordinator went away (confluentinc/librdkafka#5456 and #5511; here, every time the
        broker is killed and restarts mid-transaction). A commit stuck for TXN_STALL_S is given
        up: a new producer with the same transactional id fences the stuck one, the broker
        aborts its transaction, and TransactionAborted makes the batch replay. The stuck call's
        thread is left to end on its own (it fails once fenced)."""
        done = threading.Event()
        outcome: list = []

        def commit() -> None:
            try:
                self.producer.commit_transaction(offsets, self.consumer)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the worker's thread
                outcome.append(exc)
            done.set()

        # a daemon thread per commit (~0.1 ms against a ~7 ms commit): a stuck one must never
        # keep the process from exiting
        threading.Thread(target=commit, name="astec-txn-commit", daemon=True).start()
        if done.wait(TXN_STALL_S):
            if outcome[0] is not None:
                raise outcome[0]
            return
        log.error(
            "%s: transaction commit stuck for %.0fs in librdkafka; replacing the producer "
            "(same transactional id) and replaying the batch",
            self.cid,
            TXN_STALL_S,
        )
        self.producer = self.clients.producer = self.clients.new_producer()
        raise TransactionAborted(f"commit stuck for {TXN_STALL_S:.0f}s; producer replaced")

    def settle(self, block: bool = False) -> int:
        """Commit the offsets of the oldest batches whose messages are all acknowledged.

        Batches settle strictly in order; a failed produce raises (no commit: the uncommitted
        batches replay after the restart). Returns the number of batches settled.
        """
        offsets: dict = {}
        n = 0
        while self.inflight:
            b = self.inflight[0]
            t_wait = time.perf_counter()
            if block:
                self.producer.flush()
            elif not all(f.is_done for f in b.futures):
                break
            for f in b.futures:
                f.get(timeout=30)  # raises if the broker refused a message
            self._record(b, time.perf_counter() - t_wait if block else 0.0)
            offsets.update(b.offsets)  # later batches carry later offsets
            self.inflight.popleft()
            n += 1
        self.pending_offsets.update(offsets)
        if self.pending_offsets and (
            block or time.monotonic() - self._last_commit >= self.s.commit_interval_ms / 1000.0
        ):
            self.commit_pending(wait=block)
        return n

    def commit_before_rebalance(self) -> None:
        """Before partitions move to another member, commit what this worker has settled on them,
        so the new owner replays as little as possible (replays are harmless, just wasted work)."""
        try:
            self.commit_pending()
        except Exception as exc:  # noqa: BLE001 - the new owner replays; never break the rejoin
            log.warning("%s: commit before rebalance failed: %s", self.cid, exc)

    def commit_pending(self, wait: bool = True) -> None:
        """Commit the settled batches' offsets (a no-op when there are none); wait=False does
        not wait for the coordinator where the consumer can commit asynchronously (the periodic
        commit; on shutdown and before a rebalance the commit is waited for)."""
        if self.pending_offsets:
            offsets, self.pending_offsets = self.pending_offsets, {}
            self.commit(offsets, wait)
        self._last_commit = time.monotonic()

    def commit(self, offsets: dict, wait: bool = True) -> None:
        from kafka.errors import CommitFailedError, KafkaError
        from kafka.structs import OffsetAndMetadata

        meta = {tp: OffsetAndMetadata(o, None, -1) for tp, o in offsets.items()}
        commit_async = getattr(self.consumer, "commit_async", None)
        try:
            if not wait and commit_async is not None:
                commit_async(meta)
            else:
                self.consumer.commit(meta)
        except (CommitFailedError, KafkaError) as exc:
            # the partitions moved to another member: it replays them (idempotent state)
            self.commit_failures += 1
            log.warning("%s: commit failed (%s); the batch will be replayed", self.cid, exc)

    def _maybe_publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_publish >= self.s.metrics_interval_s:
            self._last_publish = now
            self.metrics.model_version = self.model.version
            self.metrics.partitions = len(self.consumer.assignment())
            self.metrics.refused_versions = len(self.model.refused) + len(self.policy.refused)
            self.metrics.commit_failures = self.commit_failures
            self._warn_if_unassigned(now)
            lag = getattr(self.consumer, "lag", None)
            self.metrics.lag = lag() if lag is not None else None
            try:
                publish(self.redis, self.s.redis_key_prefix, self.metrics)
            except redis.RedisError as exc:
                log.warning("%s: metrics not published: %s", self.cid, exc)

    def _warn_if_unassigned(self, now: float) -> None:
        """A member that owns no partition for longer than a session timeout answers nothing:
        say so (once a minute) instead of idling silently; `partitions` = 0 in its metrics."""
        if self.metrics.partitions:
            self._unassigned_since = None
            return
        if self._unassigned_since is None:
            self._unassigned_since = now
        idle = now - self._unassigned_since
        if (
            idle > self.s.session_timeout_ms / 1000.0
            and now - self._last_unassigned_warning >= 60.0
        ):
            self._last_unassigned_warning = now
            log.warning(
                "%s: no partition of %s assigned for %.0fs (more workers in group %s "
                "than partitions, or the group cannot rebalance)",
                self.cid,
                self.s.topic_page_views,
                idle,
                self.s.consumer_group,
            )

    # ---- one batch ----------------------------------------------------------------------
    def process(self, records) -> InFlight:
        """Everything of a batch up to handing the ad queries to the producer (no ack wait):
        the stages of stream.batch_stages in order, each timed under its metric name.

        No single event can stop the worker: whatever fails while handling one event (its
        decoding, prediction, state, Redis write, policy or produce) sends that event to the
        dead letters with the reason, and the rest of the batch goes on. Only what is not an
        event's fault (Redis or the broker unreachable) raises or is retried. A newly promoted
        model or policy is switched to before the batch (its load time counts as predict)."""
        t0 = time.perf_counter()
        self.model.maybe_reload()
        self.policy.maybe_reload()
        t = time.perf_counter()
        stages = {"predict": t - t0}
        out = Outbox(self.producer.send, self.s.topic_dead_letters, self.cid)
        batch = Batch(list(records))
        for name, stage in self.stages:
            if not batch and name != "decode":
                break
            stage(batch, out)
            now = time.perf_counter()
            stages[name] = stages.get(name, 0.0) + (now - t)
            t = now
        self.metrics.no_query += batch.no_query
        first, nxt = offset_range(records)
        return InFlight(
            out.futures,
            nxt,
            first,
            t0,
            np.array(batch.answered_ts, np.float64),
            events=len(batch.answered_ts),
            dead=out.dead,
            duplicates=batch.duplicates,
            stages=stages,
        )

    def _append_with_backoff(self, user_ids, states, with_history: bool):
        """The state stage's Redis append (the one call of the store's append), retried while
        Redis is unavailable with the partitions paused and polled (stream.worker_health: the
        worker stays in its group; the batch stays uncommitted); per-event refusals come back as
        reasons."""
        if not states:
            return [], [], []
        return self.health.retry_redis(
            lambda: self.store.append_batch_checked(user_ids, states, with_history)
        )


def worker_main(
    settings: Settings,
    model_path: str,
    policy_name: str,
    policy_model: str | None,
    consumer_id: str,
    metrics_port: int = 0,
    threads: int = 1,
    transactional_id: str | None = None,
) -> None:
    """Entry point of one worker process (also used in-process for --workers 1)."""
    logging.basicConfig(
        level=int(os.environ.get("ASTEC_LOG_LEVEL", logging.INFO)),
        format=f"%(asctime)s %(levelname)s {consumer_id} %(name)s: %(message)s",
    )
    # nothing on the serving path imports torch (the predictor and the GRU policy are numpy /
    # ONNX); BLAS threads come from OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, set by run_workers
    model = ModelHandle.open(model_path, loader=functools.partial(load_predictor, threads=threads))
    # a GRU version whose window does not fit state_k / top_k: an error now, refused on reload
    policy = make_policy(policy_name, policy_model, settings=settings)
    worker = StreamWorker(settings, model, policy, consumer_id, metrics_port, transactional_id)
    worker.install_signal_handlers()
    log.info(
        "worker %s up: model %s, policy %s, group %s",
        consumer_id,
        model.version,
        policy.name,
        settings.consumer_group,
    )
    worker.run()
