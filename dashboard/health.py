"""Stream health from the per-consumer snapshots the workers publish to Redis
(stream.consumer_metrics).

Each consumer rewrites its hash every metrics_interval_s with a 120 s TTL, so a consumer that
died disappears after two minutes; before that its `updated_at` stops moving and it is flagged
stale here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis

from stream.consumer_metrics import STAGES, read_all, read_series

TEXT = ("consumer", "model_version", "policy")
COLUMNS = (
    "consumer",
    "status",
    "model_version",
    "policy",
    "partitions",
    "events",
    "events_per_s",
    "dead_letters",
    "no_query",
    "duplicates",
    "batch_ms_p50",
    "batch_ms_p99",
    "e2a_ms_p50",
    "e2a_ms_p95",
    "e2a_ms_p99",
    "age_s",
    "uptime_s",
    "pid",
)
HIDDEN = {"updated_at", *(f"{s}_s" for s in STAGES)}  # shown as age_s and in the stage chart


@dataclass
class Health:
    """Consumers' rows plus the fleet totals shown above the table."""

    rows: list[dict]
    events: int
    events_per_s: float
    dead_letters: int
    versions: dict[str, int]  # model version -> number of consumers serving it
    stale: int
    stages: list[dict]  # per consumer: cumulative seconds per pipeline stage


def _num(v):
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else (int(x) if x.is_integer() and abs(x) < 2**53 else x)


def _value(key: str, v):
    """Numbers as numbers ("nan" -> None: no samples yet), names and unknown text as they are."""
    if key in TEXT:
        return v
    x = _num(v)
    return x if x is not None or v in ("nan", "") else v


def consumer_health(
    client: redis.Redis, prefix: str, interval_s: float = 1.0, now: float | None = None
) -> Health:
    """Read every live consumer's snapshot; a consumer silent for > max(5 s, 5 intervals) is
    stale."""
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
        rows=[
            {
                **{c: r.get(c) for c in COLUMNS},  # fields a newer worker adds come last
                **{k: v for k, v in r.items() if k not in COLUMNS and k not in HIDDEN},
            }
            for r in rows
        ],
        events=int(sum(r.get("events") or 0 for r in rows)),
        events_per_s=round(float(sum(r.get("events_per_s") or 0 for r in live)), 1),
        dead_letters=int(sum(r.get("dead_letters") or 0 for r in rows)),
        versions=versions,
        stale=len(rows) - len(live),
        stages=[
            {"consumer": r.get("consumer"), **{s: r.get(f"{s}_s") for s in STAGES}} for r in rows
        ],
    )


def series_frame(
    client: redis.Redis,
    prefix: str,
    window_s: float | None = None,
    now: float | None = None,
    anchor_last: bool = False,
):
    """The consumers' time series as one long DataFrame, oldest first.

    Columns: consumer, time (UTC datetime), events_per_s (from the cumulative counter's
    difference to the previous point, so a missed publish does not hide events),
    dead_letters (cumulative), dead_per_s, no_query_per_s, e2a_ms_p50 / e2a_ms_p99 (of the
    events since the previous point), lag (when the workers publish it), model_version. A
    counter that goes down (the consumer restarted under the same id) restarts its rate.
    anchor_last: the window ends at the newest point instead of now (no consumer is live, so
    show the last minutes they ran rather than an empty window).
    """
    import pandas as pd

    now = time.time() if now is None else now
    frames = []
    series = read_series(client, prefix)
    if anchor_last and series:
        now = max(p["t"] for pts in series.values() for p in pts)
    for cid, pts in series.items():
        df = pd.DataFrame(pts)
        if window_s is not None:
            df = df[df["t"] >= now - window_s]
        if df.empty:
            continue
        df = df.sort_values("t").reset_index(drop=True)
        dt_s = df["t"].diff()
        for col, out in (
            ("events", "events_per_s_calc"),
            ("dead_letters", "dead_per_s"),
            ("no_query", "no_query_per_s"),
        ):
            if col in df:
                d = df[col].diff()
                df[out] = (d / dt_s).where((d >= 0) & (dt_s > 0))
        if "events_per_s_calc" in df:
            df["events_per_s"] = df["events_per_s_calc"].fillna(df.get("events_per_s"))
            df = df.drop(columns="events_per_s_calc")
        df["consumer"] = cid
        frames.append(df)
    if not frames:
        return pd.DataFrame(
            columns=["consumer", "time", "events_per_s", "dead_letters", "e2a_ms_p50", "e2a_ms_p99"]
        )
    out = pd.concat(frames, ignore_index=True)
    out["time"] = pd.to_datetime(out["t"], unit="s", utc=True)
    return out


def pivot(frame, column: str, resample: str = "2s", how: str = "sum"):
    """A wide frame (time x consumer) of one column, plus a fleet column ("all"), for charts.

    Points are bucketed to `resample` so that consumers publishing a few ms apart line up."""
    import pandas as pd

    if frame.empty or column not in frame or frame[column].isna().all():
        return pd.DataFrame()
    wide = frame.dropna(subset=[column]).pivot_table(
        index=pd.Grouper(key="time", freq=resample),
        columns="consumer",
        values=column,
        aggfunc="mean",
    )
    if wide.shape[1] > 1:
        wide["all"] = wide.sum(axis=1, min_count=1) if how == "sum" else wide.max(axis=1)
    wide.index = wide.index.tz_convert(None)
    return wide


def fleet(frame, column: str, how: str = "sum"):
    """One series for the whole fleet (sum, or max for latencies), or an empty Series."""
    import pandas as pd

    w = pivot(frame, column, how=how)
    if w.empty:
        return pd.Series(dtype=float)
    return w["all"] if "all" in w else w.iloc[:, 0]
