"""Model artifacts as the dashboard sees them: the current predictor and every run's metrics.

MODELS_DIR may be
  * an engine registry (CURRENT -> versions/<id>/, the predictor in versions/<id>/predictor/),
  * one of its versions, or an exported predictor directory (manifest.json + predictor.json),
    resolved by engine.model_paths as every command does (a trained model is refused with the
    `astec export` to run), or
  * any directory holding model/predictor directories (e.g. `astec train --out M/model` and
    `astec export --out M/predictor`).
Offline metrics are found without a fixed layout: a run's `train_log.json` (written by
`astec train`) and any JSON written by `astec evaluate --json-out` (an object with a "metrics"
table of "P@1"-style keys), in the run directory or one level below, and the held-out metrics
`astec retrain` records in a registry version's version.json; a predictor's manifest
also names the model directory it was exported from (source_model.path), whose train_log.json
is then shown with it. Reading only: nothing here trains or writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

MAX_JSON_BYTES = 4 << 20  # evaluation/train logs are small; skip anything bigger
_SKIP_JSON = {"labels.json", "predictor.json", "manifest.json", "config.json", "tfidf.json"}


class ModelsError(RuntimeError):
    """No usable model under MODELS_DIR; the message says what was looked for and what to run."""


@dataclass
class PredictorRef:
    """Which predictor directory is current, and the version it serves."""

    path: Path
    version: str
    source: str  # "registry", "version", "predictor" or "directory"

    def describe(self) -> str:
        """What was found, in words (the dashboard command prints it)."""
        where = {
            "registry": f"the registry's promoted version {self.version}",
            "version": f"registry version {self.version}",
            "predictor": f"exported predictor {self.version}",
            "directory": f"the newest predictor found below it, {self.version}",
        }[self.source]
        return f"{where}: {self.path}"


@dataclass
class Run:
    """One model version or run directory and the metrics files found for it."""

    name: str
    path: Path
    current: bool = False
    meta: dict = field(default_factory=dict)  # registry version.json
    train_log: dict | None = None
    train_log_path: Path | None = None
    evaluations: list[tuple[Path, dict]] = field(default_factory=list)


def _read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None if it is not a readable small JSON object."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            return None
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def is_predictor_dir(path: Path) -> bool:
    return (path / "manifest.json").is_file() and (path / "predictor.json").is_file()


def _registry(models: Path):
    from engine.registry import Registry

    return Registry(models)


def resolve_predictor(models: Path) -> PredictorRef:
    """The predictor to serve from MODELS_DIR, or ModelsError saying why there is none."""
    models = Path(models)
    if not models.is_dir():
        raise ModelsError(
            f"{models}: no such directory. Train and export a model first "
            "(`astec train ... --out M/model`, `astec export --model M/model "
            "--out M/predictor`) and start the dashboard with --models M"
        )
    if (models / "versions").is_dir() and not (models / "CURRENT").is_file():
        raise ModelsError(f"{models / 'CURRENT'}: no promoted model version yet")
    # a registry, one of its versions, a predictor or a trained model: the one rule of every
    # command (engine.model_paths); a trained model is refused with the export to run
    from engine.model_paths import ModelPathError, kind_of, require

    if (models / "CURRENT").is_file() or (models / "version.json").is_file() or kind_of(models):
        try:
            mp = require(models, "predictor")
        except ModelPathError as e:
            raise ModelsError(str(e)) from None
        if mp.version is not None:
            source = "registry" if (models / "CURRENT").is_file() else "version"
            return PredictorRef(mp.path, mp.version, source)
        return PredictorRef(mp.path, _manifest_version(mp.path) or mp.path.name, "predictor")
    found = sorted(d for d in models.iterdir() if d.is_dir() and is_predictor_dir(d))
    if found:
        # several exported predictors side by side: the most recently written one
        newest = max(found, key=lambda d: (d / "manifest.json").stat().st_mtime)
        return PredictorRef(newest, _manifest_version(newest) or newest.name, "directory")
    raise ModelsError(
        f"{models}: no exported predictor here (looked for CURRENT, "
        "manifest.json + predictor.json, and predictor directories one level "
        "down). Export one with `astec export --model MODEL --out "
        f"{models}/predictor`"
    )


def _manifest_version(pdir: Path) -> str:
    m = _read_json(pdir / "manifest.json") or {}
    return str(m.get("version") or "")


def load_predictor(ref: PredictorRef):
    """engine.predictor.Predictor for `ref` (verifies the manifest; no torch)."""
    from engine.predictor import Predictor

    return Predictor.load(ref.path)


# ---- offline metrics -----------------------------------------------------------------------
def is_evaluation(obj: dict | None) -> TypeGuard[dict]:
    """True for the object `astec evaluate --json-out` writes (metrics keyed like "P@1")."""
    m = obj.get("metrics") if isinstance(obj, dict) else None
    return isinstance(m, dict) and any(isinstance(k, str) and "@" in k for k in m)


def _scan_run(run: Run) -> Run:
    """Fill train_log and evaluations from run.path and one directory level below it."""
    dirs = [
        run.path,
        *sorted(d for d in run.path.iterdir() if d.is_dir() and not d.name.startswith(".")),
    ]
    for d in dirs:
        tl = d / "train_log.json"
        if run.train_log is None and tl.is_file():
            run.train_log, run.train_log_path = _read_json(tl), tl
        for f in sorted(d.glob("*.json")):
            if f.name in _SKIP_JSON or f.name in ("train_log.json", "version.json"):
                continue
            obj = _read_json(f)
            if is_evaluation(obj):
                run.evaluations.append((f, obj))
        if run.train_log is None and is_predictor_dir(d):
            src = ((_read_json(d / "manifest.json") or {}).get("source_model") or {}).get("path")
            if src and (Path(src) / "train_log.json").is_file():
                run.train_log_path = Path(src) / "train_log.json"
                run.train_log = _read_json(run.train_log_path)
    return run


def collect_runs(models: Path) -> list[Run]:
    """Every model version / run under MODELS_DIR with its metrics files, newest first."""
    models = Path(models)
    if not models.is_dir():
        raise ModelsError(f"{models}: no such directory")
    runs: list[Run] = []
    if (models / "CURRENT").is_file() or (models / "versions").is_dir():
        from engine.registry import RegistryError

        reg = _registry(models)
        try:
            cur = reg.current()
        except RegistryError:
            cur = None
        for v in reg.versions():
            try:
                meta = reg.meta(v)
            except RegistryError:
                meta = {}
            runs.append(_scan_run(Run(v, reg.path(v), current=(v == cur), meta=meta)))
        return runs[::-1]
    here = _scan_run(Run(models.name, models, current=is_predictor_dir(models)))
    if here.train_log is not None or here.evaluations or is_predictor_dir(models):
        return [here]
    subs = sorted(
        (d for d in models.iterdir() if d.is_dir() and not d.name.startswith(".")),
        key=lambda d: d.stat().st_mtime,
        reverse=True,
    )
    return [
        r
        for r in (_scan_run(Run(d.name, d)) for d in subs)
        if r.train_log is not None or r.evaluations
    ]


def _final_valid(learner_log: dict) -> dict:
    """Validation metrics of a learner's last module that has them (re-ranker, else IV)."""
    mods = learner_log.get("modules", {})
    for name in ("reranker", "IV", "III"):
        v = mods.get(name, {}).get("valid")
        if isinstance(v, dict):
            return v
    return {}


