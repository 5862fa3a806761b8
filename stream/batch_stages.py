"""The stages of one batch of page views: decode -> predict -> state -> choose -> shown -> emit.

Every stage has the one interface `stage(batch, outbox) -> None`: it fills its fields of the
`Batch` and drops the events it failed on, each sent to the dead letters with a reason naming
the stage (one event's fault never holds back the rest of its batch). What is not an event's
fault (Redis or the broker unreachable) raises. The worker binds each stage's dependencies with
functools.partial (`default_stages`) and times it under the metric names of
stream.consumer_metrics.STAGES: decode, predict, redis (state, and shown: the chosen query
written into the event's stored state, for a policy that reads history), policy (choose),
kafka (emit).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from personalization.state import UserState, space_tag
from stream.model_handle import ModelHandle
from stream.policy_handle import Policy
from stream.schemas import SchemaError, dead_letter, decode, encode

log = logging.getLogger(__name__)

# append(user ids, states, with_history) -> (fresh, histories, per-event error or None): the
# state store's append_batch_checked, with the worker's retry while Redis is away
Append = Callable[[list[str], list[UserState], bool], tuple[list[bool], list[list], list]]
# mark(user ids, states, chosen query ids) -> per event True / False (state not found) / reason:
# the state store's mark_shown, with the worker's retry while Redis is away
Mark = Callable[[list[str], list[UserState], list[int]], list]


def reason(stage: str, exc: BaseException) -> str:
    """A dead-letter reason naming the stage that failed on this event."""
    return f"{stage} failed: {type(exc).__name__}: {exc}"[:4096]


@dataclass
class Outbox:
    """Where a batch's messages go: `send` is the producer's, each send's future kept so the
    worker can wait for the broker's acknowledgements before it commits the input offsets."""

    send: Callable[..., Any]  # producer.send(topic, key=..., value=...) -> future
    dead_topic: str
    consumer_id: str
    futures: list = field(default_factory=list)
    dead: int = 0

    def emit(self, topic: str, key: bytes | None, value: bytes) -> None:
        self.futures.append(self.send(topic, key=key, value=value))

    def dead_letter(self, record, why: str) -> None:
        """The record, as it came, to the dead-letter topic with the reason."""
        self.dead += 1
        self.emit(
            self.dead_topic,
            record.key[:1024] if record.key else None,
            dead_letter(
                record.value, why, record.topic, record.partition, record.offset, self.consumer_id
            ),
        )


@dataclass
class Batch:
    """The events of a batch still being handled, row i of every filled field being event i."""

    records: list  # the Kafka records (topic, partition, offset, key, value)
    msgs: list[dict] = field(default_factory=list)  # decoded page views
    ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # top-k ids
    scores: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    z: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # features
    states: list[UserState] = field(default_factory=list)
    hists: list[list[UserState]] = field(default_factory=list)  # earlier states, oldest first
    query: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # chosen (-1: none)
    # whether each page's title holds a word the model knows (empty: not checked)
    known: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    served: list[dict] = field(default_factory=list)  # the policy's log fields per event
    model_version: str = ""  # the predictor that predicted this batch
    label_names: Any = None
    space: int = 0  # personalization.state.space_tag of that predictor's label space
    duplicates: int = 0  # replayed events (their state was already stored)
    no_query: int = 0  # events whose page had no query to advertise (answered, nothing sent)
    answered_ts: list[float] = field(default_factory=list)  # event ts of each answered event

    def __len__(self) -> int:
        return len(self.records)

    def keep(self, ok: Sequence[int]) -> None:
        """Keep only events `ok` (ascending) in every field filled so far."""
        n = len(self.records)
        if len(ok) == n:
            return
        idx = list(ok)

        def pick(xs):  # fields not filled yet (shorter) stay as they are
            return [xs[i] for i in idx] if len(xs) == n else xs

        def take(a: np.ndarray) -> np.ndarray:
            return a[idx] if len(a) == n else a

        self.records, self.msgs = pick(self.records), pick(self.msgs)
        self.states, self.hists, self.served = (
            pick(self.states),
            pick(self.hists),
            pick(self.served),
        )
        self.ids, self.scores, self.z = take(self.ids), take(self.scores), take(self.z)
        self.query, self.known = take(self.query), take(self.known)


Stage = Callable[[Batch, Outbox], None]


