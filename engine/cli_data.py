"""`astec data ...`: inspect data files in any supported format (TSV or XC)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from engine.cli_options import default_of, renamed_option
from engine.debian_packages import build as build_packages


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
@renamed_option(
    "--json-out",
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


@data.command()
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for train.tsv, test.tsv, labels.txt and stats.json.",
)
@click.option(
    "--from",
    "source",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A saved `apt-cache dumpavail` output (default: run apt-cache on this machine).",
)
@click.option(
    "--max-points",
    type=click.IntRange(100, None),
    default=None,
    help="Keep this many packages (a deterministic sample by name hash; default: all).",
)
@click.option(
    "--test-share",
    type=click.FloatRange(0.05, 0.9),
    default=default_of(build_packages, "test_share"),
    show_default=True,
    help="Share of the packages held out in test.tsv.",
)
@click.option(
    "--max-label-share",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=None,
    help="Drop labels that more than this share of packages name (e.g. 0.01 drops libc6 and "
    "the other ubiquitous libraries; default: keep all).",
)
def build(
    out: Path,
    source: str | None,
    max_points: int | None,
    test_share: float,
    max_label_share: float | None,
) -> None:
    """Build the debian-related data set from the Debian package catalogue.

    Points are packages (text: the one-line description), labels the packages they depend on,
    recommend or suggest. Nothing is downloaded: the catalogue is this machine's apt cache.
    """
    from engine.debian_packages import CatalogueError, packages, read_catalogue, write
    from engine.debian_packages import build as build_ds

    try:
        text = read_catalogue(source)
        ds = build_ds(
            packages(text, source or "apt-cache dumpavail"),
            test_share=test_share,
            max_points=max_points,
            max_label_share=max_label_share,
        )
    except CatalogueError as e:
        raise click.ClickException(str(e)) from None
    if not ds.train_texts or not ds.test_texts:
        raise click.ClickException(
            f"{source or 'apt-cache dumpavail'}: too few packages with related packages to "
            "make both a train and a test split"
        )
    st = write(ds, out)
    click.echo(
        f"{out}: {st['N_train']} train / {st['N_test']} test points, {st['L']} labels, "
        f"{st['avg_labels_per_point']} labels/point, {st['avg_words_per_point']} words/point"
    )
