"""`astec dashboard`: serve the Streamlit app (loopback by default) over resolved settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

APP = Path(__file__).resolve().parent / "app.py"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def streamlit_command(host: str, port: int) -> list[str]:
    """The `streamlit run` argv: headless, no telemetry, no file watcher, no dev mode,
    no deploy button."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--server.fileWatcherType",
        "none",
        "--server.runOnSave",
        "false",
        "--browser.gatherUsageStats",
        "false",
        "--global.developmentMode",
        "false",
        "--client.toolbarMode",
        "viewer",
    ]


@click.command("dashboard")
@click.option(
    "--models",
    "models_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="A model registry (CURRENT + versions/), one of its versions, an exported predictor, "
    "or a directory of runs (default: the models_dir setting, 'models').",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8501, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind. The app has no authentication: keep it on loopback unless "
    "a proxy in front of it authenticates.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Settings file (TOML/JSON), as for `astec stream run`.",
)
@click.option(
    "--redis-url",
    default=None,
    help="Redis with the user states and stream metrics (default: settings / REDIS_URL).",
)
@click.option(
    "--policy",
    "policy_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="GRU policy (version dir or registry) for the users page's chosen query "
    "(default: MODELS/gru, else a `gru` directory beside MODELS as `astec demo` "
    "writes it, else the top1 rule).",
)
@click.option(
    "--logs",
    "logs_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Click log directory (`astec stream log-clicks --out`): visit titles, shown "
    "ad queries and clicks on the users page (default: a `live-logs` directory "
    "beside MODELS or up to two levels above it).",
)
@click.option(
    "--bench",
    "bench_files",
    type=click.Path(exists=True, dir_okay=False),
    multiple=True,
    help="JSON of `astec bench peers --json-out FILE` for the offline "
    "page's comparison with the peers (repeatable).",
)
def dashboard(models_dir, port, host, config_file, redis_url, policy_dir, logs_dir, bench_files):
    """Serve the Streamlit dashboard: predict, users, offline metrics, stream health.

    Reads model artifacts, metrics files and Redis; never trains. Runs `streamlit run` in this
    process (Ctrl-C stops it).
    """
    from dashboard.models import ModelsError, resolve_predictor
    from dashboard.sources import BENCH_ENV, LOGS_ENV, POLICY_ENV, find_logs, find_policy, mask_url
    from stream.settings import ConfigError, load_settings, settings_env

    try:
        settings = load_settings(
            config_file,
            models_dir=str(Path(models_dir).resolve()) if models_dir else None,
            redis_url=redis_url,
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    env = {**os.environ, **settings_env(settings)}
    # given paths travel as env; otherwise the app does the same lookup beside the models
    # (and can say so on the page); printed here so the command line shows what was found
    models = Path(settings.ops.models_dir)
    if policy_dir:
        env[POLICY_ENV] = str(Path(policy_dir).resolve())
    if logs_dir:
        env[LOGS_ENV] = str(Path(logs_dir).resolve())
    policy = env.get(POLICY_ENV) or find_policy(models)
    logs = env.get(LOGS_ENV) or find_logs(models)
    if bench_files:
        env[BENCH_ENV] = os.pathsep.join(str(Path(b).resolve()) for b in bench_files)
    if host not in LOOPBACK:
        click.echo(
            f"warning: serving on {host}, reachable from other hosts; the dashboard has "
            "no authentication",
            err=True,
        )
    click.echo(
        f"dashboard: http://{host}:{port}  (models {settings.ops.models_dir}, Redis "
        f"{mask_url(settings.redis.url.reveal())})",
        err=True,
    )
    try:
        found = resolve_predictor(models).describe()
    except ModelsError as e:  # the offline page can still show run metrics; say what is missing
        found = f"none ({e})"
    click.echo(f"  predictor: {found}", err=True)
    click.echo(
        f"  GRU policy: {policy or 'none found (users page shows the top1 rule; --policy)'}"
        f"\n  click logs: {logs or 'none found (users page shows hashes; --logs)'}"
        f"\n  benchmarks: {', '.join(bench_files) or 'none (--bench)'}",
        err=True,
    )
    sys.stderr.flush()
    cmd = streamlit_command(host, port)
    os.execve(cmd[0], cmd, env)
