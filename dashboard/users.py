"""A user's last K visit states from Redis, made readable (query names, times, chosen query).

The stream stores per visit the page's url/title hashes, the Astec features z and the top-k
query ids with scores (stream.state, personalization.state.UserState); it does not store the ad
query it emitted. The dashboard therefore shows the query the *current* policy chooses at each
visit from the states before it: the GRU policy (MODELS_DIR/gru or ASTEC_DASHBOARD_POLICY) when
one is available, otherwise the page's top query (the `top1` policy, which is deterministic, so
for top1 streams this is exactly what was emitted).
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

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


def _name(names: list[str] | None, i: int) -> str:
    if names is not None and 0 <= i < len(names):
        return names[i]
    return f"#{i}"


def states_key(prefix: str, user_id: str) -> str:
    """Same key as stream.state.StateStore.states_key (hash-tagged per user)."""
    return f"{prefix}:{{user:{user_id}}}:states"


def read_states(client: redis.Redis, prefix: str, user_id: str) -> tuple[list[UserState], int]:
    """The user's states oldest first, and how many stored records could not be decoded."""
    raw = client.lrange(states_key(prefix, user_id), 0, -1)
    states, bad = [], 0
    for r in reversed(raw):
        try:
            states.append(UserState.decode(r))
        except StateFormatError:
            bad += 1
    return states, bad


def recent_users(client: redis.Redis, prefix: str, limit: int = 50) -> list[str]:
    """Up to `limit` user ids that have stored states (SCAN, never KEYS: safe on a big Redis)."""
    pat = f"{prefix}:{{user:*}}:states"
    head, tail = f"{prefix}:{{user:", "}:states"
    out = []
    for key in client.scan_iter(match=pat, count=500):
        key = key.decode() if isinstance(key, bytes) else key
        out.append(key[len(head):-len(tail)])
        if len(out) >= limit:
            break
    return sorted(out)


def load_policy(policy_dir: Path | None):
    """personalization.policy.GruPolicy from `policy_dir` (numpy backend), or None if absent."""
    if policy_dir is None or not Path(policy_dir).exists():
        return None
    from personalization.policy import GruPolicy
    return GruPolicy.load(policy_dir, backend="numpy")


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
    return [(int(q), float(sc)) for q, sc in
            policy.choose_batch([states[:i] for i in range(len(states))], states)]


def visits(states: list[UserState], names: list[str] | None, policy=None,
           top: int = 5) -> list[Visit]:
    """Display rows for `states` (oldest first)."""
    chosen = chosen_queries(states, policy)
    out = []
    for s, (q, qs) in zip(states, chosen):
        tq = [(_name(names, int(i)), float(sc)) for i, sc in zip(s.query_ids[:top], s.scores[:top])]
        out.append(Visit(ts=s.ts, event_id=s.event_id, url_hash=f"{s.url_hash:016x}",
                         title_hash=f"{s.title_hash:016x}", top_queries=tq,
                         chosen=_name(names, q) if q >= 0 else None,
                         chosen_score=qs if q >= 0 else None))
    return out


def visit_rows(vs: list[Visit]) -> list[dict]:
    """Visits as table rows, newest first."""
    rows = []
    for v in reversed(vs):
        rows.append({
            "time (UTC)": dt.datetime.fromtimestamp(v.ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "event": v.event_id, "chosen ad query": v.chosen or "(none)",
            "score": None if v.chosen_score is None else round(v.chosen_score, 4),
            "top queries": " | ".join(f"{n} ({s:.3f})" for n, s in v.top_queries),
            "url hash": v.url_hash, "title hash": v.title_hash})
    return rows
