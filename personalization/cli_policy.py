"""`astec personalize train|evaluate`.

MODELS_DIR is the engine's model registry (CURRENT -> versions/<id>/predictor/) or a predictor
directory; GRU versions live in their own registry, by default MODELS_DIR/gru (the directory
`astec stream run --policy gru --policy-model` takes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import click

from engine.cli_options import default_of
from personalization.train_config import TrainConfig

log = logging.getLogger(__name__)


def _d(name: str):
    """The default of TrainConfig's field `name`: the one home of every training default."""
    return default_of(TrainConfig, name)


def resolve_predictor_dir(models: Path) -> Path:
    """The exported predictor MODELS names: a registry root, a version or a predictor directory
    (engine.model_paths: one notion of model for every command)."""
    from engine.model_paths import ModelPathError, resolve_model

    try:
        where = resolve_model(models, prefer="predictor")
    except ModelPathError as e:
        raise click.UsageError(str(e)) from None
    if where.kind != "predictor":
        raise click.UsageError(
            f"{models}: a trained model, not an exported predictor: run `astec export --model "
            f"{models} --out DIR` (or give its registry)"
        )
    return where.path


def engine_now(models: Path) -> tuple[str, str]:
    """(version, label space) of the predictor MODELS names now, read from its manifest (the
    label names hashed when an older export did not record the fingerprint)."""
    from engine.manifest import label_space, read_manifest

    pdir = resolve_predictor_dir(models)
    data = read_manifest(pdir)
    space = data.get("label_space")
    if not space:
        cfg = json.loads((pdir / "predictor.json").read_text(encoding="utf-8"))
        space = label_space(json.loads((pdir / cfg["label_names"]).read_text(encoding="utf-8")))
    return str(data.get("version", "")), str(space)


def same_engine(manifest: dict, v) -> bool:
    """Whether a policy of this manifest was trained on query ids of the engine behind visit log
    `v`: the same label-space fingerprint, or (a policy that did not record one) the same
    engine version."""
    space = manifest.get("engine_label_space")
    if space:
        return bool(space == v.label_space)
    return bool(manifest.get("engine_version")) and manifest["engine_version"] == v.engine_version


def _load_visits(logs: Path, models: Path, k: int, progress: bool = True):
    from engine.predictor import Predictor
    from personalization.visits import load_visits

    pdir = resolve_predictor_dir(models)
    predictor = Predictor.load(pdir)
    t = time.perf_counter()
    v = load_visits(logs, predictor, k=k, progress=progress)
    click.echo(
        f"{v.n} visits of {len(v.user_ids)} users in {len(v.session_ids)} sessions; "
        f"{int((v.shown >= 0).sum())} impressions joined, {int(v.clicked.sum())} clicks; "
        f"{len(v.Z)} distinct pages through engine {predictor.version or pdir} "
        f"({time.perf_counter() - t:.1f}s)",
        err=True,
    )
    if v.session_gap_s is not None:
        click.echo(
            f"  no session ids in the logs: sessions cut at gaps over {v.session_gap_s:.0f}s "
            "(the valley of the users' gaps between views)",
            err=True,
        )
    for kind, r in v.reports.items():
        if r["corrupt"]:
            click.echo(
                f"  {kind}: {r['corrupt']} corrupt lines skipped, e.g. {r['examples'][:2]}",
                err=True,
            )
    return predictor, v


def _fmt_table(metrics: dict, cols: list[str]) -> str:
    width = [max(12, len(c)) + 1 for c in cols]
    head = f"{'policy':<17}" + "".join(f"{c:>{w}}" for c, w in zip(cols, width, strict=True))
    lines = [head, "-" * len(head)]
    for p, m in metrics.items():
        lines.append(
            f"{p:<17}"
            + "".join(f"{m.get(c, float('nan')):>{w}.4f}" for c, w in zip(cols, width, strict=True))
        )
    return "\n".join(lines)


