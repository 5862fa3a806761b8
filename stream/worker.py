"""One stream consumer: page views -> top-k queries -> user state -> one ad query.

Per batch: poll -> validate (bad -> dead-letter topic) -> reload model if promoted -> predict
(batched) -> Redis (one pipelined, idempotent append per event) -> policy -> produce ad queries.

Exactly-once (`delivery = "exactly-once"`): each polled batch is one Kafka
transaction holding its ad queries, its dead letters and its input offsets (Kafka's
consume-transform-produce). A crash or a refused commit aborts it: read-committed readers never
see its messages and the batch is processed again, so the output holds each answer once. Redis
state is idempotent by event id, so the replay never appends a visit twice.

At-least-once (the default: exactly-once's per-batch commit costs more latency than the targets
allow on 2 cores, docs/benchmarks-stream.md): the broker's acknowledgement wait overlaps the next batch (at most
`max_in_flight` batches, settled strictly in order); settled offsets are committed every
`commit_interval_ms`, on SIGTERM and before a rebalance. A crash replays the uncommitted batches:
duplicates can appear on `ad-queries` (counted), never a lost event. SIGTERM/SIGINT: finish the
batch, commit, leave the group.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import redis

from stream.settings import Settings
from personalization.state import UserState
from stream.consumer_metrics import ConsumerMetrics, PromExporter, publish
from stream.model_handle import ModelHandle, load_predictor
from stream.schemas import SchemaError, decode, dead_letter, encode
from stream.state_store import StateStore, connect
from stream.rdkafka_producer import TransactionAborted
from stream.topics import check_kafka, make_stream_consumer, make_stream_producer

log = logging.getLogger(__name__)
_DEAD = -(2**62)  # a policy choice slot whose event went to the dead letters
TXN_STALL_S = 20.0  # a transaction commit blocked this long is stuck (_commit_or_replace)


@dataclass
class InFlight:
    """A processed batch whose produced messages may not be acknowledged yet."""

    futures: list
    offsets: dict  # TopicPartition -> next offset to read
    t0: float  # perf_counter at the start of the batch
    event_ts: np.ndarray
    events: int = 0
    dead: int = 0
    duplicates: int = 0
    stages: dict = field(default_factory=dict)


def _offsets(records) -> dict:
    from kafka.structs import TopicPartition

    out: dict = {}
    for r in records:
        tp = TopicPartition(r.topic, r.partition)
        out[tp] = max(out.get(tp, 0), r.offset + 1)
    return out


class StreamWorker:
    """A consumer-group member over `page-views`; `run()` until stop() or SIGTERM."""

    def __init__(
        self,
        settings: Settings,
        model: ModelHandle,
        policy,
        consumer_id: str | None = None,
        metrics_port: int = 0,
        transactional_id: str | None = None,
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
        check_kafka(settings)
        self.stop_event = threading.Event()
        self.redis = connect(settings.redis_url)
        self.store = StateStore(
            self.redis,
            settings.redis_key_prefix,
            settings.state_k,
            settings.state_ttl_s,
            settings.dedup_ttl_s,
        )
        # a stable transactional id per worker slot: a restarted worker fences its dead
        # predecessor and aborts the transaction it left open (which would otherwise hold back
        # read-committed readers of the partitions it wrote until the transaction timed out)
        self.transactional_id = (
            transactional_id or f"{settings.consumer_group}-{self.cid}"
            if self.exactly_once
            else None
        )
        self.producer = make_stream_producer(settings, f"astec-{self.cid}", self.transactional_id)
        if self.exactly_once:
            self.producer.init_transactions()
        self.consumer = make_stream_consumer(
            settings,
            settings.topic_page_views,
            settings.consumer_group,
            f"astec-{self.cid}",
            on_revoke=self._commit_before_rebalance,
        )
        self.aborted = 0  # transactions aborted and replayed (exactly-once)
        self.pending_offsets: dict = {}  # settled but not yet committed (commit_interval_ms)
        self._last_commit = time.monotonic()
        self.metrics = ConsumerMetrics(self.cid, policy.name, model.version)
        self.prom = PromExporter(metrics_port, self.cid) if metrics_port else None
        self.commit_failures = 0
        self.max_in_flight = 4
        self.inflight: deque[InFlight] = deque()
        self._last_publish = 0.0

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
        try:
            self._maybe_publish(force=True)
        except redis.RedisError:
            pass
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
        first: dict = {}
        from kafka.structs import TopicPartition

        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            first[tp] = min(first.get(tp, r.offset), r.offset)
        t_commit = time.perf_counter()
        try:
            self._commit_or_replace(b.offsets)
        except TransactionAborted as exc:
            self.aborted += 1
            log.warning("%s: %s; replaying %d events", self.cid, exc, len(records))
            self.consumer.rewind(first)
            return False
        now_pc, now = time.perf_counter(), time.time()
        b.stages["kafka"] = b.stages.get("kafka", 0.0) + (now_pc - t_commit)
        e2a = (now - b.event_ts) * 1000.0
        self.metrics.record_batch(b.events, b.dead, b.duplicates, now_pc - b.t0, e2a, b.stages)
        if self.prom:
            self.prom.observe(b.events, b.dead, now_pc - b.t0, e2a, self.model.version)
        return True

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
        self.producer = make_stream_producer(self.s, f"astec-{self.cid}", self.transactional_id)
        self.producer.init_transactions()
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
            now_pc, now = time.perf_counter(), time.time()
            b.stages["kafka"] = b.stages.get("kafka", 0.0) + (now_pc - t_wait if block else 0.0)
            e2a = (now - b.event_ts) * 1000.0
            self.metrics.record_batch(b.events, b.dead, b.duplicates, now_pc - b.t0, e2a, b.stages)
            if self.prom:
                self.prom.observe(b.events, b.dead, now_pc - b.t0, e2a, self.model.version)
            offsets.update(b.offsets)  # later batches carry later offsets
            self.inflight.popleft()
            n += 1
        self.pending_offsets.update(offsets)
        if self.pending_offsets and (
            block or time.monotonic() - self._last_commit >= self.s.commit_interval_ms / 1000.0
        ):
            self.commit_pending()
        return n

    def _commit_before_rebalance(self) -> None:
        """Before partitions move to another member, commit what this worker has settled on them,
        so the new owner replays as little as possible (replays are harmless, just wasted work)."""
        try:
            self.commit_pending()
        except Exception as exc:  # noqa: BLE001 - the new owner replays; never break the rejoin
            log.warning("%s: commit before rebalance failed: %s", self.cid, exc)

    def commit_pending(self) -> None:
        """Commit the settled batches' offsets (a no-op when there are none)."""
        if self.pending_offsets:
            offsets, self.pending_offsets = self.pending_offsets, {}
            self.commit(offsets)
        self._last_commit = time.monotonic()

    def commit(self, offsets: dict) -> None:
        from kafka.errors import CommitFailedError, KafkaError
        from kafka.structs import OffsetAndMetadata

        try:
            self.consumer.commit({tp: OffsetAndMetadata(o, None, -1) for tp, o in offsets.items()})
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
        since = getattr(self, "_unassigned_since", None) or now
        self._unassigned_since = since
        idle = now - since
        if (
            idle > self.s.session_timeout_ms / 1000.0
            and now - getattr(self, "_last_unassigned_warning", 0.0) >= 60.0
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
        """Everything of a batch up to handing the ad queries to the producer (no ack wait).

        No single event can stop the worker: whatever fails while handling one event (its
        decoding, prediction, state, Redis write, policy or produce) sends that event to the
        dead letters with the reason, and the rest of the batch goes on. Only what is not an
        event's fault (Redis or the broker unreachable) raises or is retried."""
        t0 = time.perf_counter()
        stages = {}
        s = self.s
        futures: list = []
        dead = [0]

        def to_dead(r, reason: str) -> None:
            dead[0] += 1
            futures.append(
                self.producer.send(
                    s.topic_dead_letters,
                    key=r.key[:1024] if r.key else None,
                    value=dead_letter(r.value, reason, r.topic, r.partition, r.offset, self.cid),
                )
            )

        kept = []  # (record, message) of the events still in the batch
        for r in records:
            try:
                kept.append((r, decode("page_view", r.value, s.max_message_bytes)))
            except SchemaError as exc:
                to_dead(r, str(exc))
            except Exception as exc:  # noqa: BLE001 - per-event isolation
                to_dead(r, _reason("decode", exc))
        t1 = time.perf_counter()
        stages["decode"] = t1 - t0
        if self.model.maybe_reload():
            self.metrics.model_version = self.model.version
        self.policy.maybe_reload()
        res = InFlight(futures, _offsets(records), t0, np.zeros(0), 0, 0, 0, stages)
        if kept:
            pred = self.model.predictor
            kept, ids, scores, z = self._predict(pred, kept, to_dead)
            t2 = time.perf_counter()
            stages["predict"] = t2 - t1
            kept, ids, scores, states = self._states(kept, ids, scores, z, to_dead)
            fresh, hists, errors = self._append_with_backoff(
                [m["user_id"] for _, m in kept], states
            )
            ok = [i for i, e in enumerate(errors) if e is None]
            for i, e in enumerate(errors):
                if e is not None:
                    to_dead(kept[i][0], e)
            if len(ok) < len(kept):
                kept, states = [kept[i] for i in ok], [states[i] for i in ok]
                fresh, hists = [fresh[i] for i in ok], [hists[i] for i in ok]
                ids, scores = ids[ok], scores[ok]
            res.duplicates = len(fresh) - int(sum(fresh))
            t3 = time.perf_counter()
            stages["redis"] = t3 - t2
            q, served = self._serve(hists, states, ids, scores, kept, to_dead)
            t4 = time.perf_counter()
            stages["policy"] = t4 - t3
            names = pred.label_names
            version = self.model.version
            now = time.time()
            answered_ts = []
            for i, (r, m) in enumerate(kept):
                if q[i] == _DEAD:
                    continue
                answered_ts.append(m["ts"])
                if q[i] < 0:  # the predictor had no query for this page: nothing to advertise
                    self.metrics.no_query += 1
                    continue
                try:
                    f = served[i]
                    out = {
                        "event_id": m["event_id"],
                        "user_id": m["user_id"],
                        "ts": now,
                        "event_ts": m["ts"],
                        "query": names[int(q[i])],
                        **f,
                        "candidates": [names[j] for j in f["candidate_ids"]],
                        "policy": self.policy.name,
                        "model_version": version,
                        "url": m["url"],
                        "title": m["title"],
                    }
                    if "session_id" in m:
                        out["session_id"] = m["session_id"]
                    futures.append(
                        self.producer.send(
                            s.topic_ad_queries,
                            key=m["user_id"].encode(),
                            value=encode("ad_query", out),
                        )
                    )
                except Exception as exc:  # noqa: BLE001 - per-event isolation
                    answered_ts.pop()
                    to_dead(r, _reason("produce", exc))
            res.event_ts = np.array(answered_ts, np.float64)
            res.events = len(answered_ts)
            stages["kafka"] = time.perf_counter() - t4
        res.dead = dead[0]
        return res

    def _predict(self, pred, kept, to_dead):
        """The batch's top-k and features in one call; if that call fails, event by event, so
        only the events that fail on their own are dead-lettered."""
        titles = [m["title"] for _, m in kept]
        try:
            ids, scores, z = pred.predict_with_features(titles, self.s.top_k)
            return (
                kept,
                np.asarray(ids, np.int64),
                np.asarray(scores, np.float32),
                np.asarray(z, np.float32),
            )
        except Exception as exc:  # noqa: BLE001 - isolate the event(s) at fault
            log.warning(
                "%s: batch prediction failed (%s); predicting event by event", self.cid, exc
            )
        rows, out = [], []
        for item, title in zip(kept, titles):
            try:
                i, sc, zz = pred.predict_with_features([title], self.s.top_k)
                rows.append(
                    (
                        np.asarray(i, np.int64)[0],
                        np.asarray(sc, np.float32)[0],
                        np.asarray(zz, np.float32)[0],
                    )
                )
                out.append(item)
            except Exception as exc:  # noqa: BLE001 - per-event isolation
                to_dead(item[0], _reason("predict", exc))
        if not rows:
            return (
                [],
                np.zeros((0, self.s.top_k), np.int64),
                np.zeros((0, self.s.top_k), np.float32),
                np.zeros((0, 1)),
            )
        return (
            out,
            np.stack([r[0] for r in rows]),
            np.stack([r[1] for r in rows]),
            np.stack([r[2] for r in rows]),
        )

    def _states(self, kept, ids, scores, z, to_dead):
        """One UserState per event (what Redis stores); an event whose state cannot be built
        or encoded is dead-lettered."""
        states, ok = [], []
        for i, (r, m) in enumerate(kept):
            try:
                st = UserState.from_visit(
                    m["event_id"],
                    m["ts"],
                    m["url"],
                    m["title"],
                    z[i],
                    ids[i][ids[i] >= 0],
                    scores[i][ids[i] >= 0],
                )
                st.encode()
                states.append(st)
                ok.append(i)
            except Exception as exc:  # noqa: BLE001 - per-event isolation
                to_dead(r, _reason("state", exc))
        if len(ok) < len(kept):
            return [kept[i] for i in ok], ids[ok], scores[ok], states
        return kept, ids, scores, states

    def _serve(self, hists, states, ids, scores, kept, to_dead):
        """The policy's (exploring) choice per event and its log fields (Served.fields: query id,
        score, propensity, every candidate it ranked with its score and propensity); the batch
        in one call, or event by event if that fails (an event that fails alone is
        dead-lettered and its query marked _DEAD)."""
        q = np.full(len(kept), _DEAD, np.int64)
        fields: list = [None] * len(kept)
        if not kept:
            return q, fields

        def serve(h, st, i_, s_):
            sv = self.policy.serve_batch(h, st, i_, s_)
            return sv.query, [sv.fields(j) for j in range(len(sv.query))]

        try:
            return serve(hists, states, ids, scores)
        except Exception as exc:  # noqa: BLE001 - isolate the event(s) at fault
            log.warning("%s: batch policy failed (%s); choosing event by event", self.cid, exc)
        for i in range(len(kept)):
            try:
                a, f = serve([hists[i]], [states[i]], ids[i : i + 1], scores[i : i + 1])
                q[i], fields[i] = a[0], f[0]
            except Exception as exc:  # noqa: BLE001 - per-event isolation
                to_dead(kept[i][0], _reason("policy", exc))
        return q, fields

    def _append_with_backoff(self, user_ids, states):
        """Redis append, retried with backoff while Redis restarts or is out of memory (the
        batch stays uncommitted); per-event refusals come back as reasons."""
        if not states:
            return [], [], []
        delay = 0.1
        while True:
            try:
                return self.store.append_batch_checked(user_ids, states, self.policy.needs_history)
            except (
                redis.ConnectionError,
                redis.TimeoutError,
                redis.BusyLoadingError,
                redis.exceptions.NoScriptError,
            ) as exc:
                if self.stop_event.is_set():
                    raise
                log.warning("%s: Redis unavailable (%s); retrying in %.1fs", self.cid, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)


def _reason(stage: str, exc: BaseException) -> str:
    """A dead-letter reason naming the stage that failed on this event."""
    return f"{stage} failed: {type(exc).__name__}: {exc}"[:4096]


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
    from stream.policy_handle import make_policy

    model = ModelHandle.open(model_path, loader=functools.partial(load_predictor, threads=threads))
    policy = make_policy(policy_name, policy_model)
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
