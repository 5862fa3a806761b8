"""`astec export`: a trained model directory -> a verified, torch-free predictor directory."""

from __future__ import annotations

import json
import sys

import click

from engine.export import ExportOptions


@click.command("export")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The trained model to export: the directory `astec train --out` wrote, a model "
    "registry (its promoted version's model) or one of its versions.",
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Predictor directory to create (built under a staging name, then renamed).",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16"]),
    default=ExportOptions.dtype,
    show_default=True,
    help="Storage of classifier rows (float16 halves them; scores "
    "then differ from the model by ~1e-3).",
)
@click.option(
    "--knn",
    type=int,
    default=ExportOptions.knn,
    show_default=True,
    help="Training points searched per text (0: as many as the model chose on its "
    "validation split).",
)
@click.option(
    "--kmu",
    type=int,
    default=ExportOptions.kmu,
    show_default=True,
    help="Label centres searched per text (0: as many as the model chose).",
)
@click.option(
    "--ef-points",
    type=int,
    default=ExportOptions.ef_points,
    show_default=True,
    help="HNSW ef for the training-point index (0: the model's).",
)
@click.option(
    "--ef-centres",
    type=int,
    default=ExportOptions.ef_centres,
    show_default=True,
    help="HNSW ef for the label-centre index (0: as for --ef-points).",
)
@click.option(
    "--exact-max",
    type=int,
    default=ExportOptions.exact_max,
    show_default=True,
    help="For a model that searched exactly: search exactly (numpy) when an index "
    "has at most this many distinct vectors; above, a new HNSW graph. Model HNSW "
    "graphs are copied as they are.",
)
@click.option(
    "--hnsw-m",
    type=int,
    default=ExportOptions.hnsw_m,
    show_default=True,
    help="Graph degree of the HNSW indexes built here (see --exact-max).",
)
@click.option(
    "--hnsw-ef-construction",
    type=int,
    default=ExportOptions.hnsw_ef_construction,
    show_default=True,
)
@click.option(
    "--sparse-ranker/--no-sparse-ranker",
    default=ExportOptions.sparse_ranker,
    show_default=True,
    help="Serve the model's sparse ranker. --no-sparse-ranker serves the paper's "
    "score combination only (the model's predictions with gamma = 1): faster "
    "per title, less accurate (debian-related: 0.03-0.08 ms, -2 P@1).",
)
@click.option(
    "--label-text/--no-label-text",
    default=ExportOptions.label_text,
    show_default=True,
    help="Serve the model's label-name match (its weight and name candidates). "
    "--no-label-text serves the model's predictions without it.",
)
@click.option(
    "--version",
    "version",
    default=None,
    help="Version string recorded in the manifest (default: astec-<model sha[:12]>).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 256),
    default=ExportOptions.threads,
    show_default=True,
    help="Threads for building indexes.",
)
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
def export(
    model_dir,
    out_dir,
    dtype,
    knn,
    kmu,
    ef_points,
    ef_centres,
    exact_max,
    hnsw_m,
    hnsw_ef_construction,
    sparse_ranker,
    label_text,
    version,
    threads,
    overwrite,
):
    """Export MODEL_DIR as a CPU predictor: ONNX feature networks, .npy classifier rows,
    hnswlib indexes, TF-IDF tables, label names, alpha/beta and a sha256 manifest.

    Load it with `engine.predictor.Predictor.load(OUT)` (no torch needed).
    """
    from engine.export import ExportError, export_model
    from engine.model_paths import ModelPathError, require
    from engine.predictor import Predictor

    try:
        mp = require(model_dir, "model")
    except ModelPathError as e:
        raise click.ClickException(str(e)) from None
    if mp.version is not None:
        click.echo(f"exporting {mp.path} (registry version {mp.version})", err=True)
    model_dir = str(mp.path)

    opts = ExportOptions(
        dtype=dtype,
        knn=knn,
        kmu=kmu,
        hnsw_m=hnsw_m,
        hnsw_ef_construction=hnsw_ef_construction,
        ef_points=ef_points,
        ef_centres=ef_centres,
        exact_max=exact_max,
        threads=threads,
        version=version,
        sparse_ranker=sparse_ranker,
        label_text=label_text,
    )
    try:
        out = export_model(model_dir, out_dir, opts, overwrite=overwrite)
    except (ExportError, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    p = Predictor.load(out)  # re-read through the verifying loader before saying "done"
    files = p.manifest.files
    size = sum(e["bytes"] for e in files.values())
    click.echo(
        json.dumps(
            {
                "predictor": str(out),
                "version": p.version,
                "files": len(files),
                "bytes": size,
                "labels": p.num_labels,
                "dim": p.dim,
                "learners": len(p.learners),
            },
            indent=1,
        )
    )
    sys.stdout.flush()
