"""`astec bench scale`: how Astec's training cost grows with L on synthetic Zipfian data.

Data have the shape of the paper's short-text sets (5 labels/point, 5 words/point, Zipfian label
popularity; engine.synthetic), with N = points_per_label * L points. Each size trains one
learner in a fresh subprocess and reports wall seconds and peak RSS per module (train_log.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from bench.subprocesses import run_worker


@dataclass
class ScaleJob:
    """One size's run in a worker subprocess, passed by name as JSON (the worker's argv[1])."""

    labels: int  # L
    points_per_label: float
    config: str | None  # AstecConfig JSON file
    out_json: str
    seed: int  # of the synthetic data
    progress: bool


def _worker(job: ScaleJob) -> None:
    from engine.astec import Astec, AstecConfig
    from engine.ranking_metrics import evaluate
    from engine.synthetic import zipf_dataset

    cfg = AstecConfig.load(job.config) if job.config else AstecConfig()
    L, seed, progress = job.labels, job.seed, job.progress
    n = int(job.points_per_label * L)
    t0 = time.time()
    texts, Y = zipf_dataset(n + 2000, L, seed=seed)
    gen_s = time.time() - t0
    t0 = time.time()
    m = Astec.train(texts[:n], Y[:n], cfg, progress=progress)
    train_s = time.time() - t0
    t0 = time.time()
    ids, sc = m.predict(texts[n:], k=5)
    pred_ms = 1000 * (time.time() - t0) / 2000
    met = evaluate(Y[n:], (ids, sc), ks=(1, 5))
    lg = m.train_log["learners"][0]["modules"]
    Path(job.out_json).write_text(
        json.dumps(
            {
                "L": L,
                "N": n,
                "generate_s": round(gen_s, 1),
                "train_s": round(train_s, 1),
                "features_s": m.train_log["features_seconds"],
                # the sparse ranker's time includes its refit on all points (after its peak_rss_mb)
                "modules": {
                    k: {
                        "seconds": round(v["seconds"] + v.get("refit_seconds", 0.0), 2),
                        "peak_rss_mb": v["peak_rss_mb"],
                    }
                    for k, v in lg.items()
                },
                "predict_ms_per_point": round(pred_ms, 2),
                "P@1": round(met["P@1"], 2),
                "P@5": round(met["P@5"], 2),
            }
        )
    )


def _stderr_fd():
    """The worker's stdout (its progress lines) goes to our stderr: stdout carries the table."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return subprocess.DEVNULL


@click.command("scale")
@click.option(
    "--sizes",
    default="10000,100000",
    show_default=True,
    help="Comma-separated label counts L (the paper's scale: 10000,100000,500000).",
)
@click.option(
    "--points-per-label",
    default=2.0,
    show_default=True,
    type=float,
    help="N = points_per_label * L training points (AmazonTitles-670K has 0.72: fewer points "
    "than labels; memory grows with N, ~12 GB peak at L=500000 with 0.72).",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, resolve_path=True),
    default=None,
    help="AstecConfig JSON (e.g. fewer epochs for a quick look).",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False), default=None)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Per-module progress bars of each size's training on stderr (default: when "
    "stderr is a terminal; L=500000 trains for ~20 minutes on 2 cores with few epochs).",
)
def scale(sizes, points_per_label, config_path, seed, json_out, progress):
    """Train on synthetic data at growing L; print time and peak memory per module."""
    if progress is None:
        progress = sys.stderr.isatty()
    rows: list[dict[str, Any]] = []
    for L in [int(s) for s in sizes.split(",") if s.strip()]:
        click.echo(f"L={L} ...", err=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            job = ScaleJob(
                labels=L,
                points_per_label=points_per_label,
                config=config_path,
                out_json=out,
                seed=seed,
                progress=progress,
            )
            spec = Path(tmp, "job.json")
            spec.write_text(json.dumps(dataclasses.asdict(job)))
            status, ru = run_worker(
                [sys.executable, "-m", "bench.engine_scale", str(spec)],
                cwd=str(Path(__file__).resolve().parents[1]),
                stdout=_stderr_fd(),
            )
            if status != 0 or not os.path.exists(out):
                rows.append({"L": L, "error": f"exit status {status}"})
                continue
            r = json.loads(Path(out).read_text())
            r["peak_rss_mb"] = round(ru.ru_maxrss / 1024.0)
            rows.append(r)
            click.echo(f"  {json.dumps(r)}", err=True)
    mods = ["I", "II", "IV", "reranker", "sparse"]
    click.echo(
        "| L | N | train s | "
        + " | ".join(f"{m} s" for m in mods)
        + " | peak RSS MB | "
        + " | ".join(f"{m} peak MB" for m in mods)
        + " | predict ms/pt | P@1 | P@5 |"
    )
    click.echo("|" + "---|" * (7 + 2 * len(mods)))
    for r in rows:
        if "error" in r:
            click.echo(f"| {r['L']} | failed: {r['error']} |")
            continue
        md = r["modules"]
        click.echo(
            f"| {r['L']} | {r['N']} | {r['train_s']} | "
            + " | ".join(str(md.get(m, {}).get("seconds", "-")) for m in mods)
            + f" | {r['peak_rss_mb']} | "
            + " | ".join(str(md.get(m, {}).get("peak_rss_mb", "-")) for m in mods)
            + f" | {r['predict_ms_per_point']} | {r['P@1']} | {r['P@5']} |"
        )
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    _worker(ScaleJob(**json.loads(Path(sys.argv[1]).read_text())))
