"""Offline comparisons for the dashboard: Astec against its peers, P@k against k, and each
label-frequency bin's share of P@5 (the DeepXML paper's supplementary quantile figure).

Sources, all written by other commands (nothing is trained or predicted here):
  * `astec bench peers --json-out FILE`: a JSON list of {"method", "P@1".."PSP@5", "train_s",
    "predict_s", "peak_rss_mb"} rows (or {"method", "error"} for a method that failed);
  * a run's metrics as models.summary_rows finds them (train_log validation, `astec evaluate
    --json-out` files, retrain held-out metrics) for P@k against k;
  * an `astec evaluate --json-out` file names its test, prediction and training files: when they
    are still readable, the bins are computed from them (labels sorted by training frequency,
    five equal-sized bins; a bin's share is its correct top-5 predictions / (5 N), so the bins
    add up to P@5).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

MAX_JSON_BYTES = 4 << 20
BENCH_METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")
# the benchmark table's columns shown by default (the rest behind "Show all columns")
BENCH_TABLE = ("benchmark", "method", "P@1", "P@5", "PSP@1", "PSP@5", "train_s", "peak_rss_mb")
_PK = re.compile(r"^P@(\d+)$")


def _read(path: Path):
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            return None
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_bench(obj) -> bool:
    """True for the list `astec bench peers --json-out` writes."""
    return (
        isinstance(obj, list)
        and bool(obj)
        and all(isinstance(r, dict) and isinstance(r.get("method"), str) for r in obj)
    )


def find_bench(models: Path, given: tuple[Path, ...] = ()) -> list[Path]:
    """Benchmark JSON files: the given ones, then any in MODELS, MODELS/bench or MODELS/.."""
    out = [Path(p) for p in given]
    models = Path(models)
    for d in (models, models / "bench", models.parent):
        if d.is_dir():
            for f in sorted(d.glob("*.json")):
                if f not in out and f.name not in ("CURRENT",) and is_bench(_read(f)):
                    out.append(f)
    return out


def bench_rows(files: list[Path]) -> tuple[list[dict], list[str]]:
    """(one row per file and method, problems as messages)."""
    rows, problems = [], []
    for f in files:
        obj = _read(Path(f))
        if not is_bench(obj):
            problems.append(f"{f}: not the JSON list `astec bench peers --json-out` writes")
            continue
        for r in obj:
            row = {"benchmark": Path(f).name, "method": r["method"]}
            if "error" in r:
                row["error"] = str(r["error"])[:200]
            for k in (*BENCH_METRICS, "train_s", "predict_s", "peak_rss_mb"):
                v = r.get(k)
                row[k] = float(v) if isinstance(v, (int, float)) else None
            rows.append(row)
    return rows, problems


def bench_metric_points(rows: list[dict]) -> list[dict]:
    """(benchmark, method, metric, value) points of the methods that ran, for the grouped bars;
    a metric a method did not report is left out rather than drawn as zero."""
    return [
        {"benchmark": r["benchmark"], "method": r["method"], "metric": m, "value": r[m]}
        for r in rows
        if not r.get("error")
        for m in BENCH_METRICS
        if r.get(m) is not None
    ]


def bench_pk_points(rows: list[dict]) -> list[dict]:
    """P@k points of every method that ran in a benchmark, one series per method and file."""
    pts: list[dict] = []
    for r in rows:
        if not r.get("error"):
            pts += pk_points(f"peer {r['method']} · {r['benchmark']}", r)
    return pts


def bin_rows(runs, compute: Callable[[Path], dict]) -> tuple[list[dict], list[str]]:
    """(one bar per evaluation and label-frequency bin, why an evaluation has none).

    compute(path) is frequency_bins of the evaluation file at path (the app caches it); a file
    it cannot use is named in the messages instead of stopping the page."""
    bins, why_not = [], []
    for run in runs:
        for path, _ev in run.evaluations:
            try:
                res = compute(path)
            except Exception as e:  # noqa: BLE001 - say which file, keep the page
                why_not.append(f"{run.name} · {path.name}: {e}")
                continue
            for b in res["bins"]:
                bins.append(
                    {
                        "version": f"{run.name} · {path.name}",
                        **b,
                        "bin label": f"{b['bin']} ({b['mean_freq']:g})",
                    }
                )
    return bins, why_not


def pk_points(label: str, metrics: dict) -> list[dict]:
    """(series, k, P@k) points of one metrics table, for every P@k it holds."""
    pts = []
    for key, v in metrics.items():
        m = _PK.match(str(key))
        if m and isinstance(v, (int, float)) and not math.isnan(v):
            pts.append({"series": label, "k": int(m.group(1)), "P@k": round(float(v), 2)})
    return sorted(pts, key=lambda p: p["k"])


def run_pk_points(runs) -> list[dict]:
    """P@k points of every run's metrics sources (validation, evaluations, held-out)."""
    pts = []
    for r in runs:
        tl = r.train_log or {}
        learners = tl.get("learners") or []
        if learners:
            from dashboard.models import _final_valid

            pts += pk_points(f"{r.name} · validation", _final_valid(learners[0]))
        for path, ev in r.evaluations:
            pts += pk_points(f"{r.name} · {path.name}", ev.get("metrics", {}))
        hold = r.meta.get("metrics_holdout")
        if isinstance(hold, dict):
            pts += pk_points(f"{r.name} · held-out", hold)
    return pts


