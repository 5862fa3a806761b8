"""Simulated traffic on a world: search clicks, browsing sessions, and ad impressions/clicks.

Written through engine.clicklog (date-partitioned JSON lines), so the same readers consume real
logs:
  LOG_DIR/search_clicks/   {query, url, title, ts}              population-level search clicks
  LOG_DIR/page_views/      {event_id, user_id, session_id, ts, url, title}
  LOG_DIR/ad_impressions/  {event_id, user_id, session_id, ts, url, title, query, candidates,
                            propensity, policy, model_version}  one query shown after each view
  LOG_DIR/ad_clicks/       {event_id, user_id, query, clicked, ts}  only for clicked impressions
  LOG_DIR/truth/intents.jsonl  per session: latent intent at its first view (topic, subtopic),
                               per view the intent (intents) and on_intent flags
                               (evaluation only; never read by training)
  LOG_DIR/simulation.json      the settings and counts of the run

Sessions: a user has 1-3 latent interests. A session's intent (a sub-topic) continues the
intent the user's previous session ended on with probability `persist`, else it is a fresh draw
from the interests by weight; at each later view of the session the intent drifts (a fresh draw)
with probability `drift`. So a user's earlier sessions tell about the current one, and the
latest pages tell more than the session's first. Each page view is on-intent with probability
`on_intent` (a page of the view's intent, by popularity), otherwise a popular page from anywhere.
The logging policy shows the current page's strongest query with probability 1 - epsilon and
otherwise a uniform pick among the candidates (the top queries of the last `history` pages of the
session), and logs the propensity, so the GRU can learn off-policy from these logs.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.clicklog import ClickLogWriter
from simulator.clickmodel import ClickParams, click_probability, fatigue
from simulator.dynamics import (
    background_mix,
    catalogue_days,
    follow_kernel,
    interest_table,
    is_static,
    transition_kernel,
)
from simulator.scenario import DEFAULT as DEFAULT_SCENARIO
from simulator.scenario import Scenario
from simulator.world import World, _compact_left, _row_dups, sample_in_ranges

log = logging.getLogger(__name__)
DAY = 86400.0


@dataclass
class LogSettings:
    days: int = 3
    start: str = "2026-01-05"  # first UTC day of the logs
    seed: int = 0
    search_clicks_per_day: int | None = None  # default: 5 per page of the world
    noise: float = 0.03  # share of search clicks on a random (query, page)
    on_intent: float = 0.7  # P(a page view follows the view's intent)
    mean_session_views: float = 6.0
    persist: float = 0.7  # P(a session continues the intent the user's previous session ended on)
    drift: float = 0.05  # P(the intent is redrawn at a view after the session's first)
    epsilon: float = 0.3  # exploration of the logging policy
    history: int = 5  # pages of the session whose queries are candidates
    per_page: int = 3  # top queries per page in the candidate set
    writer_id: str = "sim"
    # the rest of the traffic's structure (simulator.scenario); on_intent, persist, drift and
    # mean_session_views above are the scenario's once with_scenario has applied it
    scenario: Scenario = DEFAULT_SCENARIO


def with_scenario(s: LogSettings, sc: Scenario) -> LogSettings:
    """`s` driven by scenario `sc` (its intent chain and session length)."""
    return replace(
        s,
        scenario=sc,
        on_intent=sc.intent.on_intent,
        persist=sc.intent.persist,
        drift=sc.intent.drift,
        mean_session_views=sc.sessions.mean_views,
    )


def settings_record(s: LogSettings) -> dict:
    """simulation.json's `settings` (the scenario is recorded beside them)."""
    d = asdict(s)
    d.pop("scenario")
    return d


def _start_ts(day: str) -> float:
    return datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC).timestamp()


def _write(out: Path, kind: str, records, total: int, writer_id: str) -> int:
    n = 0
    with (
        ClickLogWriter(out, kind, writer_id=writer_id) as w,
        tqdm(total=total, desc=f"write {kind}", unit="rec", leave=False, mininterval=1) as bar,
    ):
        batch = []
        for rec in records:
            batch.append(rec)
            if len(batch) >= 50_000:
                n += w.write_many(batch)
                bar.update(len(batch))
                batch = []
        n += w.write_many(batch)
        bar.update(len(batch))
    return n


