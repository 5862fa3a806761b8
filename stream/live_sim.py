"""`astec stream simulate`: live traffic from a simulated world, and clicks from its click model.

Page views come from the world's browsing-session model (simulator.traffic under the run's
scenario, simulator.scenario: a latent intent that persists across a user's sessions and drifts
within them, on/off-intent pages), replayed in time order at --rate events/s with the current
time stamped. A second thread reads `ad-queries` and, for the events this run produced, draws a
click with simulator.clickmodel.click_probability(query, the view's intent, page) under the
scenario's click weights (times its fatigue factor when the user was shown the query within
their last n ads) and produces `ad-clicks`. Event -> ad latency is measured on arrival
(receive time - event ts).

A page whose title holds no word the model knows gets no ad by design
(Settings.prediction.no_evidence "skip"): given the model's `known` test, such events left
without an answer count as `no_ad`, the others as `unanswered`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np

from stream.rdkafka_producer import RdProducer
from stream.schemas import SchemaError, decode, encode
from stream.settings import Settings
from stream.topics import make_consumer

log = logging.getLogger(__name__)


def plan_views(world, n: int, seed: int = 0, scenario=None) -> dict[str, np.ndarray]:
    """n page views (user, session, the view's intent, page) in time order from the world's
    session model under `scenario` (simulator.scenario; None: the default)."""
    from simulator.scenario import DEFAULT
    from simulator.traffic import LogSettings, simulate_sessions, with_scenario

    rng = np.random.default_rng(seed)
    days = 1
    while True:
        s = with_scenario(LogSettings(days=days, seed=seed), scenario or DEFAULT)
        ss = simulate_sessions(world, rng, 0.0, s)
        if len(ss.v_page) >= n or days >= 64:
            break
        days *= 2
    if len(ss.v_page) == 0:
        raise ValueError("the world produced no page views (no active users?)")
    order = np.argsort(ss.v_ts, kind="stable")
    order = np.resize(order, n)  # cycles when a small world has fewer views than asked
    sess = ss.v_session[order]
    return {
        "user": ss.user[sess],
        "session": sess,
        # each view's own intent: interests drift within a session (simulator.traffic)
        "intent": ss.v_intent[order],
        "page": ss.v_page[order],
    }


def sim_producer(settings: Settings, client_id: str) -> RdProducer:
    """The simulator's producers are librdkafka's, like the workers': kafka-python's computed
    each batch's CRC-32C in Python and ran its sender as a Python thread, and the simulator took
    ~30% of a core at 100 page views/s on the demo's 2 shared cores."""
    return RdProducer(settings, client_id, settings.producer.linger_ms)


class ClickResponder(threading.Thread):
    """Reads ad queries for this run's events; produces one ad-click (clicked or not) each."""

    def __init__(
        self, settings: Settings, world, pending: dict, seed: int, run_id: str, scenario=None
    ):
        from simulator.clickmodel import ClickParams
        from simulator.scenario import DEFAULT

        super().__init__(daemon=True)
        self.s, self.world, self.pending = settings, world, pending
        click = (scenario or DEFAULT).click
        self.params = ClickParams.from_scenario(click)
        self.fatigue = click.fatigue
        self.recent: dict[str, list[int]] = {}  # per user: the queries of their last n ads
        self.rng = np.random.default_rng(seed + 1)
        self.qid = {t: i for i, t in enumerate(world.query_text)}
        # no consumer group: it reads its own run's answers from every partition (a group join
        # on a topic created moments before could leave it without partitions for a minute)
        # it waits on the broker between answers (fetch_wait_max_ms: a record ends the wait) and
        # skips kafka-python's pure-Python CRC check (librdkafka checked the batches it produced)
        self.consumer = make_consumer(
            settings,
            [],
            None,
            auto_offset_reset="latest",
            max_poll_records=2000,
            fetch_max_wait_ms=max(1, settings.consumer.fetch_wait_max_ms),
            check_crcs=False,
        )
        self.producer = sim_producer(settings, "astec-sim-clicks")
        self.stop_event = threading.Event()
        self.answered = 0
        self.clicks = 0
        self.ignored = 0  # ad queries of other runs, or replays of answered events
        self.unknown_queries = 0
        self.latency_ms: list[np.ndarray] = []
        self.latency_event: list[np.ndarray] = []  # each latency's event number in the run
        self.ready = threading.Event()

    def wait_assigned(self, timeout: float = 60.0) -> None:
        """Take every partition of the ad-queries topic at its current end, before any event is
        produced, so no answer of this run is missed."""
        from kafka.structs import TopicPartition

        topic = self.s.topics.ad_queries
        deadline = time.monotonic() + timeout
        parts = None
        while not parts and time.monotonic() < deadline:
            parts = self.consumer.partitions_for_topic(topic)
            if not parts:
                time.sleep(0.2)
        if not parts:
            raise RuntimeError(
                f"simulator consumer found no partition of {topic} within {timeout}s"
            )
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.consumer.position(tp)  # resolve the end offsets now

    def _tired(self, users: list[str], q: np.ndarray) -> np.ndarray:
        """Fatigue factor per answer (in arrival order): the query was among the user's last
        `window` ads."""
        out = np.ones(len(q))
        n = self.fatigue.window
        for i, (u, qi) in enumerate(zip(users, q.tolist(), strict=True)):
            seen = self.recent.setdefault(u, [])
            if qi >= 0 and qi in seen:
                out[i] = self.fatigue.factor
            seen.append(qi)
            del seen[:-n]
        return out

    def run(self) -> None:
        from simulator.clickmodel import click_probability

        try:
            while not self.stop_event.is_set():
                recs = [r for rs in self.consumer.poll(timeout_ms=100).values() for r in rs]
                if not recs:
                    continue
                now = time.time()
                batch = []
                for r in recs:
                    try:
                        m = decode("ad_query", r.value, 1 << 22)
                    except SchemaError:
                        continue
                    ev = self.pending.pop(m["event_id"], None)
                    if ev is None:
                        self.ignored += 1
                        continue
                    batch.append((m, ev))
                if not batch:
                    continue
                self.latency_ms.append(np.array([(now - m["event_ts"]) * 1000 for m, _ in batch]))
                self.latency_event.append(
                    np.array([int(m["event_id"].rsplit("-", 1)[1]) for m, _ in batch])
                )
                q = np.array([self.qid.get(m["query"], -1) for m, _ in batch], np.int64)
                self.unknown_queries += int((q < 0).sum())
                intent = np.array([ev[0] for _, ev in batch], np.int64)
                page = np.array([ev[1] for _, ev in batch], np.int64)
                p = click_probability(q, intent, page, world=self.world, params=self.params)
                if self.fatigue.window > 0:
                    p = p * self._tired([m["user_id"] for m, _ in batch], q)
                clicked = self.rng.random(len(batch)) < p
                for (m, _), c in zip(batch, clicked, strict=True):
                    self.producer.send(
                        self.s.topics.ad_clicks,
                        key=m["user_id"].encode(),
                        value=encode(
                            "ad_click",
                            {
                                "event_id": m["event_id"],
                                "user_id": m["user_id"],
                                "query": m["query"],
                                "clicked": bool(c),
                                "ts": now,
                            },
                        ),
                    )
                # no flush per batch: it held the next answers for a broker round trip each
                # time; librdkafka sends within its linger and close() flushes the rest
                self.answered += len(batch)
                self.clicks += int(clicked.sum())
        finally:
            self.producer.close(timeout=10)
            self.consumer.close(autocommit=False)


def run_simulation(
    settings: Settings,
    world_dir: str,
    rate: float,
    duration: float,
    seed: int = 0,
    drain_s: float = 15.0,
    progress: bool = True,
    warmup_s: float = 0.0,
    scenario=None,
    known=None,
) -> dict:
    """Produce rate*(warmup+duration) page views, answer their ad queries with clicks; returns
    figures. The first warmup_s seconds of traffic pay one-time costs (the workers' kernel
    compilation and first fetches, the group settling): their latency is reported apart.
    `scenario`: the traffic's (default: the world's). `known(titles) -> bool array`: whether
    the model knows a word of each title (Predictor.has_evidence); with it, an event left
    without an ad whose page it does not know counts as no_ad (none by design), not as
    unanswered."""
    from tqdm import tqdm

    from simulator.scenario import world_scenario
    from simulator.world import load_world

    world = load_world(world_dir)
    sc = scenario if scenario is not None else world_scenario(world_dir)
    n_warm = int(rate * warmup_s)
    n = n_warm + max(1, int(rate * duration))
    plan = plan_views(world, n, seed, sc)
    run_id = uuid.uuid4().hex[:8]
    pending: dict[str, tuple[int, int]] = {}
    responder = ClickResponder(settings, world, pending, seed, run_id, sc)
    responder.wait_assigned()
    responder.start()
    producer = sim_producer(settings, "astec-sim-views")
    t0 = time.monotonic()
    bar = tqdm(total=n, desc="page views", unit="ev", disable=not progress)
    try:
        for i in range(n):
            u, page = int(plan["user"][i]), int(plan["page"][i])
            eid = f"sim-{run_id}-{i}"
            pending[eid] = (int(plan["intent"][i]), page)
            uid = world.user_id(u)
            producer.send(
                settings.topics.page_views,
                key=uid.encode(),
                value=encode(
                    "page_view",
                    {
                        "event_id": eid,
                        "user_id": uid,
                        "ts": time.time(),
                        "url": world.page_url[page],
                        "title": world.page_title[page],
                        "session_id": f"s{run_id}-{int(plan['session'][i])}",
                    },
                ),
            )
            bar.update(1)
            ahead = (i + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
        producer.flush()
        sent_s = time.monotonic() - t0
        bar.close()
        # the planned pages the model knows no word of, asked once: with no_evidence = skip
        # they get no ad, so waiting for their answers would only run the drain out; a view
        # of one left unanswered counts as no_ad
        unknown_pages: set[int] = set()
        if known is not None:
            pages = np.unique(plan["page"][:n])
            ok = np.asarray(known([world.page_title[p] for p in pages]), bool)
            unknown_pages = set(pages[~ok].tolist())
        not_awaited = unknown_pages if settings.prediction.no_evidence == "skip" else set()
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and any(
            page not in not_awaited for _, page in list(pending.values())
        ):
            time.sleep(0.05)
    finally:
        bar.close()
        producer.close(timeout=10)
        responder.stop_event.set()
        responder.join(15)
    lat = np.concatenate(responder.latency_ms) if responder.latency_ms else np.zeros(0)
    idx = np.concatenate(responder.latency_event) if responder.latency_event else np.zeros(0)
    pct = _percentiles(lat[idx >= n_warm])
    warm = _percentiles(lat[idx < n_warm]) if n_warm else {}
    no_ad = sum(page in unknown_pages for _, page in pending.values())
    return {
        "page_views": n,
        "warmup_page_views": n_warm,
        "send_s": round(sent_s, 2),
        "rate_achieved": round(n / sent_s, 1),
        "ad_queries": responder.answered,
        "unanswered": len(pending) - no_ad,
        "no_ad": no_ad if known is not None else None,  # None: the model was not given
        "clicks": responder.clicks,
        "ctr": round(responder.clicks / max(1, responder.answered), 4),
        "unknown_queries": responder.unknown_queries,
        "ignored": responder.ignored,
        **{f"e2a_ms_{k}": v for k, v in pct.items()},
        **{f"warmup_e2a_ms_{k}": v for k, v in warm.items()},
    }


def _percentiles(lat: np.ndarray) -> dict:
    if not lat.size:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(lat, [50, 95, 99]).round(1).tolist()
    return {"p50": p50, "p95": p95, "p99": p99}


def known_words(model: str):
    """The `known` test of run_simulation for an engine model path (the predictor's
    has_evidence: its vectorizers' words and n-grams, and its label names' words)."""
    from engine.model_paths import resolve_model
    from stream.model_handle import load_predictor

    return load_predictor(resolve_model(model, prefer="predictor").path).has_evidence
