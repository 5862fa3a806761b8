"""A user's last K visit states from Redis, made readable (titles, query names, the choice).

The stream stores per visit only the page's url/title *hashes*, the Astec features z and the
top-k query ids with scores (stream.state_store, personalization.state.UserState); it does not store
the title or the ad query it emitted. Two sources fill that in:
  * the click log (`astec stream log-clicks --out DIR`): each ad impression carries the
    visit's url, title, the query shown, its candidates and the policy, joined here by event id
    with the user's ad clicks. Only the newest few date partitions are read (a user's K states
    are recent), so a big log costs no more than a few days of it;
  * the *current* policy, recomputed from the states before each visit: the GRU policy's
    probability for every candidate (the scores behind its choice), or the page's top query
    (the `top1` rule, deterministic, so for top1 streams it is exactly what was emitted).
A visit the log does not hold (no logger ran, or older than the partitions read) shows its
title hash and says so.

Each ad says why (personalization.explain): the visit its query came from ("this page", or
"2 visits ago: <title>", titles from the click log) and the policy's probability margin over the
page's own top query, for the query shown then (logged with the ad) and the one chosen now.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import redis

from personalization.explain import describe_source
from personalization.state import StateFormatError, UserState


@dataclass
class Visit:
    """One stored state in display form."""

    ts: float
    event_id: str
    url_hash: str
    title_hash: str
    top_queries: list[tuple[str, float]]
    chosen: str | None
    chosen_score: float | None
    ranking: list[tuple[str, float, float]] | None = None  # GRU: (query, probability, Astec score)
    logged: dict | None = None  # the click log's impression for this event (+ "clicked")
    chosen_from: str = ""  # where the query chosen now came from (describe_source)
    chosen_margin: float | None = None  # its probability minus the page's top query's
    shown_from: str = ""  # where the query shown then came from (logged with the ad)
    shown_margin: float | None = None


def _name(names: list[str] | None, i: int) -> str:
    if names is not None and 0 <= i < len(names):
        return names[i]
    return f"#{i}"


def states_key(prefix: str, user_id: str) -> str:
    """Same key as stream.state_store.StateStore.states_key (hash-tagged per user, id encoded)."""
    from stream.state_store import key_part

    return f"{prefix}:{{user:{key_part(user_id)}}}:states"


def read_states(client: redis.Redis, prefix: str, user_id: str) -> tuple[list[UserState], int]:
    """The user's states oldest first, and how many stored records could not be decoded."""
    # bytes: the dashboard's clients do not decode responses (sources.redis_client)
    raw = cast("list[bytes]", client.lrange(states_key(prefix, user_id), 0, -1))
    states, bad = [], 0
    for r in reversed(raw):
        try:
            states.append(UserState.decode(r))
        except StateFormatError:
            bad += 1
    return states, bad


def recent_users(client: redis.Redis, prefix: str, limit: int = 50) -> list[str]:
    """Up to `limit` user ids that have stored states (SCAN, never KEYS: safe on a big Redis)."""
    from urllib.parse import unquote

    pat = f"{prefix}:{{user:*}}:states"
    head, tail = f"{prefix}:{{user:", "}:states"
    out = []
    for raw in client.scan_iter(match=pat, count=500):
        key = raw.decode() if isinstance(raw, bytes) else raw
        out.append(unquote(key[len(head) : -len(tail)], errors="surrogatepass"))
        if len(out) >= limit:
            break
    return sorted(out)


def load_policy(policy_dir: Path | None):
    """personalization.policy.GruPolicy from `policy_dir`, or None if absent."""
    if policy_dir is None or not Path(policy_dir).exists():
        return None
    from personalization.policy import GruPolicy

    return GruPolicy.load(policy_dir)


def chosen_queries(states: list[UserState], policy=None) -> list[tuple[int, float]]:
    """(query id, score) the policy picks at each visit given the visits before it."""
    if not states:
        return []
    if policy is None:
        out = []
        for s in states:
            if s.query_ids.size == 0:
                out.append((-1, 0.0))
            else:
                j = int(np.argmax(s.scores))
                out.append((int(s.query_ids[j]), float(s.scores[j])))
        return out
    return [
        (int(q), float(sc))
        for q, sc in policy.choose_batch([states[:i] for i in range(len(states))], states)
    ]


def rankings(
    states: list[UserState], policy, names: list[str] | None, top: int = 5
) -> list[list[tuple[str, float, float]] | None]:
    """Per visit, the GRU's top candidates as (query, probability, the query's best Astec score
    in the window), or None where the policy used its cold-start rule (the page's top query)."""
    if policy is None or not states:
        return [None] * len(states)
    ranked = policy.rank_batch([states[:i] for i in range(len(states))], states)
    out: list[list[tuple[str, float, float]] | None] = []
    for i, r in enumerate(ranked):
        if r is None or r[0].size == 0:
            out.append(None)
            continue
        best: dict[int, float] = {}
        for s in states[max(0, i - policy.K + 1) : i + 1]:
            for q, sc in zip(s.query_ids.tolist(), s.scores.tolist(), strict=True):
                best[q] = max(best.get(q, 0.0), float(sc))
        out.append(
            [
                (_name(names, int(q)), float(p), best.get(int(q), 0.0))
                for q, p in zip(r[0][:top].tolist(), r[1][:top].tolist(), strict=True)
            ]
        )
    return out


