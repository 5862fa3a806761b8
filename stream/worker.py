"""One stream consumer: page views -> top-k queries -> user state -> one ad query.

Per batch: poll -> swap in a newly promoted model / policy (loaded off this thread), never
inside an open transaction -> the stages of stream.batch_stages: decode (bad -> dead-letter
topic) -> predict (batched) -> state (Redis: one pipelined, idempotent append per event) ->
choose (the policy) -> emit (produce ad queries). Clients (Kafka consumer and producer, Redis)
are built from the settings or injected.

Exactly-once (`delivery = "exactly-once"`): one Kafka transaction spans every batch polled
within `commit_interval_ms` (as Kafka Streams), holding their ad queries, dead letters and input
offsets (Kafka's consume-transform-produce). Its commit runs on a thread of its own
(stream.txn_commit) while the worker polls and predicts the next interval's batches, whose
messages are held in memory until that commit returned: then the next transaction begins with
them. A commit slower than an interval makes the next transaction span longer; the worker waits
for a commit only before a rebalance and on stop (a wait on its loop longer than
max.poll.interval would get it evicted from the group).
A crash or a refused commit aborts it: read-committed readers never see its messages, the held
messages are dropped, and both intervals' batches are processed again, so the output holds each
answer once. Redis state is idempotent by event id, so the replay never appends a visit twice.

At-least-once: the broker's acknowledgement wait overlaps the next batch (at most
`max_in_flight` batches, settled strictly in order); settled offsets are committed every
`commit_interval_ms`, on SIGTERM and before a rebalance. A crash replays the uncommitted batches:
duplicates can appear on `ad-queries` (counted), never a lost event.

Rebalances (cooperative-sticky, static membership per worker slot): before partitions move away
the worker drains every batch in flight and commits (at-least-once), or commits its open
transaction (exactly-once), so the next owner neither repeats nor skips an answer; partitions
lost (the member was evicted) drop their uncommitted offsets and the next owner replays them.
Exactly-once, either way, first waits for the commit in flight.
SIGTERM/SIGINT: finish the batch, commit, close.
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
from kafka.errors import KafkaTimeoutError
from kafka.structs import TopicPartition

from stream.batch_stages import Batch, Outbox, Stage, default_stages
from stream.consumer_metrics import ConsumerMetrics, PromExporter, publish
from stream.model_handle import ModelHandle, load_predictor
from stream.policy_handle import Policy, make_policy
from stream.rdkafka_producer import DeliveryError, TransactionAborted
from stream.settings import Settings
from stream.state_store import StateStore, connect
from stream.topics import TXN_TIMEOUT_MS, make_stream_consumer, make_stream_producer
from stream.txn_commit import BackgroundCommit
from stream.worker_health import WorkerHealth

log = logging.getLogger(__name__)
# a transaction commit blocked this long is stuck (_reap_commit): the brokers fence a frozen
# broker after broker.session.timeout.ms (9 s by default) and move its coordinators, so a commit
# still blocked 3 s past that waits on a broker the cluster has given up
TXN_STALL_S = 12.0
# while a transaction commits, the loop polls at least this often to see it return (the next
# interval's held messages wait for it)
COMMIT_CHECK_MS = 5
# at-least-once: a wait for acknowledgements polls the (paused) consumer at least this often, far
# inside max.poll.interval; an ordinary batch is acknowledged well within it, so it never pauses
ACK_SLICE_S = 0.5


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
class OpenTxn:
    """Exactly-once: the batches of the transaction open since `t_begin` (monotonic).

    `held` is None once the producer's transaction has begun (messages go to the producer);
    while the previous transaction still commits it holds this one's messages instead."""

    t_begin: float
    batches: list = field(default_factory=list)
    offsets: dict = field(default_factory=dict)  # TopicPartition -> next offset to read
    first: dict = field(default_factory=dict)  # TopicPartition -> where an abort rewinds to
    held: list | None = None  # (topic, key, value) not produced yet

    def add(self, b: InFlight) -> None:
        self.batches.append(b)
        self.offsets.update(b.offsets)  # later batches carry later offsets
        for tp, o in b.first.items():
            self.first.setdefault(tp, o)

    def hold(self, topic: str, key: bytes | None = None, value: bytes | None = None) -> None:
        """Outbox.send while the previous transaction commits: keep the message for later."""
        assert self.held is not None
        self.held.append((topic, key, value))


