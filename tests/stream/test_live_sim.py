"""Live simulation end to end on the real services: simulated users' page views -> worker -> ad
queries -> click model -> ad clicks -> `log-clicks` -> the durable click log, joined by event."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.clicklog import ad_outcomes
from stream.click_logger import run_click_logger
from stream.live_sim import run_simulation
from stream.model_handle import ModelHandle
from stream.policy_handle import Top1Policy
from stream.worker import StreamWorker
from testkit.corpora import KnnPredictor

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from simulator.world import generate_world, save_world

    d = tmp_path_factory.mktemp("world")
    w = generate_world(500, 1000, 100, seed=0)
    save_world(w, d)
    return w, d


def test_simulate_answers_every_view_and_log_clicks_joins_them(stream_settings, world, tmp_path):
    w, world_dir = world
    s = stream_settings
    # a real model of this world: page titles -> the queries that lead to them
    labels = [
        w.link_query[w.link_indptr[p] : w.link_indptr[p + 1]].tolist() for p in range(w.n_pages)
    ]
    keep = [p for p in range(w.n_pages) if labels[p]]
    knn = KnnPredictor(
        [w.page_title[p] for p in keep],
        [labels[p] for p in keep],
        w.query_text,
        version="knn-world",
    )
    worker = StreamWorker(
        s, ModelHandle.open(tmp_path, loader=lambda p: knn), Top1Policy(), "w-sim"
    )
    wt = threading.Thread(target=worker.run, daemon=True)
    wt.start()
    stop = threading.Event()
    counts = {}
    logger = threading.Thread(
        target=lambda: counts.update(run_click_logger(s, str(tmp_path / "log"), stop_event=stop)),
        daemon=True,
    )
    logger.start()
    try:
        rep = run_simulation(
            s, str(world_dir), rate=200, duration=2, seed=1, progress=False, warmup_s=1
        )
    finally:
        worker.stop()
        wt.join(30)
    assert rep["page_views"] == 600 and rep["ad_queries"] == 600 and rep["unanswered"] == 0
    assert rep["unknown_queries"] == 0  # every chosen query is a query of the world
    assert 0 < rep["clicks"] < 600
    assert rep["e2a_ms_p99"] is not None and rep["warmup_page_views"] == 200
    assert rep["warmup_e2a_ms_p99"] is not None  # the warm-up's latency is reported apart

    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the logger commits only after fsync
        rows = list(ad_outcomes(tmp_path / "log"))
        if len(rows) >= 600 and sum(r["clicked"] for r in rows) >= rep["clicks"]:
            break
        time.sleep(0.3)
    stop.set()
    logger.join(30)
    rows = list(ad_outcomes(tmp_path / "log"))
    assert len(rows) == 600 and len({r["event_id"] for r in rows}) == 600
    assert sum(r["clicked"] for r in rows) == rep["clicks"]
    r0 = rows[0]
    assert r0["model_version"] == "knn-world" and r0["policy"] == "top1" and r0["candidates"]
    assert np.isclose(r0["propensity"], 1.0)
    assert counts["ad_impressions"] == 600 and counts["ad_clicks"] == 600
