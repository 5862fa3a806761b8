"""Scenarios: the traffic follows the structure a scenario states (transition kernel, fatigue,
session shape), shipped scenarios load by name, and a bad file is refused naming the field."""

import json
from dataclasses import replace

import numpy as np
import pytest
from click.testing import CliRunner

from engine.clicklog import read_log
from simulator.cli_simulate import simulate
from simulator.clickmodel import repeated_within
from simulator.dynamics import transition_kernel
from simulator.scenario import (
    ClickModel,
    Fatigue,
    IntentProcess,
    Scenario,
    ScenarioError,
    SessionShape,
    Transitions,
    load_scenario,
    scenario_names,
)
from simulator.traffic import (
    LogSettings,
    _start_ts,
    simulate_logs,
    simulate_sessions,
    with_scenario,
)
from simulator.world import generate_world, save_world


@pytest.fixture(scope="module")
def world():
    return generate_world(n_queries=2000, n_pages=3000, n_users=300, seed=7)


def _bound(p: float, n: int) -> float:
    """Six binomial standard deviations: a deviation this large has odds below 1e-8."""
    return 6.0 * np.sqrt(p * (1 - p) / n)


def test_transition_kernel_is_followed_at_the_stated_rates(world):
    tr = Transitions(share=1.0, weights=(0.7, 0.3), scope="topic", seed=3)
    sc = Scenario(intent=IntentProcess(persist=0.0, drift=0.3, transitions=tr))
    s = with_scenario(LogSettings(days=6, seed=4), sc)
    ss = simulate_sessions(world, np.random.default_rng(4), _start_ts(s.start), s)
    kern = transition_kernel(world, tr)
    # every change of intent inside a session is a kernel step from the intent before it
    same = ss.v_session[1:] == ss.v_session[:-1]
    a, b = ss.v_intent[:-1][same], ss.v_intent[1:][same]
    moved = a != b
    assert moved.sum() > 2000
    first = b[moved] == kern[a[moved], 0]
    second = b[moved] == kern[a[moved], 1]
    assert np.all(first | second)
    assert abs(first.mean() - 0.7) < _bound(0.7, int(moved.sum()))
    # redraws happen at the stated drift (a kernel step never stays put)
    assert abs(moved.mean() - 0.3) < _bound(0.3, len(moved))
    # a session that does not persist starts from a kernel step of the user's last intent
    o = np.lexsort((ss.start, ss.user))
    last_view = np.r_[np.flatnonzero(np.diff(ss.v_session)), len(ss.v_session) - 1]
    ends = ss.v_intent[last_view]
    follow = ss.user[o][1:] == ss.user[o][:-1]
    prev_end, nxt = ends[o][:-1][follow], ss.intent[o][1:][follow]
    step0 = nxt == kern[prev_end, 0]
    assert np.all(step0 | (nxt == kern[prev_end, 1]))
    assert abs(step0.mean() - 0.7) < _bound(0.7, len(step0))


def test_without_a_kernel_redraws_come_from_the_users_interests(world):
    s = with_scenario(LogSettings(days=4, seed=2), Scenario(intent=IntentProcess(drift=0.3)))
    ss = simulate_sessions(world, np.random.default_rng(2), _start_ts(s.start), s)
    vu = ss.user[ss.v_session]
    lo, hi = world.interest_indptr[vu], world.interest_indptr[vu + 1]
    own = np.zeros(len(vu), bool)
    for j in range(3):  # at most 3 interests per user
        idx = np.minimum(lo + j, len(world.interest_subtopic) - 1)
        own |= (lo + j < hi) & (world.interest_subtopic[idx] == ss.v_intent)
    assert own.all()


def _impressions(out):
    recs = list(read_log(out, "ad_impressions"))
    clicked = {c["event_id"] for c in read_log(out, "ad_clicks")}
    return (
        [r["event_id"] for r in recs],
        np.array([r["user_id"] for r in recs]),
        np.array([r["ts"] for r in recs]),
        np.array([r["query"] for r in recs]),
        np.array([r["event_id"] in clicked for r in recs]),
    )


def test_fatigue_lowers_a_repeated_querys_click_probability_by_its_factor(world, tmp_path):
    base = LogSettings(days=8, seed=9, search_clicks_per_day=1000)
    tired = Scenario(click=ClickModel(fatigue=Fatigue(window=5, factor=0.4)))
    simulate_logs(world, tmp_path / "plain", base)
    simulate_logs(world, tmp_path / "tired", with_scenario(base, tired))
    e0, user, ts, query, c0 = _impressions(tmp_path / "plain")
    e1, _, _, _, c1 = _impressions(tmp_path / "tired")
    assert e0 == e1  # the same traffic: fatigue draws nothing, clicks use the same uniforms
    _, qid = np.unique(query, return_inverse=True)
    _, uid = np.unique(user, return_inverse=True)
    rep = repeated_within(uid, ts, qid, 5)
    assert rep.sum() > 1000
    # a first showing clicks exactly as without fatigue; a repeat only where it did, at factor
    assert np.array_equal(c0[~rep], c1[~rep])
    assert not (c1[rep] & ~c0[rep]).any()
    n = int(c0[rep].sum())
    assert abs(c1[rep].sum() / n - 0.4) < _bound(0.4, n)
    sim = json.loads((tmp_path / "tired" / "simulation.json").read_text())
    assert sim["scenario"]["click"]["fatigue"] == {"window": 5, "factor": 0.4}


