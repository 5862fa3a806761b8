"""`astec retrain`: a new engine version from click logs, promoted only if it is not worse."""

from __future__ import annotations

import json

import click

from engine.astec.config import AstecConfig, TrainingParams
from engine.cli_options import config_option, default_of
from engine.retrain import RetrainSettings


@click.command("retrain")
@click.option(
    "--logs",
    "log_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Click-log directory (search_clicks/<date>/part-*.jsonl).",
)
@click.option(
    "--models",
    "models_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Registry root: versions/<id>/{model,predictor,data}, CURRENT pointer.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="AstecConfig JSON (nested sections, or the flat field names) overriding the defaults.",
)
@click.option(
    "--min-clicks",
    default=default_of(RetrainSettings, "min_clicks"),
    show_default=True,
    help="Clicks a (page, query) pair needs to be a label.",
)
@click.option(
    "--holdout-days",
    default=default_of(RetrainSettings, "holdout_days"),
    show_default=True,
    help="Newest days of logs kept for evaluation.",
)
@click.option(
    "--metric",
    default=default_of(RetrainSettings, "metric"),
    show_default=True,
    help="Decision metric (P@k, nDCG@k, PSP@k, PSnDCG@k).",
)
@click.option(
    "--tolerance",
    default=default_of(RetrainSettings, "tolerance"),
    show_default=True,
    help="Promote if new >= current - tolerance (metric points, percent).",
)
@click.option(
    "--keep",
    default=default_of(RetrainSettings, "keep"),
    show_default=True,
    help="Versions kept (the current one always is).",
)
@config_option(TrainingParams, "threads", "--threads", type=click.IntRange(0, 256))
@click.option("--quiet", is_flag=True, help="No progress bars.")
def retrain(
    log_dir,
    models_dir,
    config_path,
    min_clicks,
    holdout_days,
    metric,
    tolerance,
    keep,
    threads,
    quiet,
):
    """Train, export and evaluate a new version; switch CURRENT only if it is not worse.

    Safe to kill at any point: CURRENT and complete versions are untouched, and the next run
    removes the half-built staging directory. Prints the decision as JSON.
    """
    from engine.retrain import RetrainError
    from engine.retrain import retrain as run

    try:
        cfg = AstecConfig.load(config_path) if config_path else AstecConfig()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if threads is not None:
        cfg.training.threads = threads
    s = RetrainSettings(
        min_clicks=min_clicks,
        holdout_days=holdout_days,
        metric=metric,
        tolerance=tolerance,
        keep=keep,
        progress=not quiet,
    )
    try:
        res = run(log_dir, models_dir, cfg, s)
    except RetrainError as e:
        raise click.ClickException(str(e)) from None
    out = res.to_dict()
    out["data"] = {k: v for k, v in res.data.items() if k != "read"} | {
        "corrupt_lines_skipped": res.data["read"]["corrupt"]
    }
    click.echo(json.dumps(out, indent=1))
    for p in res.policies_to_retrain:
        click.echo(
            f"GRU policy {p['version']} of {p['registry']} ({p['reason']}, engine "
            f"{p.get('engine_version') or '?'}) does not fit engine {res.version}: the stream "
            f"serves each page's top query until a policy trained on it is promoted: "
            f"astec personalize train --logs {log_dir} --models {models_dir}",
            err=True,
        )
