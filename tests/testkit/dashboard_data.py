"""Dashboard inputs as the product writes them: an engine registry over the fixture predictor,
user states stored by the stream's StateStore, consumer metrics published by a worker, click logs
and `bench peers` rows."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import numpy as np

HOLDOUT = {"P@1": 41.5, "P@3": 30.25, "P@5": 22.0, "nDCG@5": 44.0, "PSP@1": 20.0, "PSP@5": 25.5}


def make_registry(root: Path, predictor_dir: str, n: int = 2) -> list[str]:
    """An engine registry whose versions link the fixture's exported predictor; newest promoted.

    version.json carries the fields `astec retrain` records (held-out metrics, decision)."""
    from engine.registry import Registry

    reg = Registry(root)
    ids = []
    for i in range(n):
        st = reg.stage(f"2026010{i + 1}T000000.000000Z-000{i}")
        os.symlink(predictor_dir, st.path / "predictor")
        parent = {"parent": ids[-1], "metrics_current_on_holdout": {"P@1": 40.0}} if ids else {}
        reg.commit(
            st,
            {
                "kind": "astec",
                "promoted": True,
                "decision": f"decision {i}",
                "metrics_holdout": HOLDOUT,
                "holdout": {"points": 77},
                **parent,
            },
        )
        reg.promote(st.version)
        ids.append(st.version)
    return ids


def store_visits(settings, predictor, titles, user, k=4):
    from personalization.state import UserState
    from stream.state_store import StateStore, connect

    ids, scores, z = predictor.predict_with_features(titles, 5)
    states = [
        UserState.from_visit(
            f"{user}-e{i}", 1.7e9 + i, f"https://x/{i}", t, z[i], ids[i], scores[i]
        )
        for i, t in enumerate(titles)
    ]
    store = StateStore(connect(settings.redis.url.reveal()), settings.redis.key_prefix, k=k)
    store.append_batch([user] * len(states), states)
    return ids, scores


def publish_metrics(settings, cid, version, events, dead):
    from stream.consumer_metrics import ConsumerMetrics, publish
    from stream.state_store import connect

    m = ConsumerMetrics(cid, policy="top1", model_version=version)
    m.no_query = 2
    m.record_batch(
        events, dead, 1, 0.02, np.linspace(5, 50, events), {"predict": 0.5, "redis": 0.25}
    )
    publish(connect(settings.redis.url.reveal()), settings.redis.key_prefix, m)


class FakeClock:
    """Stands in for the `time` module inside stream.consumer_metrics: publishes at chosen
    instants."""

    def __init__(self, t0: float):
        self.t = t0

    def time(self):
        return self.t

    def monotonic(self):
        return self.t


def publish_series(settings, cid, points, t0, step=2.0, version="v1", series_len=None, m=None):
    """Publish one snapshot per (events, dead, latencies) tuple, `step` seconds apart, through
    stream.consumer_metrics.publish as a worker does (continuing `m` when given); returns the
    ConsumerMetrics."""
    from stream import consumer_metrics as sm
    from stream.state_store import connect

    clock = FakeClock(t0)
    client = connect(settings.redis.url.reveal())
    with mock.patch.object(sm, "time", clock):
        m = m or sm.ConsumerMetrics(cid, policy="gru", model_version=version)
        for events, dead, lat in points:
            m.record_batch(events, dead, 0, 0.01, np.asarray(lat, float), {"predict": 0.01})
            kw = {} if series_len is None else {"series_len": series_len}
            sm.publish(client, settings.redis.key_prefix, m, **kw)
            clock.t += step
    return m


def write_click_log(log_dir, user, titles, t0, clicked=(0,)):
    """Impressions (as `astec stream log-clicks` writes them) for events <user>-e<i>, and clicks."""
    from engine.clicklog import ClickLogWriter

    with ClickLogWriter(log_dir, "ad_impressions", writer_id="t") as w:
        w.write_many(
            [
                {
                    "event_id": f"{user}-e{i}",
                    "user_id": user,
                    "ts": t0 + i,
                    "query": f"shown-{i}",
                    "candidates": [f"shown-{i}", "other"],
                    "url": f"https://x/{i}",
                    "title": t,
                    "policy": "gru",
                }
                for i, t in enumerate(titles)
            ]
        )
    with ClickLogWriter(log_dir, "ad_clicks", writer_id="t") as w:
        w.write_many(
            [
                {
                    "event_id": f"{user}-e{i}",
                    "user_id": user,
                    "query": f"shown-{i}",
                    "clicked": True,
                    "ts": t0 + i + 0.5,
                }
                for i in clicked
            ]
        )


BENCH = [
    {
        "method": "astec",
        "P@1": 60.0,
        "P@3": 40.0,
        "P@5": 30.0,
        "nDCG@5": 55.0,
        "PSP@1": 30.0,
        "PSP@3": 33.0,
        "PSP@5": 36.0,
        "train_s": 100.0,
        "predict_s": 2.0,
        "peak_rss_mb": 900,
    },
    {
        "method": "parabel",
        "P@1": 58.0,
        "P@3": 38.0,
        "P@5": 29.0,
        "nDCG@5": 53.0,
        "PSP@1": 25.0,
        "PSP@3": 28.0,
        "PSP@5": 31.0,
        "train_s": 20.0,
        "predict_s": 1.0,
        "peak_rss_mb": 400,
    },
    {"method": "napkinxc-plt", "error": "exit status 1: boom"},
]