def simulate_search_clicks(world: World, rng, t0: float, s: LogSettings):
    """(page, query, ts) arrays of search clicks: links drawn by page popularity x link share
    (per day, of the pages and queries that exist that day, when the scenario's catalogue
    changes over time)."""
    per_day = s.search_clicks_per_day or 5 * world.n_pages
    if not is_static(s.scenario.catalogue):
        return _search_clicks_by_day(world, rng, t0, s, per_day)
    n = int(per_day * s.days)
    lp = world.link_pages()
    w = world.page_pop[lp] * world.link_weight
    w = w / w.sum()
    pick = np.minimum(np.searchsorted(np.cumsum(w), rng.random(n), side="right"), len(w) - 1)
    page, query = lp[pick], world.link_query[pick].astype(np.int64)
    noisy = rng.random(n) < s.noise
    k = int(noisy.sum())
    query[noisy] = np.minimum(
        np.searchsorted(np.cumsum(world.query_pop), rng.random(k), side="right"),
        world.n_queries - 1,
    )
    page[noisy] = np.minimum(
        np.searchsorted(np.cumsum(world.page_pop), rng.random(k), side="right"), world.n_pages - 1
    )
    ts = np.sort(t0 + rng.random(n) * s.days * DAY)
    return page, query, ts


def _draw_by(rng, w: np.ndarray, n: int) -> np.ndarray:
    c = np.cumsum(w)
    return np.minimum(np.searchsorted(c, rng.random(n) * c[-1], side="right"), len(w) - 1)


def _search_clicks_by_day(world: World, rng, t0: float, s: LogSettings, per_day: int):
    cat = catalogue_days(world, s.scenario.catalogue, s.days, t0)
    lp = world.link_pages()
    pages, queries, times = [], [], []
    for d in range(s.days):  # one vectorised draw per day
        n = int(per_day)
        q_alive = cat.query_from <= d
        w = cat.page_pop[d][lp] * world.link_weight * q_alive[world.link_query]
        pick = _draw_by(rng, w, n)
        page, query = lp[pick], world.link_query[pick].astype(np.int64)
        noisy = rng.random(n) < s.noise
        k = int(noisy.sum())
        query[noisy] = _draw_by(rng, world.query_pop * q_alive, k)
        page[noisy] = _draw_by(rng, cat.page_pop[d], k)
        pages.append(page)
        queries.append(query)
        times.append(t0 + (d + rng.random(n)) * DAY)
    ts = np.concatenate(times)
    o = np.argsort(ts, kind="stable")
    return np.concatenate(pages)[o], np.concatenate(queries)[o], ts[o]


@dataclass
class Sessions:
    user: np.ndarray  # per session
    intent: np.ndarray  # per session: subtopic id at its first view
    start: np.ndarray  # per session
    v_session: np.ndarray  # per view
    v_pos: np.ndarray  # per view: position within its session
    v_page: np.ndarray
    v_on: np.ndarray
    v_ts: np.ndarray
    v_intent: np.ndarray  # per view: the intent (sub-topic) at that view
    last_intent: np.ndarray  # per user: the intent their last session ended on (-1: none)


def draw_interest(world: World, user: np.ndarray, rng) -> np.ndarray:
    """One of each user's interests (sub-topic ids), by weight (each user's weights sum to 1)."""
    return _interest_of(world, user, rng.random(len(user)))


def _interest_of(world: World, user: np.ndarray, u: np.ndarray) -> np.ndarray:
    C = np.cumsum(world.interest_weight)
    idx = np.searchsorted(C, user + u, side="right")
    idx = np.clip(idx, world.interest_indptr[user], world.interest_indptr[user + 1] - 1)
    return world.interest_subtopic[idx].astype(np.int64)


