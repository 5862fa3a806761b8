"""`astec evaluate`: score a prediction file against a test set with the XML metrics."""

from __future__ import annotations

import json
from pathlib import Path

import click
import numpy as np
import scipy.sparse as sp

from engine.cli_options import renamed_option
from engine.formats import FormatError, detect_format, load_dataset, read_npz, read_predictions
from engine.ranking_metrics import PROPENSITY_A, PROPENSITY_B, inv_propensity
from engine.ranking_metrics import evaluate as evaluate_metrics

_ROWS = ("P", "nDCG", "PSP", "PSnDCG")


def _pad_columns(Y: sp.csr_matrix, L: int) -> sp.csr_matrix:
    if Y.shape[1] == L:
        return Y
    return sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(Y.shape[0], L))


def _label_count_known(ds) -> bool:
    """False when L was only inferred as max id + 1 (a text TSV without a label-names file)."""
    return not (ds.source.startswith("text-tsv:") and ds.label_names is None)


def _read_pred(path: str, L: int | None) -> sp.csr_matrix:
    """Text `id:score` lines or an .npz score matrix, every label id checked against L if given."""
    if detect_format(path) == "npz":
        P = read_npz(path)
        if L is None:
            return P
        if P.nnz and int(P.indices.max()) >= L:
            row = int(np.searchsorted(P.indptr, int(np.argmax(P.indices)), side="right")) - 1
            raise FormatError(
                path,
                None,
                f"row {row} predicts label id {int(P.indices.max())} "
                f"but there are only {L} labels (ids 0..{L - 1})",
            )
        return sp.csr_matrix((P.data, P.indices, P.indptr), shape=(P.shape[0], L))
    return read_predictions(path, num_labels=L)


def format_table(metrics: dict[str, float], ks: list[int]) -> str:
    """Metrics as a fixed-width table: one row per metric family, one column per k."""
    lines = ["metric  " + "".join(f"{'@' + str(k):>9}" for k in ks)]
    for name in _ROWS:
        if f"{name}@{ks[0]}" in metrics:
            lines.append(f"{name:<8}" + "".join(f"{metrics[f'{name}@{k}']:9.2f}" for k in ks))
    return "\n".join(lines)


@click.command("evaluate")
@click.option(
    "--test",
    "test_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Test set: text TSV, XC sparse file, or XC raw titles with *_X_Y.txt.",
)
@click.option(
    "--pred",
    "pred_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Predictions: `id:score id:score` lines (one per test point) or an .npz score matrix.",
)
@click.option(
    "--train",
    "train_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Training set, for label propensities (needed for PSP and PSnDCG).",
)
@click.option(
    "--labels",
    "labels_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Label names (or XC label matrix) for TEST when not found next to it.",
)
@click.option(
    "--train-labels",
    "train_labels_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Label names (or XC label matrix) for TRAIN when not found next to it.",
)
@click.option(
    "--A",
    "A",
    type=click.FloatRange(min=0, min_open=True),
    default=PROPENSITY_A,
    show_default=True,
    help="Propensity A (0.6 Amazon, 0.5 Wikipedia).",
)
@click.option(
    "--B",
    "B",
    type=click.FloatRange(min=0, min_open=True),
    default=PROPENSITY_B,
    show_default=True,
    help="Propensity B (2.6 Amazon, 0.4 Wikipedia).",
)
@renamed_option(
    "--max-k",
    "--k",
    "k",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Largest k; reports @1, @3, @5 up to k, and @k.",
)
@renamed_option(
    "--json-out",
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    help="Also write the metrics and run details to this JSON file.",
)
def evaluate(test_path, pred_path, train_path, labels_path, train_labels_path, A, B, k, json_path):
    """Print P@k, nDCG@k, PSP@k and PSnDCG@k (percent) of PRED against TEST.

    Definitions are the Extreme Classification Repository's (pyxclib): points without labels
    count as 0, P@k divides by k, PSP@k is normalised by the best achievable PSP@k. Line i of
    PRED is test point i. PSP needs --train (label frequencies give the propensities).
    """
    try:
        test = load_dataset(test_path, labels_path)
        train = load_dataset(train_path, train_labels_path) if train_path else None
        L = max(test.num_labels, train.num_labels if train else 0)
        known = _label_count_known(test) or (train is not None and _label_count_known(train))
        P = _read_pred(pred_path, L if known else None)
        if not known and P.shape[1] > L:
            L = P.shape[1]  # no label names anywhere: a predicted id above the test's max is a miss
        Y = _pad_columns(test.Y, L)
        P = _pad_columns(P, L)
    except FormatError as e:
        raise click.ClickException(str(e)) from None
    if P.shape[0] != Y.shape[0]:
        raise click.ClickException(
            f"{pred_path} has {P.shape[0]} prediction rows but {test_path} has {Y.shape[0]} "
            "test points; line i of the predictions must be test point i"
        )
    ks = sorted({kk for kk in (1, 3, 5) if kk <= k} | {k})
    inv_prop = None
    if train is not None:
        inv_prop = inv_propensity(train.Y, A=A, B=B, num_labels=L)
    try:
        metrics = evaluate_metrics(Y, P, inv_prop=inv_prop, ks=ks)
    except ValueError as e:
        raise click.ClickException(f"{pred_path}: {e}") from None
    click.echo(
        f"{Y.shape[0]} test points, {L} labels"
        f"{'' if known else ' (inferred from label ids: no label-names file)'}, "
        f"predictions from {pred_path}"
    )
    click.echo(format_table(metrics, ks))
    if train is None or inv_prop is None:
        click.echo(
            "PSP/PSnDCG not computed: they need label propensities from the training "
            "labels; pass --train TRAIN."
        )
    else:
        click.echo(f"propensities from {train_path} ({train.num_points} points, A={A}, B={B})")
    if json_path:
        out = {
            "metrics": metrics,
            "ks": ks,
            "test": str(test_path),
            "pred": str(pred_path),
            "train": str(train_path) if train_path else None,
            "propensity": {"A": A, "B": B} if inv_prop is not None else None,
            "num_points": int(Y.shape[0]),
            "num_labels": int(L),
        }
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        click.echo(f"wrote {json_path}")