def decode_stage(batch: Batch, out: Outbox, *, max_bytes: int) -> None:
    """Validate each record as a page view (stream.schemas)."""
    ok = []
    for i, r in enumerate(batch.records):
        try:
            batch.msgs.append(decode("page_view", r.value, max_bytes))
            ok.append(i)
        except SchemaError as exc:
            out.dead_letter(r, str(exc))
        except Exception as exc:  # noqa: BLE001 - per-event isolation
            out.dead_letter(r, reason("decode", exc))
    batch.records = [batch.records[i] for i in ok]


def predict_stage(
    batch: Batch, out: Outbox, *, model: ModelHandle, top_k: int, skip_unknown: bool = False
) -> None:
    """The batch's top-k queries and page features in one call; if that call fails, event by
    event, so only the events that fail on their own are dead-lettered. With skip_unknown, a
    page whose title the model knows nothing of gets no queries (not the prior's guesses)."""
    _predict(batch, out, model, top_k)
    pred = model.predictor
    if skip_unknown and len(batch) and hasattr(pred, "has_evidence"):
        try:
            batch.known = np.asarray(pred.has_evidence([m["title"] for m in batch.msgs]), bool)
        except Exception as exc:  # noqa: BLE001 - a failed check serves the predictions as they are
            log.warning("%s: evidence check failed (%s)", out.consumer_id, exc)
            return
        batch.ids[~batch.known] = -1
        batch.scores[~batch.known] = 0.0


def _predict(batch: Batch, out: Outbox, model: ModelHandle, top_k: int) -> None:
    pred = model.predictor
    batch.model_version, batch.label_names = model.version, pred.label_names
    batch.space = space_tag(getattr(model, "label_space", ""))
    titles = [m["title"] for m in batch.msgs]
    try:
        ids, scores, z = pred.predict_with_features(titles, top_k)
        batch.ids = np.asarray(ids, np.int64)
        batch.scores = np.asarray(scores, np.float32)
        batch.z = np.asarray(z, np.float32)
        return
    except Exception as exc:  # noqa: BLE001 - isolate the event(s) at fault
        log.warning(
            "%s: batch prediction failed (%s); predicting event by event", out.consumer_id, exc
        )
    rows, ok = [], []
    for i, title in enumerate(titles):
        try:
            i_, s_, z_ = pred.predict_with_features([title], top_k)
            rows.append(
                (
                    np.asarray(i_, np.int64)[0],
                    np.asarray(s_, np.float32)[0],
                    np.asarray(z_, np.float32)[0],
                )
            )
            ok.append(i)
        except Exception as exc:  # noqa: BLE001 - per-event isolation
            out.dead_letter(batch.records[i], reason("predict", exc))
    batch.keep(ok)
    if rows:
        batch.ids, batch.scores, batch.z = (np.stack([r[j] for r in rows]) for j in range(3))
    else:
        batch.ids = np.zeros((0, top_k), np.int64)
        batch.scores = np.zeros((0, top_k), np.float32)


def state_stage(batch: Batch, out: Outbox, *, append: Append, with_history: bool) -> None:
    """One UserState per event, appended to its user's list in Redis (idempotent by event id,
    one round trip), and the user's earlier states when the policy reads them."""
    ok = []
    for i, m in enumerate(batch.msgs):
        try:
            valid = batch.ids[i] >= 0
            st = UserState.from_visit(
                m["event_id"],
                m["ts"],
                m["url"],
                m["title"],
                batch.z[i],
                batch.ids[i][valid],
                batch.scores[i][valid],
                batch.space,
            )
            st.encode()  # an event whose state cannot be encoded fails here, alone
            batch.states.append(st)
            ok.append(i)
        except Exception as exc:  # noqa: BLE001 - per-event isolation
            out.dead_letter(batch.records[i], reason("state", exc))
    batch.keep(ok)
    if not batch.states:
        return
    fresh, hists, errors = append([m["user_id"] for m in batch.msgs], batch.states, with_history)
    batch.hists = hists
    ok = []
    for i, e in enumerate(errors):
        if e is None:
            ok.append(i)
        else:
            out.dead_letter(batch.records[i], e)
    batch.keep(ok)
    batch.duplicates = len(ok) - sum(bool(fresh[i]) for i in ok)


