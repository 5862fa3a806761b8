"""`astec demo`: the whole product on one machine, end to end, on real local services.

It runs the same commands a user would (each step is printed as a command line so it can be
replayed by hand): start Apache Kafka + Redis, simulate a world and its click logs, train Astec from
the search clicks and promote it, train the GRU from the logged ad clicks, then run consumers
over live simulated traffic while the click logger writes the new logs.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import click


def _usable(root: Path, kind: str) -> bool:
    """Whether ROOT's promoted model loads with this code. A model made by an older version can
    be refused (a changed feature set, say): the demo then trains it again instead of failing
    once the stream is running."""
    if not (root / "CURRENT").exists():
        return False
    try:
        if kind == "engine":
            from stream.model_handle import ModelHandle

            ModelHandle.open(str(root))
        else:
            from personalization.policy import GruPolicy

            GruPolicy.load(root)
        return True
    except Exception as e:  # any refusal means: train it again
        click.echo(
            f"{root}: the promoted model does not load with this version ({e}); training it again",
            err=True,
        )
        return False


def _astec(*args: str) -> list[str]:
    return [sys.executable, "-m", "infra.cli", *args]


def _show(cmd: list[str]) -> None:
    shown = ["astec", *cmd[3:]] if cmd[:3] == _astec() else cmd
    click.secho("\n$ " + shlex.join(shown), fg="cyan", bold=True)


def _run(cmd: list[str]) -> None:
    _show(cmd)
    result = subprocess.run(cmd)
    if result.returncode != 0:
        raise click.ClickException(f"step failed (exit {result.returncode}): {shlex.join(cmd)}")


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    _show(cmd)
    click.echo(f"  (background, output in {log})")
    out = open(log, "ab")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@click.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var/demo"),
    show_default=True,
    help="Where the services, world, logs and models go.",
)
@click.option("--queries", default=5000, show_default=True, help="Simulated query catalogue size.")
@click.option("--pages", default=8000, show_default=True, help="Simulated web pages.")
@click.option("--users", default=500, show_default=True, help="Simulated users.")
@click.option("--days", default=2, show_default=True, help="Days of simulated logs to train on.")
@click.option("--rate", default=100.0, show_default=True, help="Live page views per second.")
@click.option("--duration", default=20.0, show_default=True, help="Seconds of live traffic.")
@click.option("--workers", default=2, show_default=True, help="Consumer processes.")
@click.option(
    "--retrain/--no-retrain",
    default=False,
    show_default=True,
    help="Train again even when models from an earlier demo run exist.",
)
@click.option(
    "--keep-services",
    is_flag=True,
    help="Leave Kafka and Redis running afterwards (for `astec dashboard`).",
)
def demo(
    workdir: Path,
    queries: int,
    pages: int,
    users: int,
    days: int,
    rate: float,
    duration: float,
    workers: int,
    retrain: bool,
    keep_services: bool,
) -> None:
    """Run the whole pipeline on the embedded local services, in a few minutes.

    Starts an Apache Kafka broker (KRaft, SASL) and redis-server on loopback, simulates a world and three kinds of
    logs, trains and promotes the Astec engine and the GRU policy, streams live page views
    through WORKERS consumers with the GRU policy, logs the ad clicks, and prints the stream's
    metrics. Everything lands under WORKDIR; nothing listens beyond 127.0.0.1.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    services, world, logs = workdir / "services", workdir / "world", workdir / "logs"
    engine_models, gru_models = workdir / "models" / "engine", workdir / "models" / "gru"
    live_logs = workdir / "live-logs"
    svc = ["--services-dir", str(services)]

    # --retrain trains the models again on the world and logs already there (the logs are
    # append-only: simulating into them again is refused); a fresh --workdir simulates anew
    if not (world / "queries.tsv").exists():
        _run(
            _astec(
                "simulate",
                "world",
                "--out",
                str(world),
                "--queries",
                str(queries),
                "--pages",
                str(pages),
                "--users",
                str(users),
                "--seed",
                "7",
            )
        )
    if not logs.exists():
        _run(
            _astec(
                "simulate",
                "logs",
                "--world",
                str(world),
                "--out",
                str(logs),
                "--days",
                str(days),
                "--seed",
                "7",
            )
        )
    if retrain or not _usable(engine_models, "engine"):
        _run(_astec("retrain", "--logs", str(logs), "--models", str(engine_models)))
    if retrain or not _usable(gru_models, "gru"):
        _run(
            _astec(
                "personalize",
                "train",
                "--logs",
                str(logs),
                "--models",
                str(engine_models),
                "--out",
                str(gru_models),
            )
        )

    _run(_astec("infra", "up", "--data-dir", str(services)))
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            _start(
                _astec(
                    "stream",
                    "run",
                    *svc,
                    "--model",
                    str(engine_models),
                    "--workers",
                    str(workers),
                    "--policy",
                    "gru",
                    "--policy-model",
                    str(gru_models),
                ),
                workdir / "stream-run.log",
            )
        )
        procs.append(
            _start(
                _astec("stream", "log-clicks", *svc, "--out", str(live_logs)),
                workdir / "log-clicks.log",
            )
        )
        time.sleep(5.0)  # let the consumer group settle before traffic starts
        _run(
            _astec(
                "stream",
                "simulate",
                *svc,
                "--world",
                str(world),
                "--rate",
                str(rate),
                "--duration",
                str(duration),
            )
        )
        _run(_astec("stream", "metrics", *svc))
    finally:
        for proc in reversed(procs):
            _stop(proc)
        if not keep_services:
            subprocess.run(_astec("infra", "down", "--data-dir", str(services)))
    click.secho("\nDone.", fg="green", bold=True)
    click.echo(f"Logged impressions and clicks: {live_logs}")
    click.echo("Inspect predictions, users and metrics with:")
    dash = (
        f"ASTEC_SERVICES_DIR={services} astec dashboard --models {engine_models} "
        f"--policy {gru_models} --logs {live_logs}"
    )
    if keep_services:
        click.echo(f"  {dash}")
        click.echo("  (Stream health keeps the stopped workers' last 10 minutes for an hour)")
    else:
        click.echo(f"  astec demo --keep-services && {dash}")
