"""Visit logs drawn from the simulator's traffic model, with the world's true top queries of
each page standing in for an engine's predictions: logs whose generating settings a test can
vary without training an engine."""

import numpy as np

from personalization.visits import VisitLog
from simulator.clickmodel import click_probability
from simulator.traffic import LogSettings, logging_policy, simulate_sessions
from simulator.world import World


def traffic_visits(
    world: World, settings: LogSettings, view_gap_scale: float = 1.0, k: int = 10
) -> VisitLog:
    """A VisitLog of `settings`' sessions on `world` (the gaps between a session's views
    stretched by view_gap_scale), ads shown by the simulator's epsilon-greedy logger and
    clicked by its click model."""
    rng = np.random.default_rng(settings.seed)
    ss = simulate_sessions(world, rng, 1.7e9, settings)
    start = ss.start[ss.v_session]
    ts = start + view_gap_scale * (ss.v_ts - start)
    _, shown, prop = logging_policy(world, ss, rng, settings)
    clicked = rng.random(len(shown)) < click_probability(shown, ss.v_intent, ss.v_page, world=world)
    user = ss.user[ss.v_session]
    o = np.lexsort((ts, user))
    pages = np.arange(world.n_pages)
    IDS = world.top_queries(pages, k).astype(np.int64)
    SC = np.where(IDS >= 0, 1.0 / (1.0 + np.arange(k))[None, :], 0.0).astype(np.float32)
    n = len(o)
    return VisitLog(
        user=user[o],
        user_ids=[f"u{i}" for i in range(world.n_users)],
        ts=ts[o],
        session=ss.v_session[o],
        session_ids=[f"s{i}" for i in range(len(ss.user))],
        event_ids=[f"e{i}" for i in range(n)],
        page=ss.v_page[o],
        Z=np.ones((world.n_pages, 4), np.float16),
        IDS=IDS,
        SC=SC,
        shown=shown[o],
        clicked=clicked[o],
        propensity=prop[o],
        search_indptr=np.zeros(n + 1, np.int64),
        search_ids=np.zeros(0, np.int64),
        pop_q=shown[o][clicked[o]],
        pop_ts=ts[o][clicked[o]],
        n_labels=world.n_queries,
        engine_version="truth",
    )
