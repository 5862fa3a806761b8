"""`astec infra up|down|status|env`: the loopback Apache Kafka broker and Redis for one machine."""

from __future__ import annotations

import json
import os

import click

from stream.settings import DEFAULT_SERVICES_DIR

_DIR = click.option(
    "--data-dir",
    default=lambda: os.environ.get("ASTEC_SERVICES_DIR", DEFAULT_SERVICES_DIR),
    show_default=DEFAULT_SERVICES_DIR,
    type=click.Path(file_okay=False),
    help="Where services.json, the broker's data and logs and Redis' AOF live "
    "($ASTEC_SERVICES_DIR).",
)


@click.group()
def infra() -> None:
    """Start/stop the local Apache Kafka broker (KRaft, SASL) and redis-server on loopback."""


@infra.command()
@_DIR
@click.option(
    "--kafka-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Broker port (default: the one of the last start if free, else a free one).",
)
@click.option(
    "--redis-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="The single redis-server's port (default: a free one; not with --redis sentinel|cluster).",
)
@click.option(
    "--brokers",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="Kafka nodes: 1 broker, or a cluster of N KRaft nodes on loopback (3 of them "
    "controllers), each with its own ports, data, log and heap; topics get replication "
    "min(N, 3) and min.insync.replicas 2 from 3 nodes up.",
)
@click.option(
    "--redis",
    "redis_topology",
    type=click.Choice(["single", "sentinel", "cluster"]),
    default="single",
    show_default=True,
    help="single: one redis-server; sentinel: a primary, two replicas and three sentinels; "
    "cluster: three primaries with a replica each (infra.redis_topologies), started in place "
    "of the single one (`up` without --redis goes back to it). The stream's commands find it "
    "through services.json.",
)
@click.option(
    "--create-topics/--no-create-topics",
    default=True,
    show_default=True,
    help="Create the stream topics if they do not exist yet.",
)
def up(
    data_dir: str,
    kafka_port: int | None,
    redis_port: int | None,
    brokers: int,
    redis_topology: str,
    create_topics: bool,
) -> None:
    """Start both services, wait until they answer, record them in DATA_DIR/services.json.

    The broker's storage (DATA_DIR/kafka/data) is formatted at the first start and kept: topics,
    messages and committed offsets survive `down`/`up` and a crash."""
    from infra.redis_topologies import start_topology, stop_topology
    from infra.services import ServiceError, start_services

    single = redis_topology == "single"
    try:
        if brokers > 1 and kafka_port:
            raise ServiceError("--kafka-port names one broker's port: leave it out with --brokers")
        if redis_port and not single:
            raise ServiceError("--redis-port names the single redis-server's port")
        if single:
            stop_topology(data_dir)  # a topology an earlier `up --redis ...` started
        info = start_services(
            data_dir, kafka_port, redis_port, brokers=brokers, single_redis=single
        )
        topo = None if single else start_topology(data_dir, redis_topology, info.redis_password)
    except ServiceError as exc:
        raise click.ClickException(str(exc)) from None
    if create_topics:
        from stream.settings import load_settings
        from stream.topics import KafkaUnavailable, TopicMismatch, ensure_topics

        try:
            ensure_topics(load_settings(services_dir=data_dir))
        except (KafkaUnavailable, TopicMismatch) as exc:
            raise click.ClickException(str(exc)) from None
    for node, proc in enumerate([info.kafka, *info.kafka_nodes], start=1):
        click.echo(f"kafka  node {node} pid {proc.pid}  port {proc.port} (log {proc.log})")
    click.echo(f"kafka  bootstrap {info.kafka_bootstrap} (SASL/PLAIN, user astec)")
    where = f"(password in {os.path.join(info.data_dir, 'services.json')})"
    if info.redis is not None:
        click.echo(f"redis  pid {info.redis.pid}  port {info.redis.port} {where}")
    if topo is not None:
        click.echo(
            f"redis  {topo.kind}: data nodes on ports "
            f"{', '.join(str(n.port) for n in topo.nodes)}"
            + (
                f", sentinels on {', '.join(str(x.port) for x in topo.sentinels)}"
                if topo.sentinels
                else ""
            )
            + f" {where}"
        )
    click.echo(
        f"other astec commands find them with --services-dir {info.data_dir} or "
        f"ASTEC_SERVICES_DIR (default {DEFAULT_SERVICES_DIR}), or after "
        f"`eval $(astec infra env --data-dir {info.data_dir})`"
    )


