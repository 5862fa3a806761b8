"""Stream health from the per-consumer snapshots the workers publish to Redis (stream.metrics).

Each consumer rewrites its hash every metrics_interval_s with a 120 s TTL, so a consumer that
died disappears after two minutes; before that its `updated_at` stops moving and it is flagged
stale here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from stream.metrics import STAGES, read_all

TEXT = ("consumer", "model_version", "policy")
COLUMNS = ("consumer", "status", "model_version", "policy", "partitions", "events", "events_per_s",
           "dead_letters", "no_query", "duplicates", "batch_ms_p50", "batch_ms_p99", "e2a_ms_p50",
           "e2a_ms_p95", "e2a_ms_p99", "age_s", "uptime_s", "pid")
HIDDEN = {"updated_at", *(f"{s}_s" for s in STAGES)}   # shown as age_s and in the stage chart


@dataclass
class Health:
    """Consumers' rows plus the fleet totals shown above the table."""

    rows: list[dict]
    events: int
    events_per_s: float
    dead_letters: int
    versions: dict[str, int]        # model version -> number of consumers serving it
    stale: int
    stages: list[dict]              # per consumer: cumulative seconds per pipeline stage


def _num(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if x != x else (int(x) if x.is_integer() and abs(x) < 2 ** 53 else x)


def _value(key: str, v):
    """Numbers as numbers ("nan" -> None: no samples yet), names and unknown text as they are."""
    if key in TEXT:
        return v
    x = _num(v)
    return x if x is not None or v in ("nan", "") else v


def consumer_health(client: redis.Redis, prefix: str, interval_s: float = 1.0,
                    now: float | None = None) -> Health:
    """Read every live consumer's snapshot; a consumer silent for > max(5 s, 5 intervals) is stale."""
    now = time.time() if now is None else now
    stale_after = max(5.0, 5 * interval_s)
    rows = []
    for snap in read_all(client, prefix):
        row = {k: _value(k, v) for k, v in snap.items()}
        age = None if row.get("updated_at") is None else round(now - row["updated_at"], 1)
        row["age_s"] = age
        row["status"] = "stale" if age is None or age > stale_after else "live"
        rows.append(row)
    live = [r for r in rows if r["status"] == "live"]
    versions: dict[str, int] = {}
    for r in rows:
        v = r.get("model_version") or "(none)"
        versions[v] = versions.get(v, 0) + 1
    return Health(
        rows=[{**{c: r.get(c) for c in COLUMNS},     # fields a newer worker adds come last
               **{k: v for k, v in r.items() if k not in COLUMNS and k not in HIDDEN}}
              for r in rows],
        events=int(sum(r.get("events") or 0 for r in rows)),
        events_per_s=round(float(sum(r.get("events_per_s") or 0 for r in live)), 1),
        dead_letters=int(sum(r.get("dead_letters") or 0 for r in rows)),
        versions=versions, stale=len(rows) - len(live),
        stages=[{"consumer": r.get("consumer"), **{s: r.get(f"{s}_s") for s in STAGES}}
                for r in rows])
