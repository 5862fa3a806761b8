"""The parts of a scenario that change over a run or across users: the sub-topic transition
kernel, interests that drift over days, each user's background mix of off-intent sub-topics,
and the catalogue's popularity and new inventory per day.

Each is drawn from its own generator seeded by the world's seed (and the scenario's), never from
the traffic's stream, so the default scenario draws nothing here and its logs stay identical to
the simulator's original ones; and the same world gets the same kernel, backgrounds and new
inventory in every run (bootstrap logs, the closed loop, the live stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from simulator.scenario import Catalogue, IntentProcess, Transitions
from simulator.world import World

DAY = 86400.0


def _world_seed(world: World) -> int:
    return int(world.meta.get("seed", 0))


def subtopic_traffic(world: World) -> np.ndarray:
    """Page popularity per sub-topic (0 for sub-topics without pages)."""
    return np.bincount(world.page_subtopic, weights=world.page_pop, minlength=world.n_subtopics)


def transition_kernel(world: World, tr: Transitions) -> np.ndarray:
    """int64 [S, J]: the J successors of every sub-topic (the j-th taken with weights[j]):
    distinct, never the sub-topic itself, inside its topic for scope "topic" (when the topic
    has enough other sub-topics), among sub-topics with pages."""
    rng = np.random.default_rng([_world_seed(world), tr.seed, 13])
    S, J = world.n_subtopics, len(tr.weights)
    has = subtopic_traffic(world) > 0
    out = np.empty((S, J), np.int64)
    for s in range(S):  # S is a few hundred at most: one small draw per sub-topic, once
        pool = np.flatnonzero(has & (np.arange(S) != s))
        if tr.scope == "topic":
            same = pool[world.subtopic_topic[pool] == world.subtopic_topic[s]]
            pool = same if len(same) >= J else pool
        if len(pool) == 0:
            pool = np.array([s])
        out[s] = rng.choice(pool, J, replace=len(pool) < J)
    return out


def follow_kernel(kernel: np.ndarray, weights, cur: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The successor of each current intent `cur` picked by uniforms `u`."""
    j = np.minimum(np.searchsorted(np.cumsum(weights), u, side="right"), kernel.shape[1] - 1)
    return kernel[cur, j]


@dataclass
class InterestTable:
    """Each user's interests per day: sub [U, D, 3] (-1 padding) and weights [U, D, 3]."""

    sub: np.ndarray
    cum: np.ndarray  # cumulative weights along the last axis (each row ends at 1)

    def draw(self, user: np.ndarray, day: np.ndarray, u: np.ndarray) -> np.ndarray:
        d = np.clip(day, 0, self.sub.shape[1] - 1)
        c = self.cum[user, d]
        j = np.minimum((c <= u[:, None]).sum(1), 2)
        return self.sub[user, d, j]


def interest_table(world: World, ip: IntentProcess, days: int, seed: int) -> InterestTable:
    """Interests per day: day 0 is the world's; each later day, with probability
    interest_change, one interest (picked by weight) of a user becomes another sub-topic
    (drawn by traffic), keeping its weight."""
    rng = np.random.default_rng([_world_seed(world), seed, 11])
    U = world.n_users
    counts = np.diff(world.interest_indptr)
    slot = np.arange(3)[None, :] < counts[:, None]
    base = world.interest_indptr[:-1, None] + np.arange(3)[None, :]
    safe = np.minimum(base, len(world.interest_subtopic) - 1)
    sub0 = np.where(slot, world.interest_subtopic[safe], -1).astype(np.int64)
    w0 = np.where(slot, world.interest_weight[safe], 0.0)
    traffic = subtopic_traffic(world)
    cdf = np.cumsum(traffic / traffic.sum())
    sub = np.empty((U, days, 3), np.int64)
    sub[:, 0] = sub0
    for d in range(1, days):  # one vectorised step per day
        cur = sub[:, d - 1].copy()
        change = rng.random(U) < ip.interest_change
        c = np.cumsum(w0, 1)
        j = np.minimum((c <= rng.random(U)[:, None]).sum(1), counts - 1)
        new = np.minimum(np.searchsorted(cdf, rng.random(U), side="right"), len(cdf) - 1)
        rows = np.flatnonzero(change)
        cur[rows, j[rows]] = new[rows]
        sub[:, d] = cur
    cum = np.broadcast_to(np.cumsum(w0, 1)[:, None, :], (U, days, 3)).copy()
    return InterestTable(sub, cum)


def background_mix(world: World, ip: IntentProcess) -> np.ndarray:
    """int64 [U, B]: each user's background sub-topics (their off-intent pages come from these),
    drawn by traffic, fixed for the world."""
    rng = np.random.default_rng([_world_seed(world), 17])
    traffic = subtopic_traffic(world)
    cdf = np.cumsum(traffic / traffic.sum())
    u = rng.random((world.n_users, ip.background_subtopics))
    return np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1).astype(np.int64)


@dataclass
class CatalogueDays:
    """Page popularity per day of the run [D, P] (0 for pages that do not exist yet) and the
    day each page and query first exists."""

    page_pop: np.ndarray
    page_from: np.ndarray  # int64 [P] the run's first day with the page (very negative: always)
    query_from: np.ndarray  # int64 [Q]

    def day_of(self, ts: np.ndarray, origin: float) -> np.ndarray:
        d = np.floor((np.asarray(ts) - origin) / DAY).astype(np.int64)
        return np.clip(d, 0, len(self.page_pop) - 1)


def catalogue_days(world: World, cat: Catalogue, days: int, origin: float) -> CatalogueDays:
    """Per day of a run starting at `origin` (UTC midnight): popularity (a log-normal random
    walk with popularity_drift per day) and the new inventory: new_share of the pages exist
    from the date new_from, with the queries that only they link to."""
    rng = np.random.default_rng([_world_seed(world), cat.seed, 19])
    P = world.n_pages
    is_new = rng.random(P) < cat.new_share  # drawn first: the same pages whatever `days`
    steps = rng.normal(0.0, cat.popularity_drift, (max(days - 1, 0), P))
    logw = np.concatenate([np.zeros((1, P)), np.cumsum(steps, 0)], 0)
    first = 0
    if cat.new_from:
        t_new = datetime.strptime(cat.new_from, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()
        first = int(np.ceil((t_new - origin) / DAY))  # the run's first day with it (may be < 0)
    page_from = np.where(is_new, first, np.iinfo(np.int32).min)
    page_from = page_from.astype(np.int64)
    lp = world.link_pages()
    query_from = np.full(world.n_queries, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(query_from, world.link_query, page_from[lp])
    query_from[query_from == np.iinfo(np.int64).max] = np.iinfo(np.int32).min  # unlinked
    alive = np.arange(days)[:, None] >= page_from[None, :]
    pop = world.page_pop[None, :] * np.exp(logw) * alive
    return CatalogueDays(pop, page_from, query_from)


def is_static(cat: Catalogue) -> bool:
    return cat.popularity_drift == 0.0 and cat.new_share == 0.0
