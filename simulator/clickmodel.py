"""The click model: how likely a user is to click an ad for `query` shown after viewing `page`.

Assumptions (the personalization is judged against these):
1. A session has one latent intent, a sub-topic. The click probability grows with the query's
   relevance to that intent: full if the query is in the intent sub-topic, partial if it is in the
   intent's topic, none otherwise.
2. Relevance to the page just viewed matters less: a query that leads to the page adds a small
   bonus, one of the page's sub-topic a smaller one.
3. Popular (head) queries of a sub-topic are a little more clickable than its tail.
4. Clicks are independent Bernoulli draws given (query, intent, page); no position bias. A
   scenario may add ad fatigue (simulator.scenario.Fatigue): a query shown again within the
   user's last n impressions is clicked with its probability times a factor (`fatigue`).

So on an off-intent page (a news article in the middle of a shopping session) the page's own top
query is a poor choice; a query from an earlier on-intent page is better. The best query depends
on the user's recent history, not only on the current page.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from simulator.world import World


@dataclass(frozen=True)
class ClickParams:
    """Click probability, clipped to [0, 1]:
    p = base + intent * rel(q, intent) + page * rel(q, page) + pop * head(q)."""

    base: float = 0.005
    intent: float = 0.10  # weight of relevance to the session's latent intent
    intent_same_topic: float = 0.3  # relevance of a query in the intent's topic, other sub-topic
    page: float = 0.03  # weight of relevance to the page just viewed
    page_same_subtopic: float = 0.3  # relevance to the page of a non-linked query of its sub-topic
    pop: float = 0.02  # bonus for a sub-topic's most popular query (scaled down the tail)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_scenario(cls, click) -> ClickParams:
        """The weights of a simulator.scenario.ClickModel (its fatigue applies per user,
        through `fatigue`)."""
        return cls(
            click.base,
            click.intent,
            click.intent_same_topic,
            click.page,
            click.page_same_subtopic,
            click.pop,
        )


DEFAULT_PARAMS = ClickParams()


def repeated_within(user, ts, query, window: int) -> np.ndarray:
    """bool per impression: the same query was shown to the same user within their previous
    `window` impressions (in time order; query -1 = nothing shown, never a repeat)."""
    user, ts, query = np.asarray(user), np.asarray(ts), np.asarray(query, np.int64)
    out = np.zeros(len(query), bool)
    if window <= 0 or len(query) == 0:
        return out
    shown = query >= 0
    idx = np.flatnonzero(shown)
    o = idx[np.lexsort((ts[idx], user[idx]))]
    u, q = user[o], query[o]
    rep = np.zeros(len(o), bool)
    for lag in range(1, window + 1):  # one vectorised comparison per lag
        rep[lag:] |= (u[lag:] == u[:-lag]) & (q[lag:] == q[:-lag])
    out[o] = rep
    return out


def fatigue(user, ts, query, window: int, factor: float) -> np.ndarray:
    """The fatigue multiplier per impression: `factor` on a repeat (repeated_within), else 1."""
    return np.where(repeated_within(user, ts, query, window), factor, 1.0)


def _head_score(world: World) -> np.ndarray:
    """Per query: popularity / the most popular query of its sub-topic, in [0, 1] (cached)."""
    if world._head_score is None:
        best = np.zeros(world.n_subtopics)
        np.maximum.at(best, world.query_subtopic, world.query_pop)
        world._head_score = world.query_pop / np.maximum(best[world.query_subtopic], 1e-300)
    return world._head_score


def click_probability(
    query, user_intent, page, *, world: World, params: ClickParams = DEFAULT_PARAMS
) -> np.ndarray:
    """Vectorised P(click | query, the session's intent sub-topic, the page just viewed).

    `query`, `user_intent` and `page` are ids (scalars or equal-length arrays); query id -1 means
    "nothing shown" and gets probability 0.
    """
    q = np.asarray(query, np.int64)
    intent = np.asarray(user_intent, np.int64)
    pg = np.asarray(page, np.int64)
    q, intent, pg = np.broadcast_arrays(q, intent, pg)
    shown = q >= 0
    qs = np.where(shown, q, 0)
    q_sub = world.query_subtopic[qs]
    q_top = world.query_topic[qs]
    rel_intent = np.where(
        q_sub == intent,
        1.0,
        np.where(q_top == world.subtopic_topic[intent], params.intent_same_topic, 0.0),
    )
    linked = world.is_linked(pg, qs)
    rel_page = np.where(
        linked, 1.0, np.where(q_sub == world.page_subtopic[pg], params.page_same_subtopic, 0.0)
    )
    head = _head_score(world)[qs]
    p = params.base + params.intent * rel_intent + params.page * rel_page + params.pop * head
    return np.where(shown, np.clip(p, 0.0, 1.0), 0.0)