def why_now(states: list[UserState], policy=None) -> list[tuple[int, str, float | None]]:
    """Per visit, (visits ago, event id, margin) of the query the policy picks now from the
    visits before it (the greedy choice): the window visit it came from and its probability
    minus the page's own top query's. The top1 rule: always this page, margin 0."""
    if policy is None or not states:
        return [(0, s.event_id, 0.0) for s in states]
    sv = policy.serve_batch(
        [states[:i] for i in range(len(states))], states, 0.0, rng=np.random.default_rng(0)
    )
    out: list[tuple[int, str, float | None]] = []
    for i in range(len(states)):
        m = float(sv.margin[i]) if sv.margin is not None else float("nan")
        out.append(
            (
                int(sv.source_ago[i]) if sv.source_ago is not None else -1,
                sv.source_event[i] if sv.source_event is not None else "",
                None if np.isnan(m) else m,
            )
        )
    return out


def logged_why(rec: dict | None, titles: dict[str, str]) -> tuple[str, float | None]:
    """(where the logged ad's query came from, its margin) from an impression's optional
    `source_visits_ago` / `source_event_id` / `margin` ("", None for ads logged without)."""
    if not rec or rec.get("source_visits_ago") is None:
        return "", None
    src = rec.get("source_event_id") or ""
    title = titles.get(src) or (rec.get("title") if src == rec.get("event_id") else None)
    margin = rec.get("margin")
    return describe_source(int(rec["source_visits_ago"]), title), (
        None if margin is None else float(margin)
    )


def visits(
    states: list[UserState],
    names: list[str] | None,
    policy=None,
    top: int = 5,
    logged: dict[str, dict] | None = None,
) -> list[Visit]:
    """Display rows for `states` (oldest first); `logged`: event id -> click-log impression."""
    chosen = chosen_queries(states, policy)
    ranks = rankings(states, policy, names, top)
    why = why_now(states, policy)
    logged = logged or {}
    titles = {e: r["title"] for e, r in logged.items() if r.get("title")}
    out = []
    for s, (q, qs), rk, (ago, src, margin) in zip(states, chosen, ranks, why, strict=True):
        shown_from, shown_margin = logged_why(logged.get(s.event_id), titles)
        tq = [
            (_name(names, int(i)), float(sc))
            for i, sc in zip(s.query_ids[:top], s.scores[:top], strict=True)
        ]
        out.append(
            Visit(
                ts=s.ts,
                event_id=s.event_id,
                url_hash=f"{s.url_hash:016x}",
                title_hash=f"{s.title_hash:016x}",
                top_queries=tq,
                chosen=_name(names, q) if q >= 0 else None,
                chosen_score=qs if q >= 0 else None,
                ranking=rk,
                logged=logged.get(s.event_id),
                chosen_from=describe_source(ago, titles.get(src)) if q >= 0 else "",
                chosen_margin=margin if q >= 0 else None,
                shown_from=shown_from,
                shown_margin=shown_margin,
            )
        )
    return out


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def visit_rows(vs: list[Visit]) -> list[dict]:
    """Visits as table rows, newest first: the title (from the click log, else its hash), the
    query shown then, where it came from, its margin and whether it was clicked, and the current
    policy's choice with where it came from, its margin and its score."""
    rows = []
    for v in reversed(vs):
        lg = v.logged or {}
        why = (
            "cold start: the page's top query"
            if v.ranking is None
            else " > ".join(f"{n} {p:.2f}" for n, p, _ in v.ranking[:2])
        )
        rows.append(
            {
                "time (UTC)": _when(v.ts),
                "title": lg.get("title") or f"(not in the click log; title hash {v.title_hash})",
                "shown then": lg.get("query", "(not logged)"),
                "shown from": v.shown_from,
                "shown margin": _round(v.shown_margin),
                "clicked": ("yes" if lg.get("clicked") else "no") if lg else "",
                "chosen now": v.chosen or "(none)",
                "chosen from": v.chosen_from,
                "chosen margin": _round(v.chosen_margin),
                "score": None if v.chosen_score is None else round(v.chosen_score, 4),
                "why (GRU probabilities)": why,
                "candidates (Astec)": " | ".join(f"{n} ({s:.3f})" for n, s in v.top_queries),
                "event": v.event_id,
                "url": lg.get("url") or f"hash {v.url_hash}",
            }
        )
    return rows


def read_user_log(
    logs_dir: Path | None, user_id: str, max_partitions: int = 3
) -> tuple[dict[str, dict], list[dict]]:
    """(event id -> impression with "clicked", the user's ad clicks newest first) from the newest
    `max_partitions` date partitions of the click log; empty when there is no log."""
    if logs_dir is None or not Path(logs_dir).is_dir():
        return {}, []
    from engine.clicklog import partitions, read_log

    imps: dict[str, dict] = {}
    clicks: list[dict] = []
    dates = sorted(
        set(partitions(logs_dir, "ad_impressions")) | set(partitions(logs_dir, "ad_clicks"))
    )[-max_partitions:]
    if not dates:
        return {}, []
    for rec in read_log(logs_dir, "ad_impressions", since=dates[0]):
        if rec.get("user_id") == user_id:
            imps[rec["event_id"]] = {**rec, "clicked": False}
    for rec in read_log(logs_dir, "ad_clicks", since=dates[0]):
        if rec.get("user_id") == user_id and rec.get("clicked"):
            clicks.append(rec)
            if rec["event_id"] in imps:
                imps[rec["event_id"]]["clicked"] = True
    clicks.sort(key=lambda r: r["ts"], reverse=True)
    return imps, clicks