@dataclass
class Clients:
    """The worker's connections: built by `connect`, or injected (StreamWorker(clients=...)).
    An injected consumer must call the worker's `commit_before_rebalance` when its partitions
    are revoked (and `drop_lost` when they are lost); `new_producer` makes a producer with the
    same transactional id (exactly-once: it replaces one stuck in a commit)."""

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
        on_revoke: Callable[[set], None],
        instance_id: str | None = None,
        on_lost: Callable[[set], None] | None = None,
    ) -> Clients:
        def new_producer() -> Any:
            p = make_stream_producer(settings, client_id, transactional_id)
            if transactional_id:
                p.init_transactions()
            return p

        redis_client = connect(settings.redis.url.reveal())
        producer = new_producer()
        consumer = make_stream_consumer(
            settings,
            settings.topics.page_views,
            settings.consumer.group,
            client_id,
            on_revoke=on_revoke,
            instance_id=instance_id,
            on_lost=on_lost,
        )
        return cls(consumer, producer, redis_client, new_producer)


class StreamWorker:
    """A consumer-group member over `page-views`; `run()` until stop() or SIGTERM.

    `clients` (Kafka consumer and producer, Redis) and `stages` (stream.batch_stages) are built
    from the settings unless given. `instance_id` is the static group membership id (KIP-345:
    the worker slot's, kept across restarts; default the consumer id)."""

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
        instance_id: str | None = None,
    ):
        self.s = settings
        self.model = model
        self.policy = policy
        self.cid = consumer_id or f"{socket.gethostname()}-{os.getpid()}"
        self.exactly_once = settings.delivery == "exactly-once"
        self.stop_event = threading.Event()
        # a stable transactional id per worker slot: a restarted worker fences its dead
        # predecessor and aborts the transaction it left open (which would otherwise hold back
        # read-committed readers of the partitions it wrote until the transaction timed out)
        self.transactional_id = (
            transactional_id or f"{settings.consumer.group}-{self.cid}"
            if self.exactly_once
            else None
        )
        # the broker was checked once by the command that started the workers (ensure_topics)
        self.clients = clients or Clients.connect(
            settings,
            f"astec-{self.cid}",
            self.transactional_id,
            self.commit_before_rebalance,
            instance_id or self.cid,
            self.drop_lost,
        )
        self.consumer = self.clients.consumer
        self.producer = self.clients.producer
        self.redis = self.clients.redis
        self.store = StateStore.from_settings(self.redis, settings)
        self.stages = stages or default_stages(
            settings, model, policy, self._append_with_backoff, self._mark_with_backoff
        )
        self.aborted = 0  # transactions aborted and replayed (exactly-once)
        self.txn: OpenTxn | None = None  # the open transaction (exactly-once)
        self.committing: BackgroundCommit | None = None  # the previous one, committing
        self._committing_txn: OpenTxn | None = None
        # committed well before the broker would abort it (transaction.timeout.ms)
        self.txn_span_s = min(self.s.consumer.commit_interval_ms, TXN_TIMEOUT_MS // 4) / 1000.0
        self.transactions = 0  # committed (exactly-once)
        # raised by a rebalance callback (a failed produce, a fenced producer): raised again
        # on the worker's own loop, where it stops the worker without committing
        self._failure: BaseException | None = None
        self.pending_offsets: dict = {}  # settled but not yet committed (commit_interval_ms)
        self._last_commit = time.monotonic()
        self.metrics = ConsumerMetrics(self.cid, policy.name, model.version)
        self.commit_failures = 0
        self.max_in_flight = 4
        self.inflight: deque[InFlight] = deque()
        self.health = WorkerHealth(self)  # Redis outages held in the group; /healthz, /readyz
        self.prom = (
            PromExporter(metrics_port, self.cid, settings.ops.metrics_host, self.health)
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
                # polling faster only wakes the loop and kafka-python's I/O threads more often,
                # which raises a paced stream's p99
                wait = (
                    self.s.consumer.poll_timeout_ms
                    if self.inflight
                    else self.s.consumer.poll_timeout_ms * 5
                )
                if self.committing is not None:  # see it return soon
                    wait = min(wait, COMMIT_CHECK_MS)
                elif self.txn is not None:  # wake up in time to commit it
                    due = self.txn.t_begin + self.txn_span_s
                    wait = min(
                        self.s.consumer.poll_timeout_ms, int((due - time.monotonic()) * 1000)
                    )
                polled = self.consumer.poll(
                    timeout_ms=max(1, wait), max_records=self.s.consumer.batch_max
                )
                self._raise_failure()
                self.health.polled()
                records = [r for rs in polled.values() for r in rs]
                if self.exactly_once:
                    self.transaction_step(records)
                else:
                    if records:
                        self._between_batches()
                        self.inflight.append(self.process(records))
                    self.settle(block=len(self.inflight) > self.max_in_flight, keep_alive=True)
                self._maybe_publish()
            # graceful stop: everything acknowledged and committed
            if self.exactly_once:
                self.commit_transaction()
            else:
                self.settle(block=True)
        finally:
            self.close()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            exc, self._failure = self._failure, None
            raise exc

    def _between_batches(self) -> None:
        """Swap in a newly promoted model / policy: the model was loaded and warmed off this
        thread (ModelHandle background mode); called only where no transaction is open."""
        self.model.maybe_reload()
        self.policy.maybe_reload()

    def close(self) -> None:
        """Leave the group (fast rebalance for the others), flush, publish final metrics."""
        with contextlib.suppress(redis.RedisError):
            self._maybe_publish(force=True)
        try:
            if not self.exactly_once:
                self.producer.flush(timeout=10)
            c = self.committing  # a commit still in flight (the loop raised) shares the producer
            if c is None or c.wait(TXN_STALL_S - c.age()):
                self.producer.close(timeout=10)
        finally:
            self.consumer.close(autocommit=False)
            self.redis.close()
            close_model = getattr(self.model, "close", None)
            if close_model is not None:
                close_model()

    def _txn_due(self) -> bool:
        return self.txn is not None and time.monotonic() - self.txn.t_begin >= self.txn_span_s

    def transaction_step(self, records) -> None:
        """Exactly-once, once per poll: the batch into the open transaction; the commit in
        flight seen to its end if it returned; the open transaction's commit started when its
        interval is over and the previous one returned (until then it goes on growing)."""
        if records:
            self.add_to_transaction(records)
        self._reap_commit()
        if self._txn_due() and self.committing is None:
            self._start_commit()

    def add_to_transaction(self, records) -> None:
        """Process a batch inside the open transaction (opening one, after swapping in a newly
        promoted model, when none is). While the previous transaction commits, its messages
        are held, to be produced once that commit returned."""
        if self.txn is None:
            self._between_batches()
            self.txn = OpenTxn(time.monotonic())
            if self.committing is None:
                self.producer.begin_transaction()
            else:
                self.txn.held = []
        send = self.txn.hold if self.txn.held is not None else self.producer.send
        self.txn.add(self.process(records, send))

    def process_transaction(self, records) -> bool:
        """One batch as a transaction of its own (committed at once). Returns whether it
        committed."""
        self.add_to_transaction(records)
        return self.commit_transaction()

    def commit_transaction(self) -> bool:
        """Commit everything at once (graceful stop, rebalance): wait for the commit in flight,
        then commit the open transaction and wait for it. A refused commit aborts and rewinds
        its partitions (and the open transaction's) to be processed again. Returns whether
        everything committed."""
        ok = self._reap_commit(block=True) is not False
        if self.txn is None:
            return ok
        self._start_commit()
        return self._reap_commit(block=True) is True

    def _start_commit(self) -> None:
        """Start committing the open transaction (its outputs with its batches' input offsets)
        on a thread of its own; the next batches go into a new one, held until it returned."""
        txn, self.txn = self.txn, None
        assert txn is not None and txn.held is None and self.committing is None
        producer, offsets = self.producer, txn.offsets
        # the group generation now, not when the commit gets through: if the group moves on
        # meanwhile (this member evicted), the broker refuses the offsets and the interval replays
        group = self.consumer.group_metadata()
        self._committing_txn = txn
        self.committing = BackgroundCommit(lambda: producer.commit_transaction(offsets, group))

    def _reap_commit(self, block: bool = False) -> bool | None:
        """See the commit in flight to its end: None while it runs (block=False) or when none
        is; True when it committed (its batches recorded, the open transaction's held messages
        produced into a new transaction); False when it was refused and aborted (it and the open
        transaction rewound, the held messages dropped).

        librdkafka's send_offsets_to_transaction can block far past its timeout when the group
        coordinator went away (confluentinc/librdkafka#5456 and #5511; here, every time the
        broker is killed and restarts mid-transaction). A commit stuck for TXN_STALL_S is given
        up: a new producer with the same transactional id fences the stuck one, the broker
        aborts its transaction and both intervals replay. The stuck call's thread is left to end
        on its own (it fails once fenced)."""
        c, txn = self.committing, self._committing_txn
        if c is None or txn is None:
            return None
        t_wait = time.perf_counter()
        if block:
            c.wait(TXN_STALL_S - c.age())
        error: BaseException | None
        stuck = False
        if c.done.is_set():
            error = c.error
        elif not block and c.age() < TXN_STALL_S:
            return None
        else:
            log.error(
                "%s: transaction commit stuck for %.0fs in librdkafka; replacing the producer "
                "(same transactional id) and replaying the interval",
                self.cid,
                TXN_STALL_S,
            )
            self.producer = self.clients.producer = self.clients.new_producer()
            stuck = True
            error = TransactionAborted(f"commit stuck for {TXN_STALL_S:.0f}s; producer replaced")
        self.committing = self._committing_txn = None
        waited = time.perf_counter() - t_wait if block else 0.0
        if error is None:
            self.transactions += 1
            for b in txn.batches:
                self._record(b, waited / len(txn.batches), c.t_done)
            if self.txn is not None:
                self._produce_held(self.txn)
            return True
        if not isinstance(error, TransactionAborted):
            raise error  # fenced or fatal: the worker stops, its restart replays
        self.aborted += 1
        nxt, self.txn = self.txn, None
        log.warning(
            "%s: %s; replaying %d batches",
            self.cid,
            error,
            len(txn.batches) + (len(nxt.batches) if nxt else 0),
        )
        rewind = dict(txn.first)  # the earlier interval's first offsets come first
        for tp, o in (nxt.first if nxt else {}).items():
            rewind.setdefault(tp, o)
        if stuck:
            # the replaced producer's init fenced the stuck transaction, but the coordinator
            # completes one whose commit it had already logged: resume where the group's
            # offsets are now, or that interval's answers would be read twice
            rewind.update(self.consumer.committed(list(rewind)))
        self.consumer.rewind(rewind)
        return False

    def _produce_held(self, txn: OpenTxn) -> None:
        """Begin the producer's transaction for `txn` and produce the messages it held (the
        time counts as its batches' Kafka time)."""
        t = time.perf_counter()
        self.producer.begin_transaction()
        for topic, key, value in txn.held or ():
            self.producer.send(topic, key=key, value=value)
        txn.held = None
        share = (time.perf_counter() - t) / max(1, len(txn.batches))
        for b in txn.batches:
            b.stages["kafka"] = b.stages.get("kafka", 0.0) + share

    def _record(self, b: InFlight, kafka_wait_s: float, now: float | None = None) -> None:
        """A settled batch into the metrics: its ack (or commit) wait counts as the kafka stage,
        its events' latency runs from their timestamps to `now` (when its outputs became
        visible; default the present)."""
        now_pc, now = time.perf_counter(), time.time() if now is None else now
        b.stages["kafka"] = b.stages.get("kafka", 0.0) + kafka_wait_s
        e2a = (now - b.event_ts) * 1000.0
        self.metrics.record_batch(b.events, b.dead, b.duplicates, now_pc - b.t0, e2a, b.stages)
        if self.prom:
            self.prom.observe(b.events, b.dead, now_pc - b.t0, e2a, self.model.version)

    def settle(self, block: bool = False, keep_alive: bool = False) -> int:
        """Commit the offsets of the oldest batches whose messages are all acknowledged.

        Batches settle strictly in order; a failed produce raises (no commit: the uncommitted
        batches replay after the restart). block waits for every batch in flight; keep_alive
        (the worker's loop, never a rebalance callback, which runs inside a poll) keeps the
        group membership alive meanwhile. Returns the number of batches settled.
        """
        offsets: dict = {}
        n = 0
        t_wait = time.perf_counter()
        if block and keep_alive:
            self._await_acks()
        while self.inflight:
            b = self.inflight[0]
            if block:
                self.producer.flush()
            elif not all(f.is_done for f in b.futures):
                break
            for f in b.futures:
                f.get(timeout=30)  # raises if the broker refused a message
            self._record(b, time.perf_counter() - t_wait if block else 0.0)
            t_wait = time.perf_counter()
            offsets.update(b.offsets)  # later batches carry later offsets
            self.inflight.popleft()
            n += 1
        self.pending_offsets.update(offsets)
        if self.pending_offsets and (
            block
            or time.monotonic() - self._last_commit >= self.s.consumer.commit_interval_ms / 1000.0
        ):
            self.commit_pending(wait=block)
        return n

    def _await_acks(self) -> None:
        """Wait until every batch in flight is acknowledged (or failed), polling the consumer
        with its partitions paused between waits of ACK_SLICE_S: a partition leader frozen
        until the cluster moves its partitions (about a session timeout) would otherwise hold
        this loop past max.poll.interval, and the group would evict the worker mid-wait."""
        try:
            while self.inflight and not all(f.is_done for b in self.inflight for f in b.futures):
                try:
                    self.producer.flush(timeout=ACK_SLICE_S)
                except (DeliveryError, KafkaTimeoutError):
                    self.health.hold(0.0)  # one poll, every owned partition paused
        finally:
            self.health.resume()

    def commit_before_rebalance(self, revoked: set | None = None) -> None:
        """Before partitions move to another member (called inside the consumer's poll, while
        the worker's loop waits in it; kafka-python calls it on its I/O thread): drain every
        batch in flight (the revoked partitions' among them) and commit their offsets
        (at-least-once), or commit the open transaction (exactly-once), so the new owner
        starts where this worker's answers end: nothing repeated, nothing skipped.
        A failed produce or a fenced producer stops the worker (raised after the poll): its
        uncommitted batches replay, never lost."""
        try:
            if self.exactly_once:
                self.commit_transaction()
            else:
                self.settle(block=True)
        except Exception as exc:  # noqa: BLE001 - raised again on the worker's loop
            log.warning("%s: draining before the rebalance failed: %s", self.cid, exc)
            self._failure = exc

    def drop_lost(self, lost: set) -> None:
        """Partitions already owned by another member (this one was evicted): their offsets
        are not committed (the new owner replays from the last commit); the open transaction
        is aborted (one still holding its messages is dropped) and its partitions still owned
        are rewound. A commit in flight is left to end: it carries the group generation of its
        start, so the broker refuses it if the group moved on, and it is replayed then."""
        self.pending_offsets = {tp: o for tp, o in self.pending_offsets.items() if tp not in lost}
        for b in self.inflight:
            b.offsets = {tp: o for tp, o in b.offsets.items() if tp not in lost}
        if self.txn is not None:
            txn, self.txn = self.txn, None
            log.warning("%s: partitions lost; aborting the open transaction", self.cid)
            try:
                if txn.held is None:  # a transaction still holding its messages sent nothing
                    self.producer.abort_transaction()
            except Exception as exc:  # noqa: BLE001 - raised again on the worker's loop
                self._failure = exc
                return
            self.aborted += 1
            self.consumer.rewind({tp: o for tp, o in txn.first.items() if tp not in lost})

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
        if force or now - self._last_publish >= self.s.ops.metrics_interval_s:
            self._last_publish = now
            self.metrics.model_version = self.model.version
            self.metrics.partitions = len(self.consumer.assignment())
            self.metrics.refused_versions = len(self.model.refused) + len(self.policy.refused)
            self.metrics.commit_failures = self.commit_failures
            self._warn_if_unassigned(now)
            lag = getattr(self.consumer, "lag", None)
            self.metrics.lag = lag() if lag is not None else None
            try:
                publish(self.redis, self.s.redis.key_prefix, self.metrics)
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
            idle > self.s.consumer.session_timeout_ms / 1000.0
            and now - self._last_unassigned_warning >= 60.0
        ):
            self._last_unassigned_warning = now
            log.warning(
                "%s: no partition of %s assigned for %.0fs (more workers in group %s "
                "than partitions, or the group cannot rebalance)",
                self.cid,
                self.s.topics.page_views,
                idle,
                self.s.consumer.group,
            )

    # ---- one batch ----------------------------------------------------------------------
    def process(self, records, send: Callable[..., Any] | None = None) -> InFlight:
        """Everything of a batch up to handing the ad queries to the producer (no ack wait):
        the stages of stream.batch_stages in order, each timed under its metric name.

        No single event can stop the worker: whatever fails while handling one event (its
        decoding, prediction, state, Redis write, policy or produce) sends that event to the
        dead letters with the reason, and the rest of the batch goes on. Only what is not an
        event's fault (Redis or the broker unreachable) raises or is retried. `send` (default
        the producer's) takes the batch's messages."""
        t0 = t = time.perf_counter()
        stages = {"predict": 0.0}
        out = Outbox(send or self.producer.send, self.s.topics.dead_letters, self.cid)
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

    def _mark_with_backoff(self, user_ids, states, queries):
        """The shown stage's Redis write (the store's mark_shown), retried like the append."""
        if not states:
            return []
        return self.health.retry_redis(lambda: self.store.mark_shown(user_ids, states, queries))


def worker_main(
    settings: Settings,
    model_path: str,
    policy_name: str,
    policy_model: str | None,
    consumer_id: str,
    metrics_port: int = 0,
    threads: int = 1,
    transactional_id: str | None = None,
    instance_id: str | None = None,
) -> None:
    """Entry point of one worker process (also used in-process for --workers 1)."""
    logging.basicConfig(
        level=int(os.environ.get("ASTEC_LOG_LEVEL", logging.INFO)),
        format=f"%(asctime)s %(levelname)s {consumer_id} %(name)s: %(message)s",
    )
    # nothing on the serving path imports torch (the predictor and the GRU policy are numpy /
    # ONNX); BLAS threads come from OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, set by run_workers
    model = ModelHandle.open(
        model_path, loader=functools.partial(load_predictor, threads=threads), background=True
    )
    # a GRU version whose window does not fit state_k / top_k: an error now, refused on reload
    policy = make_policy(policy_name, policy_model, settings=settings, engine=model)
    worker = StreamWorker(
        settings,
        model,
        policy,
        consumer_id,
        metrics_port,
        transactional_id,
        instance_id=instance_id,
    )
    worker.install_signal_handlers()
    log.info(
        "worker %s up: model %s, policy %s, group %s",
        consumer_id,
        model.version,
        policy.name,
        settings.consumer.group,
    )
    worker.run()