def _intents(
    world: World,
    rng,
    user: np.ndarray,
    start: np.ndarray,
    v_session: np.ndarray,
    v_pos: np.ndarray,
    s: LogSettings,
    last_intent: np.ndarray | None,
    origin: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first intent per session, intent per view, last intent per user): a session continues
    the user's previous session's final intent with probability persist, else redraws; views
    redraw with probability drift. A redraw follows the scenario's transition kernel from the
    current intent with probability transitions.share, else is a fresh draw from the user's
    interests (of that day, when they drift). Each user's redraws are a chain, walked one step
    for all users at once."""
    ip = s.scenario.intent
    n_sess, V = len(user), len(v_session)
    u_s = rng.random(n_sess)  # the fresh draws' uniforms (draw_interest's, in its order)
    u_v = rng.random(V)
    if ip.interest_change > 0:
        table = interest_table(
            world, ip, s.days + int((start.max(initial=origin) - origin) // DAY) + 1, s.seed
        )
        d_s = np.floor((start - origin) / DAY).astype(np.int64)
        fresh_s = table.draw(user, d_s, u_s)
        fresh_v = table.draw(user[v_session], d_s[v_session], u_v)
    else:
        fresh_s = _interest_of(world, user, u_s)
        fresh_v = _interest_of(world, user[v_session], u_v)
    switch = (v_pos > 0) & (rng.random(V) < s.drift)
    keep = rng.random(n_sess) < s.persist
    tr = ip.transitions
    kernel = None
    if tr.share > 0:
        kernel = transition_kernel(world, tr)
        k_s, pick_s = rng.random(n_sess) < tr.share, rng.random(n_sess)
        k_v, pick_v = rng.random(V) < tr.share, rng.random(V)
    # events in each user's time order: session starts (kind 0) and switches (kind 1)
    sw = np.flatnonzero(switch)
    ev_sess = np.concatenate([np.arange(n_sess), v_session[sw]])
    ev_pos = np.concatenate([np.zeros(n_sess, np.int64), v_pos[sw]])
    ev_id = np.concatenate([np.arange(n_sess), sw])  # session id, or view id
    ev_kind = np.concatenate([np.zeros(n_sess, np.int8), np.ones(len(sw), np.int8)])
    ev_user = user[ev_sess]
    order = np.lexsort((ev_pos, start[ev_sess], ev_user))
    rank = np.arange(len(order)) - np.searchsorted(ev_user[order], ev_user[order])
    by_rank = order[np.argsort(rank, kind="stable")]
    bounds = np.searchsorted(np.sort(rank), np.arange(int(rank.max(initial=-1)) + 2))
    prev = np.full(world.n_users, -1, np.int64) if last_intent is None else last_intent.copy()
    init = np.empty(n_sess, np.int64)
    sw_intent = np.full(V, -1, np.int64)
    for r in range(len(bounds) - 1):  # each user's r-th event, all users at once
        e = by_rank[bounds[r] : bounds[r + 1]]
        p = prev[ev_user[e]]
        start_ev = ev_kind[e] == 0
        i = ev_id[e]
        si, vi = np.where(start_ev, i, 0), np.where(start_ev, 0, i)
        new = np.where(start_ev, fresh_s[si], fresh_v[vi])
        if kernel is not None:
            follow = np.where(start_ev, k_s[si], k_v[vi]) & (p >= 0)
            nxt = follow_kernel(
                kernel, tr.weights, np.maximum(p, 0), np.where(start_ev, pick_s[si], pick_v[vi])
            )
            new = np.where(follow, nxt, new)
        new = np.where(start_ev & keep[si] & (p >= 0), p, new)
        init[i[start_ev]] = new[start_ev]
        sw_intent[i[~start_ev]] = new[~start_ev]
        prev[ev_user[e]] = new
    # the last switch at or before each view (-1: none yet in its session)
    at = np.where(switch, np.arange(V), -1)
    seg = np.maximum.accumulate(np.where(v_pos == 0, np.arange(V), at))
    last_sw = np.where(switch[seg], seg, -1)  # seg is the session's first view or a switch
    v_intent = np.where(last_sw >= 0, sw_intent[np.maximum(last_sw, 0)], init[v_session])
    return init, v_intent, prev


def simulate_sessions(
    world: World,
    rng,
    t0: float,
    s: LogSettings,
    last_intent: np.ndarray | None = None,
    origin: float | None = None,
) -> Sessions:
    """Browsing sessions with a latent intent each (persisting across a user's sessions from
    `last_intent`, per user, when given, and drifting within them); views in session order.
    `origin` is the run's first day (default t0): the scenario's day-to-day changes count days
    from it."""
    sh = s.scenario.sessions
    origin = t0 if origin is None else origin
    n_sess = rng.poisson(world.user_activity * s.days)
    user = np.repeat(np.arange(world.n_users), n_sess)
    start = t0 + rng.random(len(user)) * (s.days * DAY - 2 * 3600)
    length = np.minimum(
        1 + rng.geometric(1.0 / (s.mean_session_views - 1), len(user)), sh.max_views
    )
    v_session = np.repeat(np.arange(len(user)), length)
    first = np.concatenate([[0], np.cumsum(length)[:-1]])
    v_pos = np.arange(len(v_session)) - first[v_session]
    intent, vi, last = _intents(world, rng, user, start, v_session, v_pos, s, last_intent, origin)
    on = rng.random(len(v_session)) < s.on_intent
    static = is_static(s.scenario.catalogue)
    if static:  # the original order of draws: pages, then gaps
        page = _pages(world, rng, vi, on, user[v_session], s, None, None)
    gaps = sh.min_gap_s + rng.exponential(sh.mean_gap_s, len(v_session))
    if sh.pause_share > 0:
        pause = rng.random(len(v_session)) < sh.pause_share
        long = sh.pause_min_s + rng.exponential(sh.pause_mean_s, len(v_session))
        gaps = np.where(pause, long, gaps)
    gaps[v_pos == 0] = 0.0
    csum = np.cumsum(gaps)
    offset = csum - csum[first][v_session]
    if sh.follow_share > 0:
        end = np.concatenate([first[1:], [len(v_session)]]) - 1 if len(user) else first
        start = _follow_starts(rng, user, start, offset[end] if len(user) else start, sh)
    ts = start[v_session] + csum - csum[first][v_session]  # this order of float additions
    if not static:
        days = s.days + int((t0 - origin) // DAY) + 1
        cat = catalogue_days(world, s.scenario.catalogue, days, origin)
        page = _pages(world, rng, vi, on, user[v_session], s, cat, cat.day_of(ts, origin))
    return Sessions(user, intent, start, v_session, v_pos, page, on, ts, vi, last)


def _follow_starts(rng, user, start, duration, sh) -> np.ndarray:
    """Session starts where, with probability follow_share, a session begins minutes after the
    end of the user's previous one (the others keep their start, after that end)."""
    n = len(user)
    follow = rng.random(n) < sh.follow_share
    gap = sh.follow_gap_s + rng.exponential(sh.follow_gap_mean_s, n)
    order = np.lexsort((start, user))
    rank = np.arange(n) - np.searchsorted(user[order], user[order])
    prev_end = np.full(int(user.max(initial=-1)) + 1, -np.inf)
    out = start.copy()
    for r in range(int(rank.max(initial=-1)) + 1):  # each user's r-th session, all at once
        k = order[rank == r]
        pe = prev_end[user[k]]
        has = np.isfinite(pe)
        out[k] = np.where(
            follow[k] & has,
            pe + gap[k],
            np.maximum(start[k], np.where(has, pe, -np.inf) + sh.min_gap_s),
        )
        prev_end[user[k]] = out[k] + duration[k]
    return out