def _load_pred(path: Path, L: int):
    from engine.formats import read_npz, read_predictions

    if str(path).endswith(".npz"):
        return read_npz(path)
    return read_predictions(path, L)


def frequency_bins(ev: dict, n_bins: int = 5, k: int = 5) -> dict:
    """Each label-frequency bin's share of P@k for one `astec evaluate --json-out` result.

    Labels (all L, unseen ones included) are sorted by their training frequency and cut into
    n_bins equal-sized bins, rarest first. Returns {"bins": [{"bin", "labels", "mean_freq",
    "share"}], "P@k": total} or raises ValueError saying which file is missing."""
    import scipy.sparse as sp

    from engine.formats import load_dataset
    from engine.ranking_metrics import hit_matrix, topk

    files: dict[str, str] = {}
    for what in ("test", "pred", "train"):
        p = ev.get(what)
        if not p:
            raise ValueError(
                f"the evaluation names no {what} file (run `astec evaluate` with "
                "--train to get label frequencies)"
            )
        if not Path(p).is_file():
            raise ValueError(f"{what} file {p} is no longer readable")
        files[what] = str(p)
    te, tr = load_dataset(files["test"]), load_dataset(files["train"])
    L = max(te.num_labels, tr.num_labels, int(ev.get("num_labels") or 0))
    Y = sp.csr_matrix((te.Y.data, te.Y.indices, te.Y.indptr), shape=(te.Y.shape[0], L))
    P = _load_pred(Path(files["pred"]), L)
    if P.shape[0] != Y.shape[0]:
        raise ValueError(f"{files['pred']} has {P.shape[0]} rows, {files['test']} has {Y.shape[0]}")
    P = sp.csr_matrix((P.data, P.indices, P.indptr), shape=(P.shape[0], L))
    ids = topk(P, k, L)
    hits = hit_matrix(Y, ids)
    Ytr = sp.csr_matrix(tr.Y)
    freq = np.zeros(L)
    f = np.bincount(Ytr.indices, minlength=Ytr.shape[1]).astype(float)
    freq[: f.size] = f[:L]
    order = np.argsort(freq, kind="stable")  # rarest first
    bin_of = np.empty(L, np.int64)
    bin_of[order] = np.arange(L) * n_bins // L
    n = Y.shape[0]
    valid = ids >= 0
    hit_bins = bin_of[np.where(valid, ids, 0)][hits & valid]
    counts = np.bincount(hit_bins, minlength=n_bins)
    bins = []
    for b in range(n_bins):
        labs = order[bin_of[order] == b]
        bins.append(
            {
                "bin": b + 1,
                "labels": int(labs.size),
                "mean_freq": round(float(freq[labs].mean()), 2) if labs.size else 0.0,
                "share": round(100.0 * counts[b] / (k * n), 3) if n else 0.0,
            }
        )
    return {"bins": bins, f"P@{k}": round(100.0 * counts.sum() / (k * n), 3) if n else 0.0}
