"""`astec simulate loop`: serve -> log -> retrain in the simulator, with the real CTR per round.

Each round simulates `days` of browsing sessions, serves every visit with the current GRU policy
over the candidates it ranks (the union of the window's Astec top-k), exploring as the stream
does (personalization.policy.explore: epsilon-mixture of its greedy choice and its softmax),
draws clicks from the click model, and writes the round's page views, ad impressions (shown
query, propensity, every candidate with its score and propensity), ad clicks and the truth file
into one growing log directory, which `personalization.train.train_policy` then reads to train
the next round's policy. So the logger here is the served policy itself, not a true-link
oracle; the first round serves the policy given (e.g. one trained on `astec simulate logs`).

Reported per round: the served traffic's exact expected CTR (exploration included) and that of
the greedy choices, from the click model; the policy chosen by training and its validation DR.
A retrained policy serves the next round only when it passes `astec personalize train`'s
promotion gate (objective dr: the 95% lower bound of its validation DR gain over the best
baseline and over the policy served now is above zero); otherwise the current one keeps serving.
The first round may serve a fixed ranking (LOGGERS) instead of a GRU.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import click
import numpy as np

from engine.clicklog import ClickLogWriter
from simulator.cli_simulate import resolve_scenario, scenario_option
from simulator.clickmodel import ClickParams, click_probability, fatigue
from simulator.scenario import Scenario
from simulator.traffic import (
    DAY,
    LogSettings,
    _start_ts,
    settings_record,
    simulate_sessions,
    with_scenario,
)

log = logging.getLogger(__name__)


LOGGERS = ("top1", "most_frequent")  # fixed rankings that can serve a round instead of a GRU


class BaselineLogger:
    """A fixed ranking (personalization.evaluate.baseline_keys) over exactly the candidates the
    GRU ranks (the window's Astec top-k), served with the same exploration: the logger for the
    first logs a GRU learns from, when there is no policy yet. Not a true-link oracle: it knows
    only what the engine predicts for the user's pages."""

    def __init__(self, name: str, n_labels: int, K: int):
        if name not in LOGGERS:
            raise ValueError(f"unknown logger {name!r}: expected one of {', '.join(LOGGERS)}")
        self.name, self.K, self.version = name, K, name
        self.weights = {"log_pop": np.zeros(n_labels, np.float32), "sim_table": None}
        self.weights["sim_norm"] = None

    def logits(self, b) -> np.ndarray:
        from personalization.evaluate import baseline_keys

        return baseline_keys(b)[self.name].astype(np.float32)


def _serve_round(
    world,
    predictor,
    policy,
    ss,
    k: int,
    epsilon: float,
    temperature: float,
    rng,
    ttl_s: float = 30 * 86400.0,
    batch: int = 2048,
):
    """Serve every view of sessions `ss` (batched); returns per view (in ss order): shown query
    (world id), propensity, greedy query, the candidate (world ids, scores, propensities)."""
    from personalization.features import F, build_batch, cluster_lookup
    from personalization.policy import explore

    V = len(ss.v_page)
    names = predictor.label_names
    world_query = {t: i for i, t in enumerate(world.query_text)}
    q_of_label = np.array([world_query.get(n, -1) for n in names], np.int64)
    pages, inv = np.unique(ss.v_page, return_inverse=True)
    IDS = np.full((len(pages), k), -1, np.int64)
    SC = np.zeros((len(pages), k), np.float32)
    Z = np.zeros((len(pages), predictor.dim), np.float32)
    for a in range(0, len(pages), 2048):
        ids, sc, z = predictor.predict_with_features(
            [world.page_title[p] for p in pages[a : a + 2048].tolist()], k
        )
        IDS[a : a + 2048, : ids.shape[1]] = ids
        SC[a : a + 2048, : sc.shape[1]] = sc
        Z[a : a + 2048] = z
    user = ss.user[ss.v_session]
    order = np.lexsort((ss.v_ts, user))  # windows: the user's last K views
    K = policy.K
    out_shown = np.full(V, -1, np.int64)
    out_prop = np.ones(V)
    out_greedy = np.full(V, -1, np.int64)
    cands = [None] * V
    w = policy.weights
    # a GRU reads what it showed at the window's earlier views: each user's views are served in
    # order (one step per view rank, all users at once); a fixed ranking reads none of it and is
    # served in plain batches (step 0 for every view: the logs of a seed stay as they were)
    u_o = user[order]
    first = np.r_[True, u_o[1:] != u_o[:-1]]
    at = np.arange(V)
    reads_shown = not isinstance(policy, BaselineLogger)
    step = at - np.maximum.accumulate(np.where(first, at, 0)) if reads_shown else 0 * at
    shown_lab = np.full(V, -1, np.int64)  # per position in `order`: the label id shown there
    chunks = [
        sel[a : a + batch]
        for s in range(int(step.max()) + 1 if V else 0)
        for sel in [np.flatnonzero(step == s)]
        for a in range(0, len(sel), batch)
    ]
    for pos in chunks:
        r = order[pos]
        idx = pos[:, None] - np.arange(K - 1, -1, -1)[None, :]
        safe = order[np.maximum(idx, 0)]
        mask = (
            (idx >= 0)
            & (user[safe] == user[r][:, None])
            & (ss.v_ts[r][:, None] - ss.v_ts[safe] <= ttl_s)
        )
        mask = np.flip(np.cumprod(np.flip(mask, 1), axis=1), 1).astype(bool)
        pg = inv[safe]
        b = build_batch(
            Z[pg] * mask[..., None],
            np.where(mask[..., None], IDS[pg], -1),
            np.where(mask[..., None], SC[pg], 0.0),
            mask,
            w["log_pop"],
            ss.v_ts[safe],
            w["sim_table"],
            w["sim_norm"],
            cluster_lookup(w),
            np.where(mask, shown_lab[np.maximum(idx, 0)], -1),
        )
        logit = policy.logits(b)
        cold = mask.sum(1) <= 1  # the cold-start rule: the page's Astec scores as log-odds
        logit[cold] = np.where(
            b.cand_mask[cold], 8.0 * b.feats[cold][..., F["score_current"]], -np.inf
        )
        has = b.cand_mask.any(1)
        m = b.cand_mask.copy()
        m[~has, 0] = True
        logit[~has, 0] = 0.0
        col, prop, probs = explore(logit, m, epsilon, temperature, rng)
        R = np.arange(len(r))
        top = np.argmax(np.where(m, logit, -np.inf), 1)
        lab = np.where(has, b.cand_ids[R, col], -1)
        shown_lab[pos] = lab
        out_shown[r] = np.where(lab >= 0, q_of_label[np.maximum(lab, 0)], -1)
        out_prop[r] = prop[R, col]
        gl = np.where(has, b.cand_ids[R, top], -1)
        out_greedy[r] = np.where(gl >= 0, q_of_label[np.maximum(gl, 0)], -1)
        for j, i in enumerate(r.tolist()):  # the log record needs Python lists per event
            cm = b.cand_mask[j]
            cands[i] = (b.cand_ids[j][cm], probs[j][cm], prop[j][cm])
    return out_shown, out_prop, out_greedy, cands


def _write_round(
    out: Path,
    world,
    names,
    ss,
    shown,
    prop,
    cands,
    clicked,
    rng,
    sid_prefix,
    policy_name: str,
    version: str,
) -> None:
    """The round's logs in the formats `astec simulate logs` writes (plus candidate scores
    and propensities on each impression)."""
    qt, titles, urls = world.query_text, world.page_title, world.page_url
    order = np.argsort(ss.v_ts, kind="stable")
    uid = [world.user_id(u) for u in ss.user.tolist()]
    sid = [f"{sid_prefix}{i:07d}" for i in range(len(ss.user))]
    vs, vp, vpage, vts = (
        ss.v_session.tolist(),
        ss.v_pos.tolist(),
        ss.v_page.tolist(),
        ss.v_ts.tolist(),
    )

    def eid(p, i):
        return f"{p}-{sid[vs[i]]}-{vp[i]:03d}"

    with ClickLogWriter(out, "page_views", writer_id=sid_prefix) as wr:
        wr.write_many(
            [
                {
                    "event_id": eid("pv", i),
                    "user_id": uid[vs[i]],
                    "session_id": sid[vs[i]],
                    "ts": round(vts[i], 3),
                    "url": urls[vpage[i]],
                    "title": titles[vpage[i]],
                }
                for i in order.tolist()
            ]
        )
    with ClickLogWriter(out, "ad_impressions", writer_id=sid_prefix) as wr:
        recs = []
        for i in order.tolist():
            if shown[i] < 0:
                continue
            ci, cs, cp = cands[i]
            recs.append(
                {
                    "event_id": eid("ad", i),
                    "user_id": uid[vs[i]],
                    "session_id": sid[vs[i]],
                    "ts": round(vts[i] + 1.0, 3),
                    "url": urls[vpage[i]],
                    "title": titles[vpage[i]],
                    "query": qt[shown[i]],
                    "candidates": [names[j] for j in ci.tolist()],
                    "candidate_ids": ci.tolist(),
                    "candidate_scores": np.round(cs.astype(np.float64), 6).tolist(),
                    "candidate_propensities": np.round(cp.astype(np.float64), 6).tolist(),
                    "propensity": float(np.round(np.float64(prop[i]), 6)),
                    "policy": policy_name,
                    "model_version": version,
                }
            )
        wr.write_many(recs)
    c_idx = order[clicked[order]]
    with ClickLogWriter(out, "ad_clicks", writer_id=sid_prefix) as wr:
        wr.write_many(
            [
                {
                    "event_id": eid("ad", i),
                    "user_id": uid[vs[i]],
                    "query": qt[shown[i]],
                    "clicked": True,
                    "ts": round(vts[i] + 1.5 + float(rng.exponential(10.0)), 3),
                }
                for i in c_idx.tolist()
            ]
        )
    (out / "truth").mkdir(parents=True, exist_ok=True)
    bounds = np.concatenate([[0], np.cumsum(np.bincount(ss.v_session, minlength=len(ss.user)))])
    with open(out / "truth" / "intents.jsonl", "a", encoding="utf-8") as f:
        for k in range(len(ss.user)):
            a, b = int(bounds[k]), int(bounds[k + 1])
            f.write(
                json.dumps(
                    {
                        "session_id": sid[k],
                        "user_id": uid[k],
                        "subtopic": int(ss.intent[k]),
                        "topic": int(world.subtopic_topic[ss.intent[k]]),
                        "start_ts": round(vts[a], 3),
                        "intents": ss.v_intent[a:b].tolist(),
                    }
                )
                + "\n"
            )


def run_loop(
    world_dir: str | Path,
    models: str | Path,
    policy_dir: str | Path,
    out: str | Path,
    rounds: int = 3,
    days: int = 3,
    start: str = "2026-02-01",
    epsilon: float | None = None,
    temperature: float | None = None,
    seed: int = 0,
    train_cfg=None,
    progress: bool = False,
    echo=print,
    retrain: bool = True,
    scenario: Scenario | None = None,
) -> list[dict]:
    """Run `rounds` of serve -> log -> retrain; returns one record per round. `policy_dir` is a
    GRU policy or one of LOGGERS (a fixed ranking, exploring over the GRU's candidates);
    without `retrain` every round serves it (logs for a first GRU). The traffic follows
    `scenario` (default: the world's, simulator.scenario.world_scenario)."""
    from engine.predictor import Predictor
    from personalization import policy as P
    from personalization.cli_policy import resolve_predictor_dir
    from personalization.policy import GruPolicy
    from personalization.train import TrainConfig, promotion_check, publish, train_policy
    from personalization.visits import load_visits
    from personalization.window import WINDOW
    from simulator.scenario import world_scenario
    from simulator.world import load_world

    world = load_world(world_dir)
    sc = scenario if scenario is not None else world_scenario(world_dir)
    out = Path(out)
    if (out / "loop.json").exists():
        raise FileExistsError(f"{out}: already holds a loop run (loop.json); choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    predictor = Predictor.load(resolve_predictor_dir(Path(models)))
    names = predictor.label_names
    eps = P.EPSILON if epsilon is None else epsilon
    temp = P.TEMPERATURE if temperature is None else temperature
    if str(policy_dir) in LOGGERS:
        policy: GruPolicy | BaselineLogger = BaselineLogger(
            str(policy_dir), predictor.num_labels, WINDOW.K
        )
    else:
        policy = GruPolicy.load(policy_dir)
    rng = np.random.default_rng(seed)
    cfg = train_cfg or TrainConfig(
        K=policy.K, seed=seed, rows_per_epoch=30_000, epochs=2, objective="dr"
    )
    cfg = replace(cfg, K=policy.K)
    logs, registry = out / "logs", out / "gru"
    sim_settings = with_scenario(LogSettings(seed=seed, epsilon=eps), sc)
    params = ClickParams.from_scenario(sc.click)
    fat = sc.click.fatigue
    sim = {
        "world": str(Path(world_dir).resolve()),
        "settings": {**settings_record(sim_settings), "loop": True},
        "click_model": params.to_dict(),
        "scenario": sc.to_dict(),
    }
    logs.mkdir(exist_ok=True)
    (logs / "simulation.json").write_text(json.dumps(sim, indent=1) + "\n")
    t0 = _start_ts(start)
    results = []
    last_intent = None  # each user's intent carries over from round to round
    for rnd in range(rounds):
        clock = time.perf_counter()
        ss = simulate_sessions(
            world,
            rng,
            t0 + rnd * days * DAY,
            replace(sim_settings, days=days),
            last_intent,
            origin=t0,
        )
        last_intent = ss.last_intent
        shown, prop, greedy, cands = _serve_round(world, predictor, policy, ss, 10, eps, temp, rng)
        intent = ss.v_intent
        p_shown = click_probability(shown, intent, ss.v_page, world=world, params=params)
        p_greedy = click_probability(greedy, intent, ss.v_page, world=world, params=params)
        if fat.window > 0:  # each sequence tires its users by its own repeats (within the round)
            vu = ss.user[ss.v_session]
            p_shown = p_shown * fatigue(vu, ss.v_ts, shown, fat.window, fat.factor)
            p_greedy = p_greedy * fatigue(vu, ss.v_ts, greedy, fat.window, fat.factor)
        clicked = rng.random(len(shown)) < p_shown
        _write_round(
            logs,
            world,
            names,
            ss,
            shown,
            prop,
            cands,
            clicked,
            rng,
            f"r{rnd}s",
            "gru-explore" if isinstance(policy, GruPolicy) else f"{policy.name}-explore",
            str(policy.version),
        )
        rec = {
            "round": rnd,
            "policy": str(policy.version),
            "visits": len(shown),
            "served_ctr": float(p_shown.mean()),
            "greedy_ctr": float(p_greedy.mean()),
            "clicks": int(clicked.sum()),
            "explored": float((shown != greedy).mean()),
        }
        if not retrain:
            rec["seconds"] = round(time.perf_counter() - clock, 1)
            echo(json.dumps(rec))
            results.append(rec)
            continue
        # retrain on everything the loop has logged (the policy's own explored traffic)
        v = load_visits(logs, predictor, k=cfg.topk, progress=progress)
        rows = predictor.classifier_rows(np.arange(predictor.num_labels))
        incumbent = policy if isinstance(policy, GruPolicy) else None
        weights, report = train_policy(v, rows, cfg, progress=progress, incumbent=incumbent)
        version, path = publish(
            registry, weights, cfg, {"train": report, "engine_version": v.engine_version}
        )
        # serve the retrained policy only when it earns it (the promotion gate of `astec
        # personalize train`): its validation DR gain over the best baseline and the policy
        # served now has a 95% lower bound above zero; else the current one keeps serving
        ok, why = promotion_check(report) if cfg.objective == "dr" else (True, "")
        rec.update(
            trained=version,
            next_policy=version if ok else str(policy.version),
            promoted=ok,
            why_not=why,
            chosen=report.get("chosen"),
            val_dr=report.get("val_dr", {}).get(report.get("chosen")),
            seconds=round(time.perf_counter() - clock, 1),
        )
        echo(json.dumps(rec))
        results.append(rec)
        if ok:
            policy = GruPolicy.load(path)
    (out / "loop.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


@click.command("loop")
@click.option("--world", "world_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--models",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Engine model registry root or predictor directory.",
)
@click.option(
    "--policy",
    "policy_dir",
    required=True,
    help="The GRU policy served in the first round (version dir or registry root), or a fixed "
    f"ranking over the same candidates ({', '.join(LOGGERS)}) as the first logger.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="New directory: the loop's logs (OUT/logs) and policies (OUT/gru).",
)
@click.option("--rounds", default=3, show_default=True)
@click.option("--days", default=3, show_default=True, help="Simulated days per round.")
@click.option(
    "--epsilon",
    default=None,
    type=float,
    help="Exploration share (default: personalization.policy.EPSILON).",
)
@click.option(
    "--temperature",
    default=None,
    type=float,
    help="Softmax temperature of the exploration (default: TEMPERATURE).",
)
@click.option(
    "--objective",
    type=click.Choice(["dr", "losses"]),
    default="dr",
    show_default=True,
    help="Trainer of each round (the loop's logs explore the policy's own candidates, "
    "which the dr objective needs).",
)
@click.option(
    "--init",
    type=click.Choice(["select", "fitted", "intent", "sim_rank"]),
    default="select",
    show_default=True,
    help="Start of each retrain (astec personalize train --init): the loop's logs explore "
    "over the policy's own candidates, so a fit of their clicks is the natural start; select "
    "keeps the fitted, the intent or the fitted-towards-intent start, by validation click "
    "likelihood.",
)
@click.option("--epochs", default=2, show_default=True, help="Policy epochs per retrain.")
@click.option("--rows-per-epoch", default=30_000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@scenario_option(" Default: the world's (world.json), else the default scenario.")
@click.option(
    "--retrain/--no-retrain",
    default=True,
    show_default=True,
    help="Retrain after each round; --no-retrain serves --policy every round (logs to train a "
    "first GRU on: astec personalize train --logs OUT/logs).",
)
def loop_cmd(
    world_dir,
    models,
    policy_dir,
    out,
    rounds,
    days,
    epsilon,
    temperature,
    objective,
    init,
    epochs,
    rows_per_epoch,
    seed,
    scenario,
    retrain,
):
    """Closed loop: serve (exploring) -> log -> retrain, with the actual CTR of each round."""
    from personalization.train import TrainConfig

    sc = resolve_scenario(scenario, world_dir)

    if policy_dir not in LOGGERS and not Path(policy_dir).is_dir():
        raise click.BadParameter(
            f"{policy_dir}: no such directory; give a GRU policy version or registry, or one of "
            f"{', '.join(LOGGERS)}",
            param_hint="--policy",
        )

    cfg = TrainConfig(
        seed=seed, epochs=epochs, rows_per_epoch=rows_per_epoch, objective=objective, init=init
    )
    res = run_loop(
        world_dir,
        models,
        policy_dir,
        out,
        rounds=rounds,
        days=days,
        epsilon=epsilon,
        temperature=temperature,
        seed=seed,
        train_cfg=cfg,
        echo=click.echo,
        retrain=retrain,
        scenario=sc,
    )
    click.echo(
        f"{'round':>5} {'policy':<28} {'served CTR':>10} {'greedy CTR':>10} {'visits':>7}  next"
    )
    for r in res:
        nxt = "" if "promoted" not in r else ("promoted" if r["promoted"] else r["why_not"])
        click.echo(
            f"{r['round']:>5} {r['policy']:<28} {r['served_ctr']:>10.4f} "
            f"{r['greedy_ctr']:>10.4f} {r['visits']:>7}  {nxt}"
        )
