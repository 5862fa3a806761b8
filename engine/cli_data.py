"""`astec data ...`: inspect data files in any supported format (TSV or XC)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.group()
def data() -> None:
    """Inspect data sets (text TSV, Extreme Classification Repository formats)."""


@data.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--labels",
    "labels",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Label names (line i = label i; default: a sibling labels.txt / Y.txt), or the "
    "*_X_Y.txt label matrix for a titles or *_X_Xf.txt file.",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the figures to this JSON file.",
)
def stats(path: str, labels: str | None, json_out: str | None) -> None:
    """Print N, L, labels/point, points/label, label-frequency quantiles of PATH."""
    from engine.datastats import dataset_stats, format_stats
    from engine.formats import FormatError, load_dataset

    try:
        ds = load_dataset(path, labels)
    except (FormatError, OSError) as e:
        raise click.ClickException(str(e)) from None
    figures = {"source": ds.source, **dataset_stats(ds.Y, ds.texts, ds.X)}
    click.echo(format_stats(figures))
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