def run_evaluation(
    policy, v, val_frac: float, truth, n_boot: int, progress: bool, oracle=None, judge=None
) -> dict:
    """Evaluate on the held-out sessions; returns the JSON-able report. Raises
    personalization.evaluate.OverlapError if the policy read any of those sessions."""
    from personalization.evaluate import (
        check_held_out,
        evaluate_policies,
        explore_scales,
        summarize,
        value_summary,
    )
    from personalization.train import split_rows

    train_rows, rows, t_split = split_rows(v, val_frac)
    check_held_out(policy.manifest, policy.version, t_split, val_frac)
    from personalization.baselines import fit_baselines

    strong = fit_baselines(policy, v, train_rows, policy.K, policy.ttl_s, policy.weights["log_pop"])
    scales = explore_scales(policy, v, train_rows, policy.weights["log_pop"], strong)
    res = evaluate_policies(
        policy,
        v,
        rows,
        policy.weights["log_pop"],
        policy.K,
        policy.ttl_s,
        truth,
        progress=progress,
        oracle=oracle,
        judge=judge,
        baselines=strong,
        scales=scales,
    )
    out = {
        "held_out_visits": res.n_visits,
        "cold_start_visits": res.n_cold,
        "split_ts": t_split,
        "policy_version": policy.version,
        "K": policy.K,
        "metrics": res.metrics,
        "lift": {},
        "baselines": strong.report,
        "explore_scales": scales,
    }
    for metric in ("intent_hit", "click_hit", "ips_ctr"):
        s = summarize(res, metric) if metric in res.per_visit["gru"] else {}
        if s:
            out["lift"][metric] = s
    out["value"] = value_summary(res, v, n_boot)
    g = res.per_visit["gru"]
    if "actual_ctr" in g:  # per held-out visit, for paired comparisons of two policies
        import numpy as np

        keys = [k for k in ("actual_ctr", "served_ctr") if k in g]
        out["gru_per_visit"] = {
            "user": np.asarray(res.users).tolist(),
            **{k: np.asarray(g[k], float).round(7).tolist() for k in keys},
        }
    return out


def _interval(ci) -> str:
    """A 95% interval [lo, hi] as lo..hi."""
    return f"{ci[0]:.4f}..{ci[1]:.4f}"


def print_value(val: dict) -> None:
    """The table that decides: actual CTR (simulator), SNIPS / DR (logs), support, ESS."""
    pol = val["policies"]
    judged = "actual_ctr" in pol["gru"]
    served = "served_ctr" in pol["gru"]
    head = (
        f"{'policy':<17}{'intent_hit':>11}"
        + (f"{'served_ctr':>11}" if served else "")
        + (f"{'actual_ctr':>11}{'95% CI':>18}" if judged else "")
        + f"{'SNIPS':>8}{'DR':>8}{'DR 95% CI':>18}{'support':>9}{'ESS':>8}"
        + (f"{'DR covers':>10}" if judged else "")
    )
    click.echo(head)
    click.echo("-" * len(head))
    order = sorted(pol, key=lambda p: -pol[p].get("actual_ctr", pol[p].get("dr", 0.0)))
    for p in order:
        r = pol[p]
        line = f"{p:<17}{r['intent_hit']:>11.4f}"
        if served:
            line += f"{r['served_ctr']:>11.4f}" if "served_ctr" in r else f"{'':>11}"
        if judged:
            line += f"{r['actual_ctr']:>11.4f}{_interval(r['actual_ctr_ci95']):>18}"
        if "dr" in r:
            line += (
                f"{r['snips']:>8.4f}{r['dr']:>8.4f}{_interval(r['dr_ci95']):>18}"
                f"{r['in_support']:>9.2f}{r['ess']:>8.0f}"
            )
            if judged:  # does the logs-only estimate's interval hold the simulator's truth?
                cov = r["dr_ci95"][0] <= r["actual_ctr"] <= r["dr_ci95"][1]
                line += f"{'yes' if cov else 'NO':>10}"
        click.echo(line)
    for b, s in val.get("vs_baselines", {}).items():
        click.echo(
            f"gru vs {b:<14} actual CTR {100 * s['lift']:+.1f}% "
            f"(95% CI {100 * s['lift_ci95'][0]:+.1f}% .. {100 * s['lift_ci95'][1]:+.1f}%), "
            f"difference {s['diff']:+.4f} ({s['diff_ci95'][0]:+.4f} .. "
            f"{s['diff_ci95'][1]:+.4f}), paired over {s['users']} users"
        )
    if "targets" in val:
        t = val["targets"]
        click.echo(
            f"targets: gru / best baseline ({val['best_baseline']}) = "
            f"{t['ctr_ratio_vs_best']:.3f} (>= 1.05), paired lower bound "
            f"{t['paired_lo_vs_best']:+.4f} (> 0), gap to bayes_window closed "
            f"{val.get('gap_closed', float('nan')):.2f} (>= 0.5), intent hit - sim_rank "
            f"{t['intent_hit_minus_sim_rank']:+.4f} (>= -0.01)"
        )
        if "served_ratio_vs_best" in t:
            click.echo(
                f"as served (actual_ctr column is the greedy choice's): gru / best baseline "
                f"({val['served_best_baseline']}) = {t['served_ratio_vs_best']:.3f}, paired "
                f"lower bound {t['served_paired_lo_vs_best']:+.4f}; headroom knows_intent / "
                f"best = {t.get('headroom', float('nan')):.3f}, bayes_window / best = "
                f"{t.get('window_headroom', float('nan')):.3f}, bayes_profile / best = "
                f"{t.get('profile_headroom', float('nan')):.3f}"
            )


