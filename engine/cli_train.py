"""`astec train` and `astec predict`: thin click wrappers over engine.astec.Astec."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from engine.astec.config import (
    DEVICES,
    PRECISIONS,
    TOP_K,
    AstecConfig,
    EnsembleParams,
    TrainingParams,
)
from engine.cli_options import config_option, default_of, renamed_option
from engine.clicks_dataset import build_training_set


@click.command("train")
@click.option(
    "--train",
    "train_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Training data: text TSV (text<TAB>id,id,...), XC sparse (N F L header) or XC raw text.",
)
@click.option(
    "--clicks",
    "clicks_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Train from search click logs instead (LOG_DIR/search_clicks/<date>/*.jsonl): the "
    "title -> queries set is written to OUT/data/ (train.tsv, test.tsv, labels.txt).",
)
@click.option(
    "--min-clicks",
    type=click.IntRange(1),
    default=default_of(build_training_set, "min_clicks"),
    show_default=True,
    help="With --clicks: clicks a (page, query) pair needs to become a label.",
)
@click.option(
    "--test-fraction",
    type=click.FloatRange(0, 1, max_open=True),
    default=default_of(build_training_set, "test_fraction"),
    show_default=True,
    help="With --clicks: share of pages held out in OUT/data/test.tsv (split by page).",
)
@click.option(
    "--labels",
    "labels_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="labels.txt (line i = name of label i) or, for XC titles/feature files, the *_X_Y.txt "
    "matrix.",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Model directory to write.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="AstecConfig JSON (nested sections, or the flat field names) overriding the defaults.",
)
@config_option(EnsembleParams, "learners", "--learners", type=click.IntRange(1, 16))
@config_option(AstecConfig, "seed", "--seed", type=int)
@config_option(TrainingParams, "threads", "--threads", type=click.IntRange(0, 256))
@config_option(TrainingParams, "device", "--device", type=click.Choice(DEVICES))
@config_option(TrainingParams, "precision", "--precision", type=click.Choice(PRECISIONS))
@click.option("--quiet", is_flag=True, help="No progress bars.")
def train(
    train_path,
    clicks_dir,
    min_clicks,
    test_fraction,
    labels_path,
    out_dir,
    config_path,
    learners,
    seed,
    threads,
    device,
    precision,
    quiet,
):
    """Train Astec (Modules I-IV, re-ranker, optional ensemble) and save MODEL_DIR.

    Give either --train (a data set file) or --clicks (search click logs). Writes config.json, the
    vocabulary, weights (safetensors), the hnswlib/exact indexes, the label map, train_log.json
    (per-module wall time, peak memory, validation metrics) and a manifest.
    """
    from engine.astec import Astec
    from engine.formats import FormatError, load_dataset

    if (train_path is None) == (clicks_dir is None):
        raise click.UsageError("give exactly one of --train FILE and --clicks LOG_DIR")
    if clicks_dir is not None:
        data_dir = Path(out_dir) / "data"
        try:
            stats = build_training_set(
                clicks_dir, data_dir, min_clicks=min_clicks, test_fraction=test_fraction
            )
        except ValueError as e:
            raise click.ClickException(str(e)) from None
        click.echo(
            f"click logs {clicks_dir}: {stats['clicks']} clicks -> {stats['points_train']} train / "
            f"{stats['points_test']} test pages, {stats['labels']} queries "
            f"({stats['read']['corrupt']} corrupt lines skipped) -> {data_dir}"
        )
        train_path, labels_path = str(data_dir / "train.tsv"), str(data_dir / "labels.txt")
    try:
        cfg = AstecConfig.load(config_path) if config_path else AstecConfig()
        ds = load_dataset(train_path, labels_path)
    except (FormatError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if threads is not None:
        cfg.training.threads = threads
    if device is not None:
        cfg.training.device = device
    if precision is not None:
        cfg.training.precision = precision
    inputs = ds.texts if ds.texts is not None else ds.X
    t0 = time.time()
    try:
        model = Astec.train(
            inputs,
            ds.Y,
            cfg,
            label_names=ds.label_names,
            seed=seed,
            learners=learners,
            progress=not quiet,
        )
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    model.save(out_dir)
    log = model.train_log
    click.echo(
        f"trained {len(model.learners)} learner(s) on {ds.num_points} points, "
        f"{ds.num_labels} labels "
        f"in {time.time() - t0:.1f} s (peak RSS {log.get('peak_rss_mb')} MB) -> {out_dir}"
    )
    for j, lr in enumerate(log.get("learners", [])):
        mods = lr["modules"]
        best = mods.get("sparse", mods.get("reranker", mods.get("IV", {}))).get("valid")
        times = ", ".join(f"{k}={v.get('seconds')}s" for k, v in mods.items())
        click.echo(
            f"  learner {j}: {times}"
            + (f"; valid P@1={best['P@1']:.2f} PSP@5={best['PSP@5']:.2f}" if best else "")
        )


def _read_inputs(path):
    from engine.formats import detect_format, read_text_lines, read_text_tsv, read_xc_sparse

    fmt = detect_format(path)
    if fmt == "text-tsv":
        return read_text_tsv(path)[0]
    if fmt == "text-lines":
        return read_text_lines(path)
    if fmt == "xc-sparse":
        return read_xc_sparse(path)[0]
    raise click.ClickException(
        f"{path}: {fmt} input is not supported by predict "
        "(give a text TSV, one text per line, or an XC sparse file)"
    )


@click.command("predict")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="A model registry (with CURRENT), one of its versions, a trained model directory or an "
    "exported predictor.",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Texts to label: text TSV (labels ignored), one text per line, or XC sparse features.",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Prediction file: one line per input, 'id:score id:score ...' best first.",
)
@click.option(
    "--text", "texts", multiple=True, help="A text to label (repeatable); prints names and scores."
)
@renamed_option(
    "--top-k",
    "--k",
    "k",
    type=click.IntRange(1, 10000),
    default=TOP_K,
    show_default=True,
    help="Labels per text.",
)
@click.option(
    "--no-verify", is_flag=True, help="Skip sha256 checks when loading (sizes are still checked)."
)
def predict(model_dir, input_path, out_path, texts, k, no_verify):
    """Predict the top-k labels with a trained model (batch file or --text).

    A --text with no word the model knows prints "no known word: no queries" instead of the
    model's prior (the same queries for every such text)."""
    from engine.astec.io import ModelDirError
    from engine.formats import FormatError, detect_format, write_predictions
    from engine.model_paths import ModelPathError, resolve_model
    from engine.predictor import PredictorError, known_texts

    if not input_path and not texts:
        raise click.UsageError("give --input FILE (with --out) or --text 'some title'")
    if input_path and not out_path:
        raise click.UsageError("--input needs --out PRED.txt")
    # features files need the trained model; text goes through the (faster to load) predictor
    sparse_input = input_path is not None and detect_format(input_path) == "xc-sparse"
    model: Any  # a Predictor or an Astec model: both predict(texts, k) and name their labels
    try:
        where = resolve_model(model_dir, prefer="model" if sparse_input else "predictor")
        if where.kind == "predictor":
            if sparse_input:
                raise click.ClickException(
                    f"{where.path}: an exported predictor reads text, not the XC sparse features "
                    f"of {input_path}: give the trained model directory (or its registry)"
                )
            from engine.predictor import Predictor

            model = Predictor.load(str(where.path), check_hashes=not no_verify)
        else:
            from engine.astec import Astec

            model = Astec.load(where.path, check_hashes=not no_verify)
    except (ModelPathError, ModelDirError, PredictorError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    version = f", version {where.version}" if where.version else ""
    click.echo(f"{where.kind}: {where.path}{version}", err=True)
    if input_path:
        try:
            inputs = _read_inputs(input_path)
            t0 = time.time()
            ids, scores = model.predict(inputs, k=k)
        except (FormatError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        write_predictions(out_path, ids, scores)
        n = ids.shape[0]
        dt = time.time() - t0
        click.echo(
            f"{n} predictions -> {out_path} ({dt:.1f} s, {1000 * dt / max(n, 1):.2f} ms/point)",
            err=True,
        )
    if texts:
        ids, scores = model.predict(list(texts), k=k)
        names = model.label_names
        known = (
            known_texts(list(texts), model.vectorizer, model.ranker_vectorizer, model.label_text)
            if model.vectorizer is not None
            else [True] * len(texts)
        )
        for t, row, sc, ok in zip(texts, ids, scores, known, strict=True):
            click.echo(f"{t}")
            if not ok:
                click.echo("  no known word: no queries")
                continue
            for i, s in zip(row, sc, strict=True):
                if i >= 0:
                    click.echo(f"  {s:.4f}  {names[i] if names else i}")