_NODE = click.option(
    "--node",
    type=click.IntRange(1, 9),
    default=None,
    help="One Kafka node of a cluster (`up --brokers N`), by id 1..N (default: everything).",
)


@infra.command()
@_DIR
@_NODE
@click.option("--kill", is_flag=True, help="With --node: SIGKILL (a crash) instead of SIGTERM.")
def down(data_dir: str, node: int | None, kill: bool) -> None:
    """Stop exactly the processes recorded in DATA_DIR/services.json (or one Kafka node, which
    stays recorded: `astec infra restart --node N` starts it again)."""
    from infra.redis_topologies import stop_topology
    from infra.services import ServiceError, stop_services

    if node is not None:
        from infra.kafka_cluster import kill_node

        try:
            proc = kill_node(data_dir, node, signal_kill=kill)
        except ServiceError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"stopped kafka node {node} pid {proc.pid} port {proc.port}")
        return
    stopped = stop_topology(data_dir) + stop_services(data_dir)
    click.echo("\n".join(f"stopped {s}" for s in stopped) or "nothing recorded as running")


@infra.command()
@_DIR
@_NODE
@click.option("--kill", is_flag=True, help="SIGKILL (a crash) instead of a controlled shutdown.")
@click.option("--down-seconds", type=float, default=0.0, show_default=True)
def restart(data_dir: str, node: int | None, kill: bool, down_seconds: float) -> None:
    """Restart one Kafka node of a cluster, or all of them one after another (a rolling
    restart: each is ready, every broker listed, before the next stops)."""
    from infra.kafka_cluster import restart_nodes
    from infra.services import ServiceError

    try:
        done = restart_nodes(data_dir, [node] if node else None, kill=kill, down_s=down_seconds)
    except ServiceError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"restarted kafka node(s) {', '.join(map(str, done))}")


@infra.command()
@_DIR
def status(data_dir: str) -> None:
    """Print (JSON) whether the recorded services run and answer (each Kafka node of a
    cluster, with the brokers it sees); exit 1 when not."""
    from infra.redis_topologies import read_topology
    from infra.services import _is_ours, read_info, services_status

    st = services_status(data_dir)
    info = read_info(data_dir)
    topo = read_topology(data_dir) if info is not None and info.redis is None else None
    if topo is not None:
        st["redis"]["nodes"] = [
            {"pid": p.pid, "port": p.port, "role": role, "alive": _is_ours(p)}
            for role, procs in (("data", topo.nodes), ("sentinel", topo.sentinels))
            for p in procs
        ]
    if info is not None and info.kafka_nodes:
        from infra.kafka_cluster import nodes_status

        st["kafka_nodes"] = nodes_status(info)
        st["running"] = st["running"] and all(n["ready"] for n in st["kafka_nodes"])
    click.echo(json.dumps(st, indent=2))
    if not st["running"]:
        raise SystemExit(1)


@infra.command()
@_DIR
def env(data_dir: str) -> None:
    """Print `export KAFKA_BOOTSTRAP=... REDIS_URL=...` (and the SASL settings) for the recorded
    services: the output holds passwords, so it is meant for `eval`, not for logs."""
    import shlex

    from infra.redis_topologies import read_topology
    from infra.services import KAFKA_USER, read_info

    info = read_info(data_dir)
    topo = read_topology(data_dir)
    if info is None:
        raise click.ClickException(f"no services recorded in {data_dir} (run `astec infra up`)")
    click.echo(f"export KAFKA_BOOTSTRAP={info.kafka_bootstrap}")
    click.echo(
        "export KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT KAFKA_SASL_MECHANISM=PLAIN "
        f"KAFKA_SASL_USERNAME={KAFKA_USER}"
    )
    click.echo(f"export KAFKA_SASL_PASSWORD={shlex.quote(info.kafka_password)}")
    click.echo(f"export REDIS_URL={shlex.quote(topo.url if topo else info.redis_url)}")