def _r2(x):
    return round(float(x), 2) if isinstance(x, (int, float)) else None


def summary_rows(
    runs: list[Run], metric_keys=("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@5")
) -> list[dict]:
    """One row per run and metrics source: training validation and each evaluation file."""
    rows = []
    for r in runs:
        base = {"run": r.name, "current": r.current}
        tl = r.train_log or {}
        if tl:
            learners = tl.get("learners", [])
            valid = _final_valid(learners[0]) if learners else {}
            row = {
                **base,
                "source": "train_log (validation)",
                "points": tl.get("num_points"),
                "labels": tl.get("num_labels"),
                "learners": len(learners) or None,
                "train_s": tl.get("train_seconds"),
                "peak_rss_mb": tl.get("peak_rss_mb"),
            }
            row.update({k: _r2(valid.get(k)) for k in metric_keys})
            rows.append(row)
        for path, ev in r.evaluations:
            m = ev.get("metrics", {})
            row = {
                **base,
                "source": f"evaluate: {path.name}",
                "points": ev.get("num_points"),
                "labels": ev.get("num_labels"),
                "learners": None,
                "train_s": None,
                "peak_rss_mb": None,
            }
            row.update({k: _r2(m.get(k)) for k in metric_keys})
            rows.append(row)
        hold = r.meta.get("metrics_holdout")
        if isinstance(hold, dict):
            pts = (r.meta.get("holdout") or {}).get("points")
            row = {
                **base,
                "source": "retrain holdout",
                "points": pts,
                "labels": None,
                "learners": None,
                "train_s": None,
                "peak_rss_mb": None,
            }
            row.update({k: _r2(hold.get(k)) for k in metric_keys})
            rows.append(row)
            parent = r.meta.get("metrics_current_on_holdout")
            if isinstance(parent, dict):  # the version it was compared with, same held-out pages
                rows.append(
                    {
                        **row,
                        "source": f"retrain holdout: parent {r.meta.get('parent')}",
                        **{k: _r2(parent.get(k)) for k in metric_keys},
                    }
                )
        if not tl and not r.evaluations and not isinstance(hold, dict):
            rows.append({**base, "source": "no metrics files", **dict.fromkeys(metric_keys)})
    return rows