def test_new_inventory_exists_only_from_its_date(world, tmp_path):
    from simulator.dynamics import catalogue_days
    from simulator.scenario import Catalogue

    cat = Catalogue(new_share=0.2, new_from="2026-01-08", popularity_drift=0.1)
    s = with_scenario(
        LogSettings(days=6, seed=3, search_clicks_per_day=3000), Scenario(catalogue=cat)
    )
    simulate_logs(world, tmp_path / "l", s)
    days = catalogue_days(world, cat, 6, _start_ts(s.start))
    new = {world.page_url[p] for p in np.flatnonzero(days.page_from == 3)}
    assert 0.15 < len(new) / world.n_pages < 0.25
    t_new = _start_ts("2026-01-08")
    for kind in ("page_views", "search_clicks"):
        recs = list(read_log(tmp_path / "l", kind))
        before = [r["url"] in new for r in recs if r["ts"] < t_new]
        after = [r["url"] in new for r in recs if r["ts"] >= t_new]
        assert before and not any(before), kind
        assert np.mean(after) > 0.05, kind


def test_session_shape_pauses_and_sessions_minutes_apart(world):
    sh = SessionShape(mean_views=4.0, pause_share=0.2, follow_share=0.5, follow_gap_mean_s=120.0)
    s = with_scenario(LogSettings(days=4, seed=1), Scenario(sessions=sh))
    ss = simulate_sessions(world, np.random.default_rng(1), _start_ts(s.start), s)
    later = ss.v_pos > 0
    gap = np.diff(ss.v_ts)[later[1:]]
    long = gap > 1800
    assert abs(long.mean() - 0.2) < _bound(0.2, len(gap))
    assert abs((ss.v_pos == 0).sum() / len(ss.v_pos) - 1 / 4.0) < 0.02
    # half of the users' later sessions start within minutes of the previous one's end
    o = np.lexsort((ss.start, ss.user))
    last_view = np.r_[np.flatnonzero(np.diff(ss.v_session)), len(ss.v_session) - 1]
    end = ss.v_ts[last_view][o]
    nxt = ss.start[o]
    same = ss.user[o][1:] == ss.user[o][:-1]
    wait = (nxt[1:] - end[:-1])[same]
    assert (wait >= 0).all()
    soon = wait < 60 + 120 * 8  # the follow gap: 60 s + Exp(120 s)
    assert 0.45 < soon.mean() < 0.7


def test_shipped_scenarios_load_by_name_and_run(world, tmp_path):
    names = scenario_names()
    assert {"default", "transitions", "fatigue", "page-first", "short-memory"} <= set(names)
    assert len(names) >= 6
    assert load_scenario("default") == replace(
        Scenario(), description=load_scenario("default").description
    )
    for name in names:
        sc = load_scenario(name)
        out = tmp_path / name
        summary = simulate_logs(
            world, out, with_scenario(LogSettings(days=2, seed=1, search_clicks_per_day=500), sc)
        )
        assert summary["counts"]["ad_impressions"] > 0, name
        assert summary["scenario"]["name"] == name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[click.fatigue]\nfactor = 1.5\n",
            "bad.toml: click.fatigue.factor: must be in (0, 1], got 1.5",
        ),
        ("[intent]\npersits = 0.5\n", "bad.toml: intent.persits: unknown field"),
        ("[intent]\ndrift = 'high'\n", "bad.toml: intent.drift: expected float, got 'high'"),
        (
            "[intent.transitions]\nweights = [0.5, 0.2]\n",
            "bad.toml: intent.transitions.weights: must be positive and sum to 1",
        ),
        ("[sessions\n", "bad.toml: not valid toml"),
    ],
)
def test_a_bad_scenario_is_refused_naming_the_field(tmp_path, text, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(ScenarioError) as e:
        load_scenario(bad)
    assert message in str(e.value)


def test_cli_reads_the_scenario_and_records_it(world, tmp_path):
    wdir = tmp_path / "w"
    save_world(generate_world(n_queries=300, n_pages=500, n_users=40, seed=1), wdir)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"click": {"fatigue": {"factor": 1.5}}}))
    runner = CliRunner()
    r = runner.invoke(
        simulate,
        ["logs", "--world", str(wdir), "--out", str(tmp_path / "x"), "--scenario", str(bad)],
    )
    assert (
        r.exit_code == 2
        and "bad.json: click.fatigue.factor: must be in (0, 1], got 1.5" in r.output
    )
    r = runner.invoke(
        simulate,
        [
            "logs",
            "--world",
            str(wdir),
            "--out",
            str(tmp_path / "l"),
            "--days",
            "1",
            "--scenario",
            "transitions",
            "--drift",
            "0.2",
        ],
    )
    assert r.exit_code == 0, r.output
    sim = json.loads((tmp_path / "l" / "simulation.json").read_text())
    assert sim["scenario"]["name"] == "transitions"
    assert sim["scenario"]["intent"]["transitions"]["share"] == 0.8
    # the judge's intent chain reads the settings: the scenario's persist, the flag's drift
    assert sim["settings"]["persist"] == 0.5 and sim["settings"]["drift"] == 0.2
    # a world made with a scenario passes it on to the logs simulated on it
    w2 = tmp_path / "w2"
    r = runner.invoke(
        simulate,
        [
            "world",
            "--out",
            str(w2),
            "--queries",
            "300",
            "--pages",
            "500",
            "--users",
            "40",
            "--scenario",
            "fatigue",
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        simulate, ["logs", "--world", str(w2), "--out", str(tmp_path / "l2"), "--days", "1"]
    )
    assert r.exit_code == 0, r.output
    sim = json.loads((tmp_path / "l2" / "simulation.json").read_text())
    assert sim["scenario"]["name"] == "fatigue"
