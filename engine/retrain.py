"""Retrain the engine from click logs, compare with the current version, promote only if not worse.

Steps, all inside a staging directory of the model registry (engine.registry):
  1. split the search clicks by date: the newest `holdout_days` are held out, the rest train;
  2. build the title -> queries training set from the older clicks (engine.clicks_dataset);
  3. train Astec, save it to model/, export the CPU predictor to predictor/;
  4. evaluate the new predictor and the current version's predictor on the held-out slice, by query
     text (the two versions may have different label sets);
  5. commit the version (atomic rename) and promote it (atomic CURRENT switch) only if
     new[metric] >= current[metric] - tolerance; prune to the newest `keep` versions;
  6. once promoted, name the GRU policy of MODELS_DIR/gru that was trained on another label
     space (`policies_to_retrain`): the stream serves each page's top query beside the new
     engine until a policy trained on it is promoted.
A failure or a kill at any step leaves CURRENT and every complete version as they were; the next
retrain removes the stale staging directory. A second retrain running at the same time is refused
(flock on the registry).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from engine.clicklog import ReadReport, partitions, read_log
from engine.clicks_dataset import aggregate_clicks, build_training_set, table_to_points
from engine.formats import read_label_names, read_text_tsv, write_text_tsv
from engine.manifest import read_manifest
from engine.ranking_metrics import evaluate, inv_propensity
from engine.registry import Registry, RegistryError, RegistryLocked

log = logging.getLogger(__name__)

GRU_REGISTRY = "gru"  # where `astec personalize train` publishes policies (MODELS_DIR/gru)


class RetrainError(RuntimeError):
    """The logs or the registry do not allow a retrain (the message says why)."""


@dataclass
class RetrainSettings:
    min_clicks: int = 2
    holdout_days: int = 1  # newest days of search clicks used only for evaluation
    metric: str = "P@1"
    tolerance: float = 1.0  # in metric points (percent): promote if new >= current - tol
    keep: int = 5
    k: int = 5
    max_eval_points: int = 20_000
    seed: int = 0
    progress: bool = True


@dataclass
class RetrainResult:
    version: str
    promoted: bool
    reason: str
    previous: str | None
    metrics_new: dict
    metrics_current: dict | None
    data: dict
    eval_points: int
    pruned: list = field(default_factory=list)
    seconds: float = 0.0
    policies_to_retrain: list = field(default_factory=list)  # policies_to_retrain's entries

    def to_dict(self) -> dict:
        return asdict(self)


def _holdout_table(log_dir, since: str, min_clicks: int, report: ReadReport):
    table = aggregate_clicks(read_log(log_dir, "search_clicks", report, since=since)).filtered(
        min_clicks
    )
    return table


def evaluate_by_text(
    predict: Callable[[list[str], int], np.ndarray],
    model_names: list[str],
    texts: list[str],
    Y: sp.csr_matrix,
    names: list[str],
    k: int = 5,
) -> dict:
    """Metrics (percent) of a predictor on (texts, Y over `names`), matching labels by text."""
    ids = np.asarray(predict(texts, k))
    index = {n: i for i, n in enumerate(names)}
    lut = np.array([index.get(n.strip().lower(), -1) for n in model_names] + [-1], np.int64)
    mapped = lut[np.where(ids >= 0, ids, len(model_names))]
    inv = inv_propensity(Y) if Y.shape[0] >= 2 else None
    ks = tuple(x for x in (1, 3, 5) if x <= k)
    return {m: round(float(v), 3) for m, v in evaluate(Y, mapped, inv, ks=ks).items()}


def _predictor_fn(version_dir: Path):
    """(predict(texts, k) -> ids, label names) of a version: its exported predictor."""
    from engine.predictor import Predictor

    p = Predictor.load(version_dir / "predictor")
    return (lambda texts, k: p.predict(texts, k)[0]), p.label_names


def retrain(
    log_dir: str | Path,
    models_dir: str | Path,
    config=None,
    settings: RetrainSettings | None = None,
) -> RetrainResult:
    """Train a new version from LOG_DIR and promote it under MODELS_DIR if it is not worse."""
    s = settings or RetrainSettings()
    t0 = time.time()
    reg = Registry(Path(models_dir), keep=s.keep)
    dates = partitions(log_dir, "search_clicks")
    if len(dates) <= s.holdout_days:
        raise RetrainError(
            f"{log_dir}: search clicks span {len(dates)} day(s); need more than "
            f"--holdout-days={s.holdout_days} (the newest days are held out for evaluation)"
        )
    train_until, holdout_since = dates[-s.holdout_days - 1], dates[-s.holdout_days]
    try:
        with reg.lock(wait=False):
            res = _retrain_locked(reg, log_dir, config, s, train_until, holdout_since)
    except RegistryLocked as e:
        raise RetrainError(f"{models_dir}: another retrain is running ({e})") from None
    res.seconds = round(time.time() - t0, 1)
    return res


def policies_to_retrain(models_dir: str | Path, label_space: str) -> list[dict]:
    """The promoted GRU policy of MODELS_DIR/gru, when it was not trained on an engine of this
    label space (its manifest's `engine_label_space` differs or is missing): its ids name other
    queries beside the engine, so the stream will not serve it. [] when there is none."""
    root = Path(models_dir) / GRU_REGISTRY
    if not (root / "CURRENT").is_file():
        return []
    reg = Registry(root)
    try:
        version = reg.current()
        if version is None:
            return []
        manifest = json.loads((reg.path(version) / "manifest.json").read_text(encoding="utf-8"))
    except (RegistryError, OSError, ValueError) as e:
        return [{"registry": str(root), "version": None, "reason": f"unreadable: {e}"}]
    if manifest.get("engine_label_space") == label_space:
        return []
    return [
        {
            "registry": str(root),
            "version": version,
            "engine_version": manifest.get("engine_version"),
            "reason": "trained on another label space"
            if manifest.get("engine_label_space")
            else "records no engine label space",
        }
    ]


def _evaluate_current(reg: Registry, version: str, e_texts, e_Y, e_names, k: int):
    """Metrics of the current version, or (None, why) when it cannot be loaded or run."""
    try:
        fn, mnames = _predictor_fn(reg.path(version))
        return evaluate_by_text(fn, mnames, e_texts, e_Y, e_names, k), None
    except Exception as e:  # noqa: BLE001 - a broken current version must not block a new one
        log.error("current version %s cannot be evaluated: %s", version, e)
        return None, f"current version {version} unusable: {e}"


def _retrain_locked(
    reg: Registry, log_dir, config, s: RetrainSettings, train_until: str, holdout_since: str
) -> RetrainResult:
    from engine.astec import Astec, AstecConfig
    from engine.export import ExportOptions, export_model

    stale = reg.cleanup_staging()
    if stale:
        log.warning(
            "removed %d stale staging dir(s) from interrupted retrains: %s", len(stale), stale
        )
    previous = reg.current()
    st = reg.stage()
    try:
        data = build_training_set(
            log_dir,
            st.path / "data",
            min_clicks=s.min_clicks,
            test_fraction=0.0,
            seed=s.seed,
            until=train_until,
        )
        names = read_label_names(st.path / "data" / "labels.txt")
        texts, Y = read_text_tsv(st.path / "data" / "train.tsv", num_labels=len(names))
        cfg = config or AstecConfig()
        model = Astec.train(texts, Y, cfg, label_names=names, progress=s.progress)
        model.save(st.path / "model")
        del model
        export_model(
            st.path / "model",
            st.path / "predictor",
            ExportOptions(version=st.version),
            progress=s.progress,
        )

        rep = ReadReport("search_clicks")
        table = _holdout_table(log_dir, holdout_since, s.min_clicks, rep)
        e_texts, e_Y, e_names = table_to_points(table)
        if len(e_texts) > s.max_eval_points:
            pick = np.sort(
                np.random.default_rng(s.seed).choice(len(e_texts), s.max_eval_points, replace=False)
            )
            e_texts, e_Y = [e_texts[i] for i in pick], e_Y[pick]
        if not e_texts:
            raise RetrainError(
                f"{log_dir}: no held-out pages with >= {s.min_clicks} clicks since {holdout_since}"
            )
        # the held-out day in the model's label space is the version's test set (what `astec
        # evaluate`, the benchmarks and the dashboard's offline page read from data/test.tsv)
        t_texts, t_Y, _ = table_to_points(table, label_names=names)
        write_text_tsv(st.path / "data" / "test.tsv", t_texts, t_Y)
        data["points_test"] = len(t_texts)
        fn, mnames = _predictor_fn(st.path)
        m_new = evaluate_by_text(fn, mnames, e_texts, e_Y, e_names, s.k)
        if s.metric not in m_new:
            raise RetrainError(f"metric {s.metric!r} not computed; choose one of {sorted(m_new)}")
        m_cur, why = (
            (None, "no current version")
            if previous is None
            else _evaluate_current(reg, previous, e_texts, e_Y, e_names, s.k)
        )
        if m_cur is None:
            promote, reason = True, why
        else:
            delta = m_new[s.metric] - m_cur[s.metric]
            promote = delta >= -s.tolerance
            reason = (
                f"{s.metric} {m_new[s.metric]:.2f} vs current {m_cur[s.metric]:.2f} "
                f"(delta {delta:+.2f}, tolerance {s.tolerance})"
            )
        meta = {
            "kind": "astec",
            "parent": previous,
            "promoted": promote,
            "decision": reason,
            "metrics_holdout": m_new,
            "metrics_current_on_holdout": m_cur,
            "holdout": {"since": holdout_since, "points": len(e_texts), "read": rep.to_dict()},
            "train_until": train_until,
            "data": data,
            "settings": asdict(s),
            "config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
        }
        reg.commit(st, meta)
    except BaseException:
        shutil.rmtree(st.path, ignore_errors=True)
        raise
    if promote:
        reg.promote(st.version)
    pruned = reg.prune()
    to_retrain: list[dict] = []
    if promote:
        space = read_manifest(reg.path(st.version) / "predictor").get("label_space", "")
        to_retrain = policies_to_retrain(reg.root, space)
    return RetrainResult(
        st.version,
        promote,
        reason,
        previous,
        m_new,
        m_cur,
        data,
        len(e_texts),
        pruned,
        0.0,
        to_retrain,
    )