def _pages(world: World, rng, vi, on, v_user, s: LogSettings, cat, day) -> np.ndarray:
    """On-intent views: a page of the view's intent sub-topic by popularity; off-intent views a
    popular page from anywhere, or of the user's background mix (scenario intent.off_intent).
    With a changing catalogue (cat, day per view), popularity and existence are that day's."""
    ip = s.scenario.intent
    order = np.argsort(world.page_subtopic, kind="stable")
    sub_sorted = world.page_subtopic[order]
    bounds = np.searchsorted(sub_sorted, np.arange(world.n_subtopics + 1))
    lo, hi = bounds[vi], bounds[vi + 1]
    on = on & (hi > lo)
    if ip.off_intent == "background":
        bg = background_mix(world, ip)
        b = bg[v_user, rng.integers(0, bg.shape[1], len(v_user))]
        lo = np.where(on, lo, bounds[b])
        hi = np.where(on, hi, bounds[b + 1])
        ranged = on | (hi > lo)
    else:
        ranged = on
    lo, hi = np.where(ranged, lo, 0), np.where(ranged, hi, world.n_pages)
    if cat is None:
        return order[sample_in_ranges(rng, world.page_pop[order], lo, hi)]
    page = np.empty(len(vi), np.int64)
    for d in np.unique(day).tolist():  # one vectorised draw per day
        m = np.flatnonzero(day == d)
        w = cat.page_pop[d][order]
        cw = np.concatenate([[0.0], np.cumsum(w)])
        empty = cw[hi[m]] - cw[lo[m]] <= 0  # none of its pages exists yet: anywhere
        a, b = np.where(empty, 0, lo[m]), np.where(empty, world.n_pages, hi[m])
        page[m] = order[sample_in_ranges(rng, w, a, b)]
    return page


