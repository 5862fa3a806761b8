"""`astec personalize bench`: the documented pipeline (docs/personalization.md, "The commands")
on N world seeds x M training seeds of one scenario, and one table of what each policy earns.

Every step is the `astec` command a user runs, in a subprocess, its output kept in the step's
log beside its result; a step whose result exists is not run again, so an interrupted sweep
resumes. The table: per policy, the served CTR (at the stream's exploration) and the greedy CTR
averaged over the runs; per run, the GRU's served CTR over the best baseline's (session-kNN and
the other strong baselines included) with the paired, user-clustered 95% lower bound of the
difference, the knows_intent ceiling and the headroom (ceiling / best baseline, greedy), and
bayes_window / best baseline: knows_intent sees the latent intent, which no window reveals, so
the Bayes filter on the window's true page sub-topics is the nearer bound on what a policy over
the window can earn; bayes_profile / best baseline: the same filter with the user's earlier
history (before the window) as its prior, what a long-term profile of the user could add.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from personalization.evaluate import STRONG_BASELINES, VALUE_BASELINES

_ASTEC = "import sys; from infra.cli import main; sys.argv[0] = 'astec'; sys.exit(main())"


def _run(args: list[str], log: Path, echo) -> None:
    """`astec ARGS` unless it succeeded before (LOG.ok); stdout and stderr go to `log`."""
    done = log.with_suffix(".ok")
    if done.exists():
        echo(f"  have {done}")
        return
    t = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        r = subprocess.run([sys.executable, "-c", _ASTEC, *args], stdout=f, stderr=f, check=False)
    if r.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise click.ClickException(f"astec {' '.join(args)} failed (log {log}):\n{tail}")
    done.write_text(f"{time.perf_counter() - t:.1f}\n")
    echo(f"  astec {args[0]} {args[1]}: {time.perf_counter() - t:.0f}s")


def run_world(
    work: Path,
    scenario: str,
    wseed: int,
    seeds: int,
    size: tuple,
    days: int,
    n_boot: int,
    echo,
    ablation: bool = True,
    threads: int = 1,
) -> tuple[list[dict], list[dict]]:
    """The pipeline on one world; returns evaluate's report per training seed, of the policy
    and (ablation) of the same policy trained with --no-recurrence (else an empty list)."""
    q, p, u = size
    work.mkdir(parents=True, exist_ok=True)
    W, s = str(work), str(wseed)
    _run(
        ["simulate", "world", "--out", f"{W}/world", "--queries", str(q), "--pages", str(p),
         "--users", str(u), "--seed", s, "--scenario", scenario],
        work / "world.log", echo,
    )  # fmt: skip
    _run(
        ["simulate", "logs", "--world", f"{W}/world", "--out", f"{W}/logs", "--days", str(days),
         "--seed", s],
        work / "logs.log", echo,
    )  # fmt: skip
    _run(
        ["retrain", "--logs", f"{W}/logs", "--models", f"{W}/engine"],
        work / "retrain.log", echo,
    )  # fmt: skip
    _run(
        ["simulate", "loop", "--world", f"{W}/world", "--models", f"{W}/engine", "--policy",
         "most_frequent", "--no-retrain", "--rounds", "1", "--days", str(days), "--epsilon",
         "0.3", "--seed", s, "--out", f"{W}/mf"],
        work / "loop.log", echo,
    )  # fmt: skip
    versions = []
    for name, extra in [("gru", [])] + ([("gru_norec", ["--no-recurrence"])] if ablation else []):
        train_args = ["personalize", "train", "--logs", f"{W}/mf/logs", "--models",
                      f"{W}/engine", "--out", f"{W}/{name}", "--holdout", "0.2", "--quiet",
                      "--threads", str(threads), *extra]  # fmt: skip
        for k in range(seeds):
            train_args += ["--seed", str(k)]
        _run(train_args, work / f"train-{name}.log", echo)
        versions += sorted((work / name / "versions").iterdir())[-seeds:]
    tag = "evaluate-ablation" if ablation else "evaluate"
    ev = ["personalize", "evaluate", "--logs", f"{W}/mf/logs", "--models", f"{W}/engine",
          "--bootstrap", str(n_boot), "--json-out", f"{W}/{tag}.json", "--quiet"]  # fmt: skip
    for v in versions:
        ev += ["--policy", str(v)]
    _run(ev, work / f"{tag}.log", echo)
    reps = json.loads((work / f"{tag}.json").read_text())
    reps = reps if isinstance(reps, list) else [reps]
    return reps[:seeds], reps[seeds:]


def recurrence_table(runs: list[dict], norec: list[dict], n_boot: int) -> str:
    """Per run: the policy's served CTR against the same policy without recurrence, paired on
    the same held-out visits and clustered by user (personalization.value.paired_bootstrap)."""
    import numpy as np

    from personalization.value import paired_bootstrap

    lines = [
        "| world | seed | with recurrence (served) | without | ratio | paired lower bound "
        "| ratio, greedy | lower bound, greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, n in zip(runs, norec, strict=True):
        a, b = r["gru_per_visit"], n["gru_per_visit"]
        if a["user"] != b["user"]:
            raise click.ClickException("the two policies were evaluated on different visits")
        users = np.asarray(a["user"])
        cells = []
        for k in ("served_ctr", "actual_ctr"):
            x, y = np.asarray(a[k]), np.asarray(b[k])
            pb = paired_bootstrap(x, y, users, n_boot, 0)
            cells.append((x.mean(), y.mean(), x.mean() / max(y.mean(), 1e-12), pb["diff_ci95"][0]))
        (sx, sy, sr, slo), (_, _, gr, glo) = cells
        lines.append(
            f"| {r['world_seed']} | {r['train_seed']} | {sx:.4f} | {sy:.4f} | {sr:.3f} "
            f"| {slo:+.4f} | {gr:.3f} | {glo:+.4f} |"
        )
    return "\n".join(lines)


def tables(runs: list[dict]) -> str:
    """The sweep's table (markdown): per policy its mean served / greedy CTR, then per run the
    GRU against the best baseline as served."""
    names = ["gru", *VALUE_BASELINES, *STRONG_BASELINES, "knows_intent"]
    lines = [
        "| policy | served CTR | greedy CTR |",
        "|---|---|---|",
    ]
    for n in names:
        pol = [r["value"]["policies"][n] for r in runs if n in r["value"]["policies"]]
        if not pol:
            continue
        served = [x["served_ctr"] for x in pol if "served_ctr" in x]
        sv = f"{sum(served) / len(served):.4f}" if served else "-"
        greedy = sum(x["actual_ctr"] for x in pol) / len(pol)
        lines.append(f"| {n} | {sv} | {greedy:.4f} |")
    lines += [
        "",
        "| world | seed | best baseline (served) | gru / best, served | paired lower bound "
        "| gru / best, greedy | knows_intent | headroom | bayes_window / best "
        "| bayes_profile / best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        val, t = r["value"], r["value"]["targets"]
        lines.append(
            f"| {r['world_seed']} | {r['train_seed']} | {val['served_best_baseline']} "
            f"| {t['served_ratio_vs_best']:.3f} | {t['served_paired_lo_vs_best']:+.4f} "
            f"| {t['ctr_ratio_vs_best']:.3f} ({val['best_baseline']}) "
            f"| {val['policies']['knows_intent']['actual_ctr']:.4f} | {t['headroom']:.3f} "
            f"| {t.get('window_headroom', float('nan')):.3f} "
            f"| {t.get('profile_headroom', float('nan')):.3f} |"
        )
    return "\n".join(lines)


@click.command("bench")
@click.option(
    "--scenario",
    required=True,
    help="Scenario of the worlds' traffic: a shipped name or a .toml/.json file.",
)
@click.option("--worlds", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option(
    "--seeds",
    type=click.IntRange(1, 10),
    default=2,
    show_default=True,
    help="Training seeds of the policy per world.",
)
@click.option(
    "--first-world-seed",
    type=int,
    default=40,
    show_default=True,
    help="World seeds are this and the next --worlds - 1 (keep away from the seeds the policy "
    "was tuned on, 21-35).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Work directory (one sub-directory per world; an existing step is reused).",
)
@click.option("--queries", type=click.IntRange(10, None), default=2000, show_default=True)
@click.option("--pages", type=click.IntRange(10, None), default=3000, show_default=True)
@click.option("--users", type=click.IntRange(1, None), default=300, show_default=True)
@click.option("--days", type=click.IntRange(1, None), default=8, show_default=True)
@click.option("--bootstrap", "n_boot", type=click.IntRange(10, 100000), default=1000)
@click.option(
    "--ablation/--no-ablation",
    default=True,
    show_default=True,
    help="Also train each seed with --no-recurrence and print the policy with / without its "
    "recurrent part (paired on the same held-out visits).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Threads of each `astec personalize train`.",
)
def bench(
    scenario,
    worlds,
    seeds,
    first_world_seed,
    out,
    queries,
    pages,
    users,
    days,
    n_boot,
    ablation,
    threads,
) -> None:
    """The documented pipeline on N worlds x M training seeds of a scenario; one table (and,
    with --ablation, the policy with / without its recurrent part)."""
    from simulator.cli_simulate import resolve_scenario

    sc = resolve_scenario(scenario)
    runs, norec = [], []
    for w in range(worlds):
        wseed = first_world_seed + w
        click.echo(f"world {wseed} ({sc.name})", err=True)
        reps, ablated = run_world(
            out / f"{sc.name}-w{wseed}",
            scenario,
            wseed,
            seeds,
            (queries, pages, users),
            days,
            n_boot,
            lambda m: click.echo(m, err=True),
            ablation,
            threads,
        )
        for k, rep in enumerate(reps):
            runs.append({"world_seed": wseed, "train_seed": k, **rep})
        for k, rep in enumerate(ablated):
            norec.append({"world_seed": wseed, "train_seed": k, **rep})
    text = tables(runs)
    if ablation:
        text += "\n\nwith / without recurrence:\n\n" + recurrence_table(runs, norec, n_boot)
    (out / f"bench-{sc.name}.md").write_text(text + "\n")
    (out / f"bench-{sc.name}.json").write_text(json.dumps(runs, indent=1) + "\n")
    if ablation:
        (out / f"bench-{sc.name}-no-recurrence.json").write_text(json.dumps(norec, indent=1) + "\n")
    click.echo(f"scenario {sc.name}: {worlds} worlds x {seeds} training seeds")
    click.echo(text)