def choose_stage(batch: Batch, out: Outbox, *, policy: Policy) -> None:
    """The policy's (exploring) choice per event and its log fields (Served.fields: query id,
    score, propensity, every candidate it ranked with its score and propensity); the batch in
    one call, or event by event if that fails."""

    def serve(h, st, i_, s_) -> tuple[np.ndarray, list[dict]]:
        sv = policy.serve_batch(h, st, i_, s_)
        return np.asarray(sv.query, np.int64), [sv.fields(j) for j in range(len(sv.query))]

    try:
        batch.query, batch.served = serve(batch.hists, batch.states, batch.ids, batch.scores)
        _no_ad_without_evidence(batch)
        return
    except Exception as exc:  # noqa: BLE001 - isolate the event(s) at fault
        log.warning("%s: batch policy failed (%s); choosing event by event", out.consumer_id, exc)
    query, served, ok = [], [], []
    for i in range(len(batch)):
        try:
            q, f = serve(
                batch.hists[i : i + 1],
                batch.states[i : i + 1],
                batch.ids[i : i + 1],
                batch.scores[i : i + 1],
            )
            query.append(int(q[0]))
            served.append(f[0])
            ok.append(i)
        except Exception as exc:  # noqa: BLE001 - per-event isolation
            out.dead_letter(batch.records[i], reason("policy", exc))
    batch.keep(ok)
    batch.query, batch.served = np.asarray(query, np.int64), served
    _no_ad_without_evidence(batch)


def shown_stage(batch: Batch, out: Outbox, *, mark: Mark) -> None:
    """Write each event's chosen query into its stored state (UserState.shown), which the
    policy reads at the user's later visits as training reads the logged impressions. The ad
    goes out whatever happens here: a state not found (expired, or trimmed by newer visits) or
    refused only leaves that visit reading as nothing shown, logged."""
    if not len(batch.query):
        return
    users = [m["user_id"] for m in batch.msgs]
    res = mark(users, batch.states, [int(q) for q in batch.query])
    bad = [r for r in res if isinstance(r, str)]
    if bad:
        log.warning("%s: %d shown mark(s) refused, e.g. %s", out.consumer_id, len(bad), bad[0])


def _no_ad_without_evidence(batch: Batch) -> None:
    """No ad for a page the model knows nothing of, though the policy could pick one from the
    user's earlier pages: the page gives no reason for it (Settings.prediction.no_evidence)."""
    if len(batch.known) == len(batch.query):
        batch.query = np.where(batch.known, batch.query, -1)


def emit_stage(batch: Batch, out: Outbox, *, topic: str, policy_name: str) -> None:
    """One ad query per event to `topic` (keyed by user); an event whose page had no query is
    answered with nothing to send (counted in no_query)."""
    names, now = batch.label_names, time.time()
    for i, m in enumerate(batch.msgs):
        q = int(batch.query[i])
        if q < 0:
            batch.no_query += 1
            batch.answered_ts.append(m["ts"])
            continue
        try:
            f = batch.served[i]
            msg = {
                "event_id": m["event_id"],
                "user_id": m["user_id"],
                "ts": now,
                "event_ts": m["ts"],
                "query": names[q],
                **f,
                "candidates": [names[j] for j in f["candidate_ids"]],
                "policy": policy_name,
                "model_version": batch.model_version,
                "url": m["url"],
                "title": m["title"],
            }
            if "session_id" in m:
                msg["session_id"] = m["session_id"]
            out.emit(topic, m["user_id"].encode(), encode("ad_query", msg))
            batch.answered_ts.append(m["ts"])
        except Exception as exc:  # noqa: BLE001 - per-event isolation
            out.dead_letter(batch.records[i], reason("emit", exc))


def default_stages(
    settings, model: ModelHandle, policy: Policy, append: Append, mark: Mark | None = None
) -> list[tuple[str, Stage]]:
    """The pipeline, each stage under its metric name (stream.consumer_metrics.STAGES); the
    shown stage (timed as redis) when the policy reads history and `mark` is given."""
    shown: list[tuple[str, Stage]] = (
        [("redis", functools.partial(shown_stage, mark=mark))]
        if mark is not None and policy.needs_history
        else []
    )
    return [
        ("decode", functools.partial(decode_stage, max_bytes=settings.topics.max_message_bytes)),
        (
            "predict",
            functools.partial(
                predict_stage,
                model=model,
                top_k=settings.prediction.top_k,
                skip_unknown=settings.prediction.no_evidence == "skip",
            ),
        ),
        (
            "redis",
            functools.partial(state_stage, append=append, with_history=policy.needs_history),
        ),
        ("policy", functools.partial(choose_stage, policy=policy)),
        *shown,
        (
            "kafka",
            functools.partial(
                emit_stage, topic=settings.topics.ad_queries, policy_name=policy.name
            ),
        ),
    ]
