"""The closed loop: the served GRU explores over its own candidates, its logs carry what a
successor needs (propensity, every candidate with score and propensity), and the trainer reads
them back to train the next round's policy."""

import json

import numpy as np

from engine.clicklog import read_log


def test_loop_serves_logs_and_retrains(astec_predictor, tmp_path):
    from engine.predictor import Predictor
    from personalization.closed_loop import run_loop
    from personalization.train import TrainConfig, publish, train_policy
    from personalization.visits import load_visits
    from simulator.traffic import LogSettings, simulate_logs
    from simulator.world import save_world, world_from_dataset
    from testkit.paths import STREAM_DATA

    world = world_from_dataset(STREAM_DATA, n_users=80, seed=4)
    save_world(world, tmp_path / "world")
    simulate_logs(
        world, tmp_path / "logs", LogSettings(days=2, seed=4), world_dir=str(tmp_path / "world")
    )
    pred = Predictor.load(astec_predictor)
    v = load_visits(tmp_path / "logs", pred, progress=False)
    cfg = TrainConfig(epochs=1, reward_epochs=1, rows_per_epoch=3000, threads=1, objective="dr")
    w, rep = train_policy(v, pred.classifier_rows(np.arange(pred.num_labels)), cfg, progress=False)
    _, first = publish(tmp_path / "gru0", w, cfg, {"train": rep})
    res = run_loop(
        tmp_path / "world",
        astec_predictor,
        first,
        tmp_path / "loop",
        rounds=2,
        days=1,
        seed=1,
        train_cfg=cfg,
        echo=lambda *_: None,
    )
    assert [r["round"] for r in res] == [0, 1] and res[1]["policy"] == res[0]["next_policy"]
    for r in res:
        assert 0 < r["served_ctr"] < 0.3 and 0 < r["greedy_ctr"] < 0.3
        assert 0.02 < r["explored"] < 0.3  # epsilon 0.1 of the draws, minus repeats
    imps = list(read_log(tmp_path / "loop" / "logs", "ad_impressions"))
    assert imps and all(r["query"] in r["candidates"] for r in imps)
    for r in imps[:200]:
        assert (
            len(r["candidate_ids"])
            == len(r["candidate_propensities"])
            == len(r["candidate_scores"])
            == len(r["candidates"])
        )
        assert abs(sum(r["candidate_propensities"]) - 1) < 1e-3
        assert r["propensity"] == r["candidate_propensities"][r["candidates"].index(r["query"])]
    # the trainer reads the logged candidates and their propensities back
    lv = load_visits(tmp_path / "loop" / "logs", pred, progress=False)
    has = lv.shown >= 0
    assert has.mean() > 0.9 and lv.in_logged(np.flatnonzero(has), lv.shown[has]).all()
    assert lv.logged_prob is not None and np.isfinite(lv.logged_prob).mean() > 0.99
    assert json.loads((tmp_path / "loop" / "loop.json").read_text()) == res


def test_a_fixed_ranking_logs_over_the_grus_candidates(astec_predictor, tmp_path):
    """The first logs need no GRU: most_frequent serves over exactly the candidates the GRU
    ranks (the window's Astec top-k, not the world's true links), exploring, and --no-retrain
    leaves the logs for `astec personalize train`; truth records each view's intent."""
    from personalization.closed_loop import run_loop
    from personalization.window import WINDOW
    from simulator.world import save_world, world_from_dataset
    from testkit.paths import STREAM_DATA

    world = world_from_dataset(STREAM_DATA, n_users=60, seed=5)
    save_world(world, tmp_path / "world")
    res = run_loop(
        tmp_path / "world",
        astec_predictor,
        "most_frequent",
        tmp_path / "loop",
        rounds=2,
        days=1,
        epsilon=0.3,
        seed=2,
        echo=lambda *_: None,
        retrain=False,
    )
    assert [r["policy"] for r in res] == ["most_frequent"] * 2
    assert not (tmp_path / "loop" / "gru").exists()  # nothing trained
    assert all(0.1 < r["explored"] < 0.4 for r in res)
    imps = list(read_log(tmp_path / "loop" / "logs", "ad_impressions"))
    views = list(read_log(tmp_path / "loop" / "logs", "page_views"))
    assert len(imps) > 100 and {r["policy"] for r in imps} == {"most_frequent-explore"}
    # candidates: the union of the Astec top-10 of the user's last K pages, none else
    mean_c = np.mean([len(r["candidates"]) for r in imps])
    assert 10 <= mean_c <= 10 * WINDOW.K
    truth = [
        json.loads(x)
        for x in (tmp_path / "loop" / "logs" / "truth" / "intents.jsonl").read_text().splitlines()
    ]
    assert sum(len(t["intents"]) for t in truth) == len(views)
    sim = json.loads((tmp_path / "loop" / "logs" / "simulation.json").read_text())
    assert sim["settings"]["persist"] == 0.7 and sim["settings"]["epsilon"] == 0.3


def test_loop_follows_the_scenario_and_records_it(astec_predictor, tmp_path):
    """The same loop under ad fatigue serves the same traffic and choices (fatigue draws
    nothing) and earns less; its logs record the scenario for the evaluation's judge."""
    from personalization.closed_loop import run_loop
    from simulator.scenario import load_scenario
    from simulator.world import save_world, world_from_dataset
    from testkit.paths import STREAM_DATA

    save_world(world_from_dataset(STREAM_DATA, n_users=60, seed=5), tmp_path / "world")
    runs = {}
    for name in ("default", "fatigue"):
        runs[name] = run_loop(
            tmp_path / "world",
            astec_predictor,
            "most_frequent",
            tmp_path / name,
            rounds=1,
            days=2,
            seed=2,
            echo=lambda *_: None,
            retrain=False,
            scenario=load_scenario(name),
        )[0]
    plain, tired = runs["default"], runs["fatigue"]
    assert plain["visits"] == tired["visits"] and plain["explored"] == tired["explored"]
    factor = load_scenario("fatigue").click.fatigue.factor
    assert factor * plain["served_ctr"] < tired["served_ctr"] < plain["served_ctr"]
    sim = json.loads((tmp_path / "fatigue" / "logs" / "simulation.json").read_text())
    assert sim["scenario"]["name"] == "fatigue"
    assert sim["scenario"]["click"]["fatigue"]["window"] == 5