def version_rows(runs: list[Run]) -> list[dict]:
    """Registry versions with the promotion decision `astec retrain` recorded in version.json."""
    rows = []
    for r in runs:
        if not r.meta:
            continue
        created = r.meta.get("created")
        rows.append(
            {
                "version": r.name,
                "current": r.current,
                "created (UTC)": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(created))
                if isinstance(created, (int, float))
                else None,
                "kind": r.meta.get("kind"),
                "promoted": r.meta.get("promoted"),
                "decision": r.meta.get("decision"),
                "parent": r.meta.get("parent"),
            }
        )
    return rows


def module_rows(run: Run) -> list[dict]:
    """Per learner and module: wall seconds and peak RSS from train_log.json."""
    tl = run.train_log or {}
    rows = []
    if tl.get("features_seconds") is not None:
        rows.append(
            {
                "learner": "-",
                "module": "features",
                "seconds": tl["features_seconds"],
                "peak_rss_mb": None,
            }
        )
    for j, lr in enumerate(tl.get("learners", [])):
        for name, m in lr.get("modules", {}).items():
            if isinstance(m, dict):
                rows.append(
                    {
                        "learner": str(j),
                        "module": name,
                        "seconds": m.get("seconds"),
                        "peak_rss_mb": m.get("peak_rss_mb"),
                    }
                )
    return rows


def gru_rows(policy_root: Path | None) -> list[dict]:
    """The GRU policy registry's versions with the metrics recorded in their version.json."""
    if policy_root is None or not (Path(policy_root) / "versions").is_dir():
        return []
    from engine.registry import RegistryError

    reg = _registry(Path(policy_root))
    try:
        cur = reg.current()
    except RegistryError:
        cur = None
    rows = []
    for v in reversed(reg.versions()):
        try:
            meta = reg.meta(v)
        except RegistryError:
            continue
        row = {"version": v, "current": v == cur, "engine_version": meta.get("engine_version")}
        metrics = meta.get("metrics")
        if isinstance(metrics, dict):
            row.update({k: val for k, val in metrics.items() if isinstance(val, (int, float, str))})
        rows.append(row)
    return rows


def version_predictors(models: Path) -> list[PredictorRef]:
    """Every registry version with an exported predictor, newest first (current included), for
    side-by-side comparison; a plain predictor or run directory gives what resolve_predictor
    finds plus its sibling predictor directories."""
    models = Path(models)
    if not models.is_dir():
        return []
    if (models / "CURRENT").is_file() or (models / "versions").is_dir():
        reg = _registry(models)
        out = []
        for v in reversed(reg.versions()):
            vdir = reg.path(v)
            pdir = vdir / "predictor" if is_predictor_dir(vdir / "predictor") else vdir
            if is_predictor_dir(pdir):
                out.append(PredictorRef(pdir, v, "registry"))
        return out
    if is_predictor_dir(models):
        return [PredictorRef(models, _manifest_version(models) or models.name, "predictor")]
    found = sorted(
        (d for d in models.iterdir() if d.is_dir() and is_predictor_dir(d)),
        key=lambda d: (d / "manifest.json").stat().st_mtime,
        reverse=True,
    )
    return [PredictorRef(d, _manifest_version(d) or d.name, "directory") for d in found]