def logging_policy(world: World, ss: Sessions, rng, s: LogSettings):
    """Candidates from the session's last `history` pages; epsilon-greedy on the page's top
    query."""
    V = len(ss.v_page)
    tops = world.top_queries(ss.v_page, s.per_page)
    cols = []
    for lag in range(s.history):
        src = np.arange(V) - lag
        ok = ss.v_pos >= lag
        cols.append(np.where(ok[:, None], tops[np.maximum(src, 0)], -1))
    cand = np.concatenate(cols, axis=1)
    cand = _compact_left(np.where(_row_dups(cand), -1, cand))
    n_valid = (cand >= 0).sum(axis=1)
    top = cand[:, 0]
    explore = rng.random(V) < s.epsilon
    pick = np.minimum((rng.random(V) * n_valid).astype(np.int64), n_valid - 1)
    shown = np.where(explore, cand[np.arange(V), pick], top)
    propensity = (1 - s.epsilon) * (shown == top) + s.epsilon / n_valid
    return cand, shown, propensity


def simulate_logs(
    world: World,
    out: str | Path,
    settings: LogSettings | None = None,
    params: ClickParams | None = None,
    world_dir: str | None = None,
) -> dict:
    """Simulate and write all logs; returns the counts written to simulation.json. The click
    weights are `params` when given, else the scenario's. One writer per directory: a second
    run into the same `out` is refused while the first writes (simulation.json, the finished
    mark, is written last) and after it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".simulate.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FileExistsError(
                f"{out}: another simulation is writing its logs here; choose a new --out"
            ) from None
        if (out / "simulation.json").exists():
            raise FileExistsError(
                f"{out}: already holds simulated logs (simulation.json); "
                "logs are append-only, so choose a new --out"
            )
        return _simulate_logs(world, out, settings, params, world_dir)


def _simulate_logs(
    world: World,
    out: Path,
    settings: LogSettings | None,
    params: ClickParams | None,
    world_dir: str | None,
) -> dict:
    s = settings or LogSettings()
    params = params or ClickParams.from_scenario(s.scenario.click)
    rng = np.random.default_rng(s.seed)
    t0 = _start_ts(s.start)
    clock = time.perf_counter()
    qt, titles, urls = world.query_text, world.page_title, world.page_url

    page, query, ts = simulate_search_clicks(world, rng, t0, s)
    n_search = _write(
        out,
        "search_clicks",
        (
            {"query": qt[q], "url": urls[p], "title": titles[p], "ts": round(t, 3)}
            for p, q, t in zip(page.tolist(), query.tolist(), ts.tolist(), strict=True)
        ),
        len(ts),
        s.writer_id,
    )

    ss = simulate_sessions(world, rng, t0, s)
    cand, shown, prop = logging_policy(world, ss, rng, s)
    p_click = click_probability(shown, ss.v_intent, ss.v_page, world=world, params=params)
    fat = s.scenario.click.fatigue
    if fat.window > 0:
        p_click = p_click * fatigue(ss.user[ss.v_session], ss.v_ts, shown, fat.window, fat.factor)
    clicked = rng.random(len(shown)) < p_click
    order = np.argsort(ss.v_ts, kind="stable")
    uid = [world.user_id(u) for u in ss.user.tolist()]
    sid = [f"s{i:08d}" for i in range(len(ss.user))]
    v_sess, v_pos, v_page = ss.v_session.tolist(), ss.v_pos.tolist(), ss.v_page.tolist()
    v_ts = ss.v_ts.tolist()

    def eid(prefix, i):
        return f"{prefix}-{sid[v_sess[i]]}-{v_pos[i]:03d}"

    n_views = _write(
        out,
        "page_views",
        (
            {
                "event_id": eid("pv", i),
                "user_id": uid[v_sess[i]],
                "session_id": sid[v_sess[i]],
                "ts": round(v_ts[i], 3),
                "url": urls[v_page[i]],
                "title": titles[v_page[i]],
            }
            for i in order.tolist()
        ),
        len(order),
        s.writer_id,
    )
    cand_l, shown_l, prop_l = cand.tolist(), shown.tolist(), prop.tolist()
    n_imp = _write(
        out,
        "ad_impressions",
        (
            {
                "event_id": eid("ad", i),
                "user_id": uid[v_sess[i]],
                "session_id": sid[v_sess[i]],
                "ts": round(v_ts[i] + 1.0, 3),
                "url": urls[v_page[i]],
                "title": titles[v_page[i]],
                "query": qt[shown_l[i]],
                "candidates": [qt[q] for q in cand_l[i] if q >= 0],
                "propensity": round(prop_l[i], 6),
                "policy": f"top-query-eps{s.epsilon:g}",
                "model_version": "simulator",
            }
            for i in order.tolist()
        ),
        len(order),
        s.writer_id,
    )
    c_idx = order[clicked[order]]
    delay = rng.exponential(10.0, len(c_idx)) + 1.5
    c_ts = ss.v_ts[c_idx] + delay
    c_order = np.argsort(c_ts, kind="stable")
    c_idx, c_ts = c_idx[c_order].tolist(), c_ts[c_order].tolist()
    n_clicks = _write(
        out,
        "ad_clicks",
        (
            {
                "event_id": eid("ad", i),
                "user_id": uid[v_sess[i]],
                "query": qt[shown_l[i]],
                "clicked": True,
                "ts": round(t, 3),
            }
            for i, t in zip(c_idx, c_ts, strict=True)
        ),
        len(c_idx),
        s.writer_id,
    )

    (out / "truth").mkdir(exist_ok=True)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(ss.v_session, minlength=len(ss.user)))])
    on_l, vint_l = ss.v_on.tolist(), ss.v_intent.tolist()
    with open(out / "truth" / "intents.jsonl", "w", encoding="utf-8") as f:
        for k in range(len(ss.user)):
            a, b = int(bounds[k]), int(bounds[k + 1])
            f.write(
                json.dumps(
                    {
                        "session_id": sid[k],
                        "user_id": uid[k],
                        "subtopic": int(ss.intent[k]),
                        "topic": int(world.subtopic_topic[ss.intent[k]]),
                        "start_ts": round(v_ts[a], 3),
                        "end_ts": round(v_ts[b - 1], 3),
                        "on_intent": on_l[a:b],
                        "intents": vint_l[a:b],
                    }
                )
                + "\n"
            )
    summary = {
        "world": world_dir,
        "settings": settings_record(s),
        "click_model": params.to_dict(),
        "scenario": s.scenario.to_dict(),
        "counts": {
            "search_clicks": n_search,
            "sessions": len(ss.user),
            "page_views": n_views,
            "ad_impressions": n_imp,
            "ad_clicks": n_clicks,
        },
        "ctr": round(n_clicks / max(n_imp, 1), 5),
        "on_intent_share": round(float(ss.v_on.mean()), 4) if len(ss.v_on) else 0.0,
        "seconds": round(time.perf_counter() - clock, 1),
    }
    (out / "simulation.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