def print_report(rep: dict) -> None:
    m = rep["metrics"]
    cols = [
        c
        for c in (
            "intent_hit",
            "intent_R@5",
            "intent_MRR",
            "click_hit",
            "click_R@5",
            "click_MRR",
            "ips_ctr",
            "intent_in_candidates",
        )
        if c in m["gru"]
    ]
    click.echo(
        f"held-out visits: {rep['held_out_visits']} (cold start: "
        f"{rep['cold_start_visits']}), K={rep['K']}, policy {rep['policy_version']}"
    )
    click.echo(_fmt_table(m, cols))
    for metric, s in rep["lift"].items():
        click.echo(
            f"{metric}: gru {s['gru']:.4f} vs best baseline {s['best_baseline']} "
            f"{s['baseline']:.4f}: lift {100 * s['lift']:+.1f}% "
            f"(95% CI {100 * s['ci95'][0]:+.1f}% .. {100 * s['ci95'][1]:+.1f}%, "
            f"bootstrap over {s['users']} users)"
        )


@click.group()
def personalize() -> None:
    """The GRU that picks one query per visit: train it from logs, evaluate it offline."""


@personalize.command()
@click.option(
    "--logs",
    "logs",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Click-log directory (page_views, ad_impressions, ad_clicks, search_clicks).",
)
@click.option(
    "--models",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Engine model registry root or predictor directory.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="GRU registry root (default: MODELS_DIR/gru).",
)
@click.option(
    "--K",
    "K",
    type=click.IntRange(1, 64),
    default=_d("K"),
    show_default=True,
    help="States in the window, current page included (at most the stream's state_k).",
)
@click.option(
    "--topk",
    type=click.IntRange(1, 100),
    default=_d("topk"),
    show_default=True,
    help="Predicted queries per page (must equal the stream's top_k).",
)
@click.option("--epochs", type=click.IntRange(1, 100), default=_d("epochs"), show_default=True)
@click.option(
    "--rows-per-epoch",
    type=click.IntRange(0, None),
    default=_d("rows_per_epoch"),
    show_default=True,
    help="Visits sampled per epoch (0 = all of the training period).",
)
@click.option(
    "--hidden",
    type=click.IntRange(4, 1024),
    default=_d("hidden"),
    show_default=True,
    help="GRU hidden size.",
)
@click.option(
    "--query-dim",
    type=click.IntRange(2, 1024),
    default=_d("query_dim"),
    show_default=True,
    help="Size of the projected query / user vectors.",
)
@click.option(
    "--val-frac",
    type=click.FloatRange(0.01, 0.9),
    default=_d("val_frac"),
    show_default=True,
    help="Share of the latest read sessions used for validation (split by time).",
)
@click.option(
    "--holdout",
    type=click.FloatRange(0.0, 0.9),
    default=_d("holdout"),
    show_default=True,
    help="Share of the latest sessions never read (neither trained nor validated "
    "on), for an honest `astec personalize evaluate --val-frac` <= this; "
    "0 = use all logs (production).",
)
@click.option(
    "--w-future",
    type=float,
    default=_d("w_future"),
    show_default=True,
    help="Weight of the next-pages listwise loss (browsing sequences).",
)
@click.option(
    "--w-ips",
    type=float,
    default=_d("w_ips"),
    show_default=True,
    help="Weight of the propensity-weighted listwise loss on clicked ads.",
)
@click.option(
    "--w-click",
    type=float,
    default=_d("w_click"),
    show_default=True,
    help="Weight of the pointwise click log-loss on every impression.",
)
@click.option(
    "--w-later-click",
    type=float,
    default=_d("w_later_click"),
    show_default=True,
    help="Weight of the click log-loss of candidates shown later in the session.",
)
@click.option(
    "--horizon",
    type=click.IntRange(1, 50),
    default=_d("future_horizon"),
    show_default=True,
    help="Next visits of the session read by the later-click and next-pages losses.",
)
@click.option(
    "--sim-dim",
    type=click.IntRange(0, 1024),
    default=_d("sim_dim"),
    show_default=True,
    help="Size of the query vectors behind the sim_* features (0 = off).",
)
@click.option(
    "--clusters",
    type=click.IntRange(-1, 4096),
    default=_d("clusters"),
    show_default=True,
    help="Query clusters behind the intent_mass / page_cluster_share features "
    "(co-occurrence in the engine's predictions): 0 = the count the logs' validation "
    "click likelihood picks (personalization.fit_filter), -1 = off.",
)
@click.option(
    "--init",
    type=click.Choice(["auto", "select", "sim_rank", "fitted", "intent", "random"]),
    default=_d("init"),
    show_default=True,
    help="The fixed ranking training starts from (it competes in the selection). fitted: a "
    "ridge logistic fit of the logged clicks on the hand features (ridge chosen by validation "
    "click likelihood); intent: intent_mass + the fitted intent_score_weight x score_current; "
    "sim_rank: the sim_rank ranking (both click-calibrated); select: the best by validation "
    "click likelihood of fitted, intent and fitted_to_intent (the fit with its ridge pulling "
    "towards the intent ranking); random: torch init. auto: select with the dr objective, "
    "sim_rank with losses.",
)
@click.option(
    "--objective",
    type=click.Choice(["auto", "losses", "dr"]),
    default=_d("objective"),
    show_default=True,
    help="dr: reward model on every logged impression, then the policy trained listwise for "
    "doubly-robust CTR, kept by validation DR value and promoted only when its DR lower bound "
    "beats the baselines and the current policy; needs logs of a logger exploring the "
    "policy's own candidates (astec simulate loop, the stream's served policy). losses: the "
    "weighted --w-* losses, epochs by their validation sum (for logs whose logger explored "
    "other candidates, e.g. `astec simulate logs`). auto: dr when the logger explored >= 90% "
    "of the policy's candidates, else losses.",
)
@click.option(
    "--reward-epochs",
    type=click.IntRange(0, 100),
    default=_d("reward_epochs"),
    show_default=True,
    help="Epochs of the reward model (objective dr).",
)
@click.option(
    "--recurrence/--no-recurrence",
    default=_d("recurrence"),
    show_default=True,
    help="--no-recurrence: the same policy without its GRU (same features, same training; its "
    "user vector is a learnt constant), to measure what the sequence model earns.",
)
@click.option(
    "--residual-sd",
    type=click.FloatRange(0.0, 1.0),
    default=_d("residual_sd"),
    show_default=True,
    help="sd of the scorer's residual output weights when training starts (0: the residual "
    "starts at zero). The selection's `start` is always the exact fitted ranking.",
)
@click.option(
    "--freeze-start/--train-start",
    default=_d("freeze_start"),
    show_default=True,
    help="Objective dr: keep the start's fitted linear ranking fixed and train only the "
    "residual (GRU, query vectors, scorer) on top of it.",
)
@click.option("--threads", type=click.IntRange(1, 64), default=_d("threads"), show_default=True)
@click.option(
    "--seed",
    "seeds",
    type=int,
    multiple=True,
    default=(_d("seed"),),
    show_default=True,
    help="Training seed; repeat it to train one version per seed on one read of the "
    "logs (each published, each judged for promotion on its own).",
)
@click.option(
    "--promote/--no-promote",
    default=True,
    show_default=True,
    help="Point the GRU registry's CURRENT at the new version when it earns it "
    "(objective dr: the validation DR lower bound of its gain over the best "
    "baseline and over the current policy is above zero).",
)
@click.option(
    "--keep",
    type=click.IntRange(1, 100),
    default=5,
    show_default=True,
    help="Versions kept in the GRU registry.",
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
def train(
    logs,
    models,
    out,
    K,
    topk,
    epochs,
    rows_per_epoch,
    hidden,
    query_dim,
    val_frac,
    holdout,
    w_future,
    w_ips,
    w_click,
    w_later_click,
    horizon,
    sim_dim,
    clusters,
    init,
    objective,
    reward_epochs,
    recurrence,
    residual_sd,
    freeze_start,
    threads,
    seeds,
    promote,
    keep,
    quiet,
):
    """Train the GRU policy from logs and publish it as a new version (promoted by default)."""
    import numpy as np

    predictor, v = _load_visits(logs, models, topk, progress=not quiet)
    cfg = TrainConfig(
        K=K,
        topk=topk,
        epochs=epochs,
        rows_per_epoch=rows_per_epoch,
        hidden=hidden,
        query_dim=query_dim,
        val_frac=val_frac,
        holdout=holdout,
        w_future=w_future,
        w_ips=w_ips,
        w_click=w_click,
        w_later_click=w_later_click,
        future_horizon=horizon,
        sim_dim=sim_dim,
        clusters=clusters,
        init=init,
        threads=threads,
        seed=seeds[0],
        objective=objective,
        reward_epochs=reward_epochs,
        recurrence=recurrence,
        residual_sd=residual_sd,
        freeze_start=freeze_start,
    )
    from personalization.train import resolve_auto

    cfg, why = resolve_auto(v, cfg)
    if why:
        click.echo(why, err=True)
    objective = cfg.objective
    rows = predictor.classifier_rows(np.arange(predictor.num_labels))
    root = out or (models / "gru")
    for seed in seeds:
        report = _train_one(
            v,
            rows,
            dataclasses.replace(cfg, seed=seed),
            root,
            logs,
            models,
            predictor,
            objective,
            promote,
            keep,
            quiet,
        )
    from personalization.evaluate import iso_time

    cut = report["holdout_split_ts"]
    click.echo(
        f"data read: sessions starting {iso_time(report['data_start_ts'])} .. "
        f"{iso_time(report['last_session_start_ts'])} (last visit "
        f"{iso_time(report['data_end_ts'])}); validation from "
        f"{iso_time(report['val_split_ts'])}; "
        + (
            f"sessions from {iso_time(cut)} not read ({report['unread_visits']} visits, "
            f"--holdout {holdout:g})"
            if cut is not None
            else "no holdout"
        )
    )


def _train_one(
    v, rows, cfg, root, logs, models, predictor, objective, promote, keep, quiet
) -> dict:
    """Train, publish (promoted only when it earns it) and report one version."""
    from personalization.train import publish, train_policy

    incumbent = None
    if objective == "dr" and (root / "CURRENT").is_file():
        from personalization.artifact import PolicyFileError
        from personalization.policy import GruPolicy

        try:
            incumbent = GruPolicy.load(root)
        except PolicyFileError as e:
            click.echo(
                f"current policy not comparable ({e}); judged against the baselines only", err=True
            )
        if incumbent is not None and not same_engine(incumbent.manifest, v):
            click.echo(
                f"current policy {incumbent.version} was trained on engine "
                f"{incumbent.manifest.get('engine_version') or '?'}, whose label ids are not "
                f"those of engine {v.engine_version}: judged against the baselines only",
                err=True,
            )
            incumbent = None
    try:
        weights, report = train_policy(v, rows, cfg, progress=not quiet, incumbent=incumbent)
    except ValueError as e:
        raise click.ClickException(f"{logs}: {e}") from e
    meta = {
        "engine_version": v.engine_version,
        "engine_label_space": v.label_space,
        "train": report,
        "logs": str(logs),
        "label_count": predictor.num_labels,
    }
    why = ""
    if promote and objective == "dr":
        from personalization.train import promotion_check

        promote, why = promotion_check(report)
    now_version, now_space = engine_now(models)
    if promote and now_space != v.label_space:
        # the engine registry promoted another label space while this trained: the stream
        # would refuse this policy beside it
        promote, why = (
            False,
            (
                f"engine {now_version} was promoted under {models} while this trained on engine "
                f"{v.engine_version}, and its label ids differ: train again on it"
            ),
        )
    version, path = publish(root, weights, cfg, meta, promote=promote, keep=keep)
    if objective == "dr":
        vs = report["val_vs_best_baseline"]
        l2 = report.get("start_l2")
        start = f"{report['init']}{f', ridge {l2:g}' if l2 is not None else ''}"
        kern = report.get("successor_kernel", 0)
        start += f", successor kernel {kern} per cluster" if kern else ", uniform successors"
        click.echo(
            f"GRU policy {version} -> {path} ({'promoted' if promote else 'not promoted'}"
            f"{': ' + why if why else ''}); {report['train_visits']} train / "
            f"{report['val_visits']} validation visits; start {start}; chosen "
            f"{report['chosen']}: "
            f"validation DR CTR {report['val_dr'][report['chosen']]:.4f} vs "
            f"{report['val_best_baseline']} {report['val_dr'][report['val_best_baseline']]:.4f}"
            f" (difference {vs['diff']:+.4f}, 95% CI {vs['diff_ci95'][0]:+.4f} .. "
            f"{vs['diff_ci95'][1]:+.4f}); {report['train_s']}s"
        )
    else:
        best = next(e for e in report["epochs"] if e["epoch"] == report["best_epoch"])
        click.echo(
            f"GRU policy {version} -> {path} ({'promoted' if promote else 'not promoted'}"
            f"{': ' + why if why else ''}); "
            f"{report['train_visits']} train / {report['val_visits']} validation visits, "
            f"best epoch {report['best_epoch']}: val click log-loss "
            f"{best['val_click_logloss']:.4f}, later-click log-loss "
            f"{best['val_later_click_logloss']:.4f}, next-pages CE {best['val_future_ce']:.4f}, "
            f"{report['train_s']}s"
        )
    return report


@personalize.command()
@click.option(
    "--logs",
    "logs",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Click-log directory (the same logs, split by time).",
)
@click.option(
    "--models",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="Engine model registry root or predictor directory.",
)
@click.option(
    "--policy",
    "policy_dirs",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    multiple=True,
    help="GRU policy version dir or registry root (default: MODELS_DIR/gru); "
    "repeat it to score several (e.g. training seeds) on one read of the logs, "
    "with a summary of the targets across them.",
)
@click.option(
    "--world",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Simulator world (default: from LOG_DIR/simulation.json).",
)
@click.option(
    "--val-frac",
    type=click.FloatRange(0.01, 0.9),
    default=0.2,
    show_default=True,
    help="Share of the latest sessions evaluated (the policy must have been trained "
    "with --holdout >= this).",
)
@click.option(
    "--bootstrap",
    "n_boot",
    type=click.IntRange(10, 100000),
    default=1000,
    show_default=True,
    help="Bootstrap resamples of users for the lift's 95% CI.",
)
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the report as JSON.",
)
@click.option(
    "--oracle",
    is_flag=True,
    help="Add reference rows from the simulator's true world (the Bayes-optimal "
    "intent hit on the same candidates); needs the world and truth files.",
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
def evaluate(logs, models, policy_dirs, world, val_frac, n_boot, json_out, oracle, quiet):
    """The GRU against every baseline on held-out sessions, by what it earns.

    On simulated logs: the actual expected CTR (the simulator's click model on the true intent)
    with paired, user-clustered bootstrap intervals against each baseline; on any logs: SNIPS and
    doubly-robust estimates, the share of choices inside the logger's support, and intent hit /
    Recall@5 / MRR as relevance guardrails."""
    from personalization.artifact import PolicyFileError
    from personalization.evaluate import OverlapError, check_held_out, load_truth
    from personalization.policy import GruPolicy

    policies = []
    for policy_dir in policy_dirs or (models / "gru",):
        try:
            policy = GruPolicy.load(policy_dir)
        except PolicyFileError as e:  # corrupt, or of an older format: retrain
            raise click.ClickException(
                f"{e}; retrain with `astec personalize train --holdout {val_frac:g}` to evaluate"
            ) from e
        try:  # fail before reading the logs if the policy records no data range at all
            check_held_out(policy.manifest, policy.version, None, val_frac)
        except OverlapError as e:
            raise click.ClickException(str(e)) from e
        policies.append(policy)
    k = int(policies[0].manifest.get("train", {}).get("config", {}).get("topk", 10))
    predictor, v = _load_visits(logs, models, k, progress=not quiet)
    for policy in policies:
        if policy.n_labels != predictor.num_labels:
            raise click.ClickException(
                f"policy {policy.path} was trained on {policy.n_labels} "
                f"labels, the engine has {predictor.num_labels}"
            )
    truth = load_truth(logs, predictor.label_names, world)
    if truth is None:
        click.echo("no truth/intents.jsonl: click-based metrics only", err=True)
    oracle_model = None
    if oracle:
        from personalization.evaluate import simulation_world
        from personalization.oracle import load_oracle

        wdir = world or simulation_world(logs)
        if truth is None or wdir is None:
            raise click.UsageError(
                "--oracle needs LOG_DIR/truth/intents.jsonl and the world "
                "(--world WORLD_DIR or LOG_DIR/simulation.json)"
            )
        oracle_model = load_oracle(wdir, logs, v.titles, v.user_ids, truth.label_subtopic)
    judge = None
    if truth is not None:
        from personalization.evaluate import simulation_world
        from personalization.value import load_judge

        wdir = world or simulation_world(logs)
        if wdir and (Path(wdir) / "pages.jsonl").is_file():
            judge = load_judge(wdir, logs, v, predictor.label_names)
    reps = []
    for policy in policies:
        try:
            rep = run_evaluation(
                policy,
                v,
                val_frac,
                truth,
                n_boot,
                progress=not quiet,
                oracle=oracle_model,
                judge=judge,
            )
        except OverlapError as e:
            raise click.ClickException(str(e)) from e
        if len(policies) > 1:
            click.echo(f"\n=== policy {policy.path}")
        print_report(rep)
        click.echo("")
        print_value(rep["value"])
        reps.append(rep)
    if len(reps) > 1 and all("targets" in r["value"] for r in reps):
        click.echo(
            "\ntargets per policy: ratio to best baseline / paired lower bound / gap "
            "closed / intent hit - sim_rank"
        )
        for pol, r in zip(policies, reps, strict=True):
            t, val = r["value"]["targets"], r["value"]
            click.echo(
                f"  {pol.version}: {t['ctr_ratio_vs_best']:.3f} ({val['best_baseline']}) "
                f"/ {t['paired_lo_vs_best']:+.4f} / {val.get('gap_closed', float('nan')):.2f}"
                f" / {t['intent_hit_minus_sim_rank']:+.4f}"
            )
    if json_out:
        json_out.write_text(json.dumps(reps[0] if len(reps) == 1 else reps, indent=1) + "\n")


def _register_bench() -> None:
    """`astec personalize bench` (personalization.cli_bench_policy)."""
    from personalization.cli_bench_policy import bench

    personalize.add_command(bench)


_register_bench()
