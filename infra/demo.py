"""`astec demo`: the whole product on one machine, end to end, on real local services.

It runs the same commands a user would (each step is printed as a command line so it can be
replayed by hand): start Apache Kafka + Redis, simulate a world and its click logs, train Astec from
the search clicks and promote it, train the GRU from the logged ad clicks, then run consumers
over live simulated traffic while the click logger writes the new logs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from stream.settings import load_settings
from stream.traffic_options import traffic_options


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
    except Exception as e:  # noqa: BLE001 - any refusal means: train it again
        click.echo(
            f"{root}: the promoted model does not load with this version ({e}); training it again",
            err=True,
        )
        return False


def _evaluate_current(engine_models: Path) -> None:
    """`astec evaluate --json-out` of the promoted version on its held-out file, into the version
    directory, where the dashboard's offline page finds it (P@k against k, each label-frequency
    bin's share of P@5). Skipped, saying so, while the version's data/test.tsv is empty."""
    from engine.registry import Registry

    vdir = Registry(engine_models).current_path()
    if vdir is None or (vdir / "eval_test.json").exists():
        return
    data = vdir / "data"
    test = data / "test.tsv"
    if not test.is_file() or test.stat().st_size == 0:
        click.echo(f"{test}: no held-out points; the offline bins are not computed", err=True)
        return
    pred = vdir / "test.pred"
    _run(_astec("predict", "--model", str(vdir), "--input", str(test), "--out", str(pred)))
    _run(
        _astec(
            "evaluate",
            "--test",
            str(test),
            "--pred",
            str(pred),
            "--train",
            str(data / "train.tsv"),
            "--json-out",
            str(vdir / "eval_test.json"),
        )
    )


def _astec(*args: str) -> list[str]:
    return [sys.executable, "-m", "infra.cli", *args]


def _show(cmd: list[str]) -> None:
    shown = ["astec", *cmd[3:]] if cmd[:3] == _astec() else cmd
    click.secho("\n$ " + shlex.join(shown), fg="cyan", bold=True)


def _run(cmd: list[str]) -> None:
    _show(cmd)
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise click.ClickException(f"step failed (exit {result.returncode}): {shlex.join(cmd)}")


def _run_or_say(cmd: list[str]) -> bool:
    """_run for an optional step: a failure is one line and the demo goes on."""
    try:
        _run(cmd)
        return True
    except click.ClickException as e:
        click.echo(f"(optional step skipped: {e.message})", err=True)
        return False


def _start(cmd: list[str], log: Path, nice: int = 0) -> subprocess.Popen:
    """CMD in the background; NICE > 0 lowers its CPU priority (work off the latency path)."""
    _show(cmd)
    click.echo(f"  (background{f', nice {nice}' if nice else ''}, output in {log})")
    if nice and shutil.which("nice"):
        cmd = ["nice", "-n", str(nice), *cmd]
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_workers(services: Path, supervisor: subprocess.Popen, workers: int) -> None:
    """Until every worker of SUPERVISOR owns partitions: traffic sent while the group is still
    rebalancing is answered twice (a batch in flight when its partition moves is replayed)."""
    import psutil

    from stream.consumer_metrics import partitions_shared, read_all
    from stream.state_store import connect

    s = load_settings(services_dir=str(services))
    client = connect(s.redis.url.reveal())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if supervisor.poll() is not None:
            raise click.ClickException(f"`astec stream run` exited ({supervisor.returncode})")
        try:
            ours = {c.pid for c in psutil.Process(supervisor.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            ours = set()
        ms = [m for m in read_all(client, s.redis.key_prefix) if int(m["pid"]) in ours]
        if partitions_shared(ms, workers, s.topics.partitions):
            return
        time.sleep(0.5)
    click.echo("the workers have not shared the partitions within 120 s; sending anyway", err=True)


def _show_ads(live_logs: Path, engine_models: Path, n: int = 8) -> None:
    """A few served ads to judge by eye: the page, Astec's best query for the page alone, the
    query the GRU chose from the user's last pages, the visit it came from ("this page", or
    "2 visits ago: <title>") and the policy's margin over the page's own top query (a choice
    from an earlier page with a margin is personalization; an unrelated one is visible too)."""
    from engine.clicklog import ad_outcomes
    from personalization.explain import describe_source
    from stream.model_handle import ModelHandle

    rows = list(ad_outcomes(live_logs))
    if not rows:
        return
    titles = {r["event_id"]: r.get("title") for r in rows}
    rows = rows[:: max(1, len(rows) // n)][:n]
    pred = ModelHandle.open(str(engine_models)).predictor
    ids, _, _ = pred.predict_with_features([r["title"] for r in rows], 1)
    click.secho(
        f"\n{'page title':<40} {'Astec top query':<24} {'ad shown (GRU)':<24} {'margin':>7}  from",
        bold=True,
    )
    for r, top in zip(rows, ids, strict=True):
        best = pred.label_names[int(top[0])] if int(top[0]) >= 0 else "(none)"
        mark = "  [clicked]" if r["clicked"] else ""
        ago = r.get("source_visits_ago")
        src = describe_source(ago, titles.get(r.get("source_event_id") or ""))
        margin = f"{r['margin']:+.3f}" if r.get("margin") is not None else "-"
        click.echo(
            f"{r['title'][:39]:<40} {best[:23]:<24} {r['query'][:23]:<24} {margin:>7}  "
            f"{src[:60] or '-'}{mark}"
        )


@click.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var/demo"),
    show_default=True,
    help="Where the services, world, logs and models go.",
)
@click.option(
    "--world-from",
    type=click.Choice(["debian", "synthetic"]),
    default="debian",
    show_default=True,
    help="debian: pages are this machine's Debian package descriptions (`apt-cache dumpavail`) "
    "and queries the packages they relate to, real text to judge by eye; synthetic: made-up "
    "words at any scale (--queries, --pages).",
)
@click.option(
    "--pages",
    type=click.IntRange(100, None),
    default=10000,
    show_default=True,
    help="Web pages (debian: packages sampled from the catalogue).",
)
@click.option(
    "--queries",
    type=click.IntRange(10, None),
    default=5000,
    show_default=True,
    help="Query catalogue size (synthetic only; debian: the related packages).",
)
@click.option(
    "--users", type=click.IntRange(1, None), default=500, show_default=True, help="Simulated users."
)
@click.option(
    "--days",
    type=click.IntRange(1, 60),
    default=2,
    show_default=True,
    help="Days of simulated logs to train on.",
)
@traffic_options(rate=100.0, duration=20.0, warmup=5.0)  # passed on to `astec stream simulate`
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Consumer processes.",
)
@click.option(
    "--retrain/--no-retrain",
    default=False,
    show_default=True,
    help="Train again even when models from an earlier demo run exist.",
)
@click.option(
    "--keep-services",
    is_flag=True,
    help="Leave Kafka, Redis, the workers and the click logger running afterwards (for "
    "`astec dashboard`); the commands to add traffic and to stop everything are printed. "
    "Once per work directory it also runs `astec bench peers` on the data set (~2 min) for "
    "the dashboard's comparison with the peers.",
)
def demo(
    workdir: Path,
    world_from: str,
    pages: int,
    queries: int,
    users: int,
    days: int,
    rate: float,
    duration: float,
    warmup: float,
    workers: int,
    retrain: bool,
    keep_services: bool,
) -> None:
    """Run the whole pipeline on the embedded local services, in a few minutes.

    Starts an Apache Kafka broker (KRaft, SASL) and redis-server on loopback, builds a world of
    real web pages (this machine's Debian package descriptions; --world-from synthetic for
    made-up words at any scale) and three kinds of logs, trains and promotes the Astec engine and
    the GRU policy, streams live page views through WORKERS consumers with the GRU policy, logs
    the ad clicks, and prints the stream's metrics and a few of the ads served. Everything lands
    under WORKDIR; nothing listens beyond 127.0.0.1.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    services, world, logs = workdir / "services", workdir / "world", workdir / "logs"
    engine_models, gru_models = workdir / "models" / "engine", workdir / "models" / "gru"
    live_logs = workdir / "live-logs"
    svc = ["--services-dir", str(services)]

    # --retrain trains the models again on the world and logs already there (the logs are
    # append-only: simulating into them again is refused); a fresh --workdir simulates anew
    if world_from == "debian" and shutil.which("apt-cache") is None:
        click.echo("apt-cache not found (not a Debian-family machine): a synthetic world", err=True)
        world_from = "synthetic"
    if not (world / "queries.tsv").exists():
        if world_from == "debian":
            data = workdir / "data"
            # libraries most packages depend on (libc6: 40%) are plumbing, not interests
            _run(
                _astec(
                    "data",
                    "build",
                    "--out",
                    str(data),
                    "--max-points",
                    str(pages),
                    "--max-label-share",
                    "0.01",
                )
            )
            shape = ["--from-dataset", str(data)]
        else:
            shape = ["--queries", str(queries), "--pages", str(pages)]
        _run(
            _astec(
                "simulate",
                "world",
                "--out",
                str(world),
                *shape,
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

    _evaluate_current(engine_models)
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
                # the logger only feeds the next retrain: on 2 cores it took ~20% of one at
                # 100 page views/s, beside the workers, the broker and the simulator
                nice=10,
            )
        )
        _wait_workers(services, procs[0], workers)
        # latency on a shared machine depends on what else runs: say so beside the figures
        load1 = os.getloadavg()[0]
        click.echo(
            f"load average {load1:.1f} on {os.cpu_count()} cores before the traffic "
            "(other processes compete with the stream for them)"
        )
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
                "--warmup",
                str(warmup),
                "--model",  # a page the engine knows no word of gets no ad: no_ad, not unanswered
                str(engine_models),
            )
        )
        _run(_astec("stream", "metrics", *svc))
    except BaseException:
        if keep_services:  # a failed step still leaves them running: say how to stop them
            pids = " ".join(str(p.pid) for p in procs)
            click.echo(f"Stop the services: kill {pids} && astec infra down --data-dir {services}")
        raise
    finally:
        if not keep_services:
            for proc in reversed(procs):
                _stop(proc)
            subprocess.run(_astec("infra", "down", "--data-dir", str(services)), check=False)
    _show_ads(live_logs, engine_models)
    peers = workdir / "bench" / "peers.json"
    has_data = (workdir / "data" / "train.tsv").is_file()
    if keep_services and has_data and not peers.exists():
        # for the dashboard's offline page (Astec against its peers), after the timed traffic;
        # once per work directory (~2 min on 2 cores). Not fatal: the services keep running and
        # the commands to use and stop them must still be printed
        peers.parent.mkdir(parents=True, exist_ok=True)
        _run_or_say(
            _astec(
                "bench",
                "peers",
                "--train",
                str(workdir / "data" / "train.tsv"),
                "--test",
                str(workdir / "data" / "test.tsv"),
                "--json-out",
                str(peers),
            )
        )
    click.secho("\nDone.", fg="green", bold=True)
    click.echo(f"Logged impressions and clicks: {live_logs}")
    click.echo("Inspect predictions, users and metrics with:")
    dash = (
        f"ASTEC_SERVICES_DIR={services} astec dashboard --models {engine_models} "
        f"--policy {gru_models} --logs {live_logs}"
        # a later `--keep-services` run writes it for a world built from a data set
        + (f" --bench {peers}" if peers.exists() or (not keep_services and has_data) else "")
    )
    if keep_services:
        pids = " ".join(str(p.pid) for p in procs)
        click.echo(f"  {dash}")
        click.echo("More traffic (the workers and the click logger keep running):")
        click.echo(f"  astec stream simulate {shlex.join(svc)} --world {world} --duration 300")
        click.echo("Stop everything:")
        click.echo(f"  kill {pids} && astec infra down --data-dir {services}")
    else:
        # the same work directory: the dashboard command names this run's artefacts
        click.echo(f"  astec demo --workdir {shlex.quote(str(workdir))} --keep-services && {dash}")
