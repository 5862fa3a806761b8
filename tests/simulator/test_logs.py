"""Simulated logs: readable by the click-log reader, intents persist, and history decides the
best query."""

import json

import numpy as np
import pytest

from engine.clicklog import ReadReport, ad_outcomes, partitions, read_log
from simulator.clickmodel import click_probability
from simulator.traffic import (
    LogSettings,
    _start_ts,
    logging_policy,
    simulate_logs,
    simulate_sessions,
)
from simulator.world import generate_world


@pytest.fixture(scope="module")
def world():
    return generate_world(n_queries=3000, n_pages=5000, n_users=400, seed=5)


@pytest.fixture(scope="module")
def logs(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("logs")
    summary = simulate_logs(world, out, LogSettings(days=2, seed=1, search_clicks_per_day=20_000))
    return out, summary


def test_logs_are_valid_partitioned_and_time_ordered(logs):
    out, summary = logs
    for kind in ["search_clicks", "page_views", "ad_impressions", "ad_clicks"]:
        rep = ReadReport(kind)
        ts = [r["ts"] for r in read_log(out, kind, rep)]
        assert rep.corrupt == 0 and rep.records == summary["counts"][kind] > 0, kind
        assert ts == sorted(ts), kind
        assert partitions(out, kind) == ["2026-01-05", "2026-01-06"], kind
    views = list(read_log(out, "page_views"))
    assert not {"topic", "subtopic", "intent"} & set(views[0])  # ground truth stays out


def test_search_clicks_are_zipfian_over_pages(logs):
    out, _ = logs
    counts: dict[str, int] = {}
    for r in read_log(out, "search_clicks"):
        counts[r["url"]] = counts.get(r["url"], 0) + 1
    f = np.sort(np.array(list(counts.values())))[::-1]
    assert f[0] > 20 * np.median(f)


def test_sessions_follow_a_persistent_latent_intent(world, logs):
    out, summary = logs
    truth = [
        json.loads(line) for line in (out / "truth" / "intents.jsonl").read_text().splitlines()
    ]
    assert len(truth) == summary["counts"]["sessions"]
    sub_of_url = dict(zip(world.page_url, world.page_subtopic.tolist(), strict=True))
    intents = {t["session_id"]: t["intents"] for t in truth}
    by_session: dict[str, list[bool]] = {}
    for v in read_log(out, "page_views"):  # in time order: the n-th view of its session
        h = by_session.setdefault(v["session_id"], [])
        h.append(sub_of_url[v["url"]] == intents[v["session_id"]][len(h)])
    hits = np.concatenate([np.array(h) for h in by_session.values()])
    assert 0.55 < hits.mean() < 0.8  # on-intent most of the time, with off-intent pages
    long = [h for h in by_session.values() if len(h) >= 4]
    assert long and np.mean([np.mean(h) for h in long]) > 0.5
    # the intent a session starts with is the one its first view follows
    assert all(t["intents"][0] == t["subtopic"] for t in truth)


def test_best_query_depends_on_history(world):
    s = LogSettings(days=2, seed=2)
    rng = np.random.default_rng(2)
    ss = simulate_sessions(world, rng, _start_ts(s.start), s)
    cand, _, _ = logging_policy(world, ss, rng, s)
    intent = ss.v_intent
    p = np.stack(
        [
            click_probability(cand[:, j], intent, ss.v_page, world=world)
            for j in range(cand.shape[1])
        ],
        axis=1,
    )
    top_now = p[:, 0]  # the current page's strongest query
    best = p.max(axis=1)  # the best query among the recent pages' queries
    off = ~ss.v_on
    assert best[off].mean() > 1.5 * top_now[off].mean()
    assert best.mean() > 1.15 * top_now.mean()
    # relevance to the latent intent dominates relevance to the page just viewed
    q = world.link_query[world.link_indptr[ss.v_page]]
    on_q = click_probability(q, world.query_subtopic[q], ss.v_page, world=world)
    other = (world.query_subtopic[q] + 1) % world.n_subtopics
    off_q = click_probability(q, other, ss.v_page, world=world)
    assert (on_q > off_q).all()


def test_logged_ad_clicks_follow_the_click_model(world, logs):
    out, _ = logs
    truth = {
        t["session_id"]: t["intents"]
        for t in map(json.loads, (out / "truth" / "intents.jsonl").read_text().splitlines())
    }
    q_sub = dict(zip(world.query_text, world.query_subtopic.tolist(), strict=True))
    rel_l, clicked_l = [], []
    for o in ad_outcomes(out):
        assert 0 < o["propensity"] <= 1 and o["query"] in o["candidates"]
        pos = int(o["event_id"].rsplit("-", 1)[1])  # ad-<session>-<view>: the view's intent
        rel_l.append(q_sub[o["query"]] == truth[o["session_id"]][pos])
        clicked_l.append(o["clicked"])
    rel, clicked = np.array(rel_l), np.array(clicked_l)
    assert clicked[rel].mean() > 2 * clicked[~rel].mean()


def test_logs_refuse_to_overwrite_and_are_deterministic(world, logs, tmp_path):
    out, _ = logs
    with pytest.raises(FileExistsError):
        simulate_logs(world, out, LogSettings(days=2))
    s = LogSettings(days=1, seed=9, search_clicks_per_day=2000)
    simulate_logs(world, tmp_path / "a", s)
    simulate_logs(world, tmp_path / "b", s)
    for kind in ["search_clicks", "ad_impressions"]:
        fa = sorted((tmp_path / "a" / kind).rglob("*.jsonl"))
        fb = sorted((tmp_path / "b" / kind).rglob("*.jsonl"))
        assert [f.read_bytes() for f in fa] == [f.read_bytes() for f in fb]


def test_a_second_writer_into_the_same_directory_is_refused_while_the_first_writes(world, tmp_path):
    """Two `astec simulate logs --out D` started together: the second is refused at once,
    instead of appending a second copy of every record to the first's files."""
    import fcntl

    out = tmp_path / "d"
    out.mkdir()
    with open(out / ".simulate.lock", "a") as held:  # the first writer, mid-run
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FileExistsError, match="another simulation is writing"):
            simulate_logs(world, out, LogSettings(days=1, search_clicks_per_day=2000))
    assert not any(p.suffix == ".jsonl" for p in out.rglob("*"))
    summary = simulate_logs(world, out, LogSettings(days=1, search_clicks_per_day=2000))
    assert summary["counts"]["search_clicks"] > 0
