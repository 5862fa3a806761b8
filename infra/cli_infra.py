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
    help="Redis port (default: a free one).",
)
@click.option(
    "--redis",
    "redis_topology",
    type=click.Choice(["single", "sentinel", "cluster"]),
    default="single",
    show_default=True,
    help="single: one redis-server; sentinel: a primary, two replicas and three sentinels; "
    "cluster: three primaries with a replica each (infra.redis_topologies). The stream's "
    "commands find it through services.json.",
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
    redis_topology: str,
    create_topics: bool,
) -> None:
    """Start both services, wait until they answer, record them in DATA_DIR/services.json.

    The broker's storage (DATA_DIR/kafka/data) is formatted at the first start and kept: topics,
    messages and committed offsets survive `down`/`up` and a crash."""
    from infra.redis_topologies import start_topology
    from infra.services import ServiceError, start_services

    try:
        info = start_services(data_dir, kafka_port, redis_port)
        topo = (
            start_topology(data_dir, redis_topology, info.redis_password)
            if redis_topology != "single"
            else None
        )
    except ServiceError as exc:
        raise click.ClickException(str(exc)) from None
    if create_topics:
        from stream.settings import load_settings
        from stream.topics import KafkaUnavailable, ensure_topics

        try:
            ensure_topics(load_settings(services_dir=data_dir))
        except KafkaUnavailable as exc:
            raise click.ClickException(str(exc)) from None
    click.echo(
        f"kafka  pid {info.kafka.pid}  bootstrap {info.kafka_bootstrap} (SASL/PLAIN, "
        f"user astec; log {info.kafka.log})"
    )
    click.echo(
        f"redis  pid {info.redis.pid}  port {info.redis.port} (password in "
        f"{os.path.join(info.data_dir, 'services.json')})"
    )
    if topo is not None:
        click.echo(
            f"redis  {topo.kind}: data nodes on ports "
            f"{', '.join(str(n.port) for n in topo.nodes)}"
            + (
                f", sentinels on {', '.join(str(x.port) for x in topo.sentinels)}"
                if topo.sentinels
                else ""
            )
            + " (the stream uses it; the single redis-server above stays for the tools that "
            "restart it)"
        )
    click.echo(
        f"other astec commands find them with --services-dir {info.data_dir} or "
        f"ASTEC_SERVICES_DIR (default {DEFAULT_SERVICES_DIR}), or after "
        f"`eval $(astec infra env --data-dir {info.data_dir})`"
    )


@infra.command()
@_DIR
def down(data_dir: str) -> None:
    """Stop exactly the processes recorded in DATA_DIR/services.json."""
    from infra.redis_topologies import stop_topology
    from infra.services import stop_services

    stopped = stop_topology(data_dir) + stop_services(data_dir)
    click.echo("\n".join(f"stopped {s}" for s in stopped) or "nothing recorded as running")


@infra.command()
@_DIR
def status(data_dir: str) -> None:
    """Print (JSON) whether the recorded services run and answer; exit 1 when not."""
    from infra.services import services_status

    st = services_status(data_dir)
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
