"""`astec stream run|log-clicks|simulate|metrics`: the online half on Kafka and Redis."""

from __future__ import annotations

import functools
import json

import click

from stream.traffic_options import scenario_options, traffic_options


def settings_options(f):
    """Options shared by every stream command; they override config file and env."""

    @click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        help="TOML/JSON settings file (default $ASTEC_CONFIG).",
    )
    @click.option(
        "--services-dir",
        default=None,
        help="Directory of `astec infra up` (its services.json gives ports, password).",
    )
    @click.option("--bootstrap", default=None, help="Kafka bootstrap servers ($KAFKA_BOOTSTRAP).")
    @click.option(
        "--redis-url",
        default=None,
        help="Redis URL ($REDIS_URL): redis://:PW@HOST:PORT/DB, "
        "redis+sentinel://:PW@H1:P1,H2:P2/SERVICE or redis+cluster://:PW@H1:P1,H2:P2.",
    )
    @click.option("--group", default=None, help="Consumer group id.")
    @functools.wraps(f)
    def wrapper(config_file, services_dir, bootstrap, redis_url, group, **kw):
        from stream.settings import ConfigError, load_settings

        try:
            settings = load_settings(
                config_file,
                services_dir=services_dir,
                kafka_bootstrap=bootstrap,
                redis_url=redis_url,
                consumer_group=group,
            )
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        return f(settings=settings, **kw)

    return wrapper


def checked_model(ctx, param, value):
    """`--model` callback: one clear error naming the file while parsing, before any service or
    worker starts (stream.model_handle.check_model), for every command that serves a model."""
    from engine.manifest import ManifestError
    from engine.model_paths import ModelPathError
    from stream.model_handle import check_model

    try:
        check_model(value)
    except (ManifestError, ModelPathError, OSError) as e:
        raise click.ClickException(str(e)) from None
    return value


def ensure_topics_or_fail(settings) -> None:
    """The stream's topics exist, as the settings describe them, on a broker that answers, or
    one clear error (within seconds)."""
    from stream.topics import KafkaUnavailable, TopicMismatch, ensure_topics

    try:
        ensure_topics(settings)
    except (KafkaUnavailable, TopicMismatch) as exc:
        raise click.ClickException(str(exc)) from None


def check_policy_or_fail(settings, policy: str, policy_model: str | None) -> None:
    """The policy loads and its window fits state_k / top_k, or one clear error before any
    worker starts (each worker would fail on it and be restarted until it gave up)."""
    from personalization.artifact import PolicyFileError
    from stream.policy_handle import make_policy

    try:
        make_policy(policy, policy_model, settings=settings)
    except (ValueError, PolicyFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def stream() -> None:
    """Consumers, producers and the click logger of the streaming ads pipeline."""


@stream.command()
@settings_options
@click.option(
    "--model",
    "model_path",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    callback=checked_model,
    help="A model registry root (CURRENT + versions/: hot-reloaded when a new version is "
    "promoted), one of its versions, or an exported predictor (`astec export`).",
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Consumer processes in the group.",
)
@click.option("--policy", type=click.Choice(["top1", "gru"]), default="top1", show_default=True)
@click.option(
    "--policy-model",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="GRU policy dir or its registry root (for --policy gru).",
)
@click.option("--batch-max", type=int, default=None, help="Max records per batch.")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics, /healthz and /readyz on METRICS_HOST:PORT+i for worker i "
    "(the metrics_host setting, 127.0.0.1 by default; 0: off; default: the metrics_port "
    "setting, 0).",
)
@click.option("--threads", type=int, default=1, show_default=True, help="Math threads per worker.")
@click.option(
    "--delivery",
    type=click.Choice(["exactly-once", "at-least-once"]),
    default=None,
    help="exactly-once: the ad queries, dead letters and input offsets of every batch of "
    "a commit interval commit in one Kafka transaction (answers visible when it commits, "
    "~65 ms p50: see docs/benchmarks-stream.md); "
    "at-least-once: a crash may repeat ad queries (default: the `delivery` "
    "setting, exactly-once).",
)
def run(
    settings, model_path, workers, policy, policy_model, batch_max, metrics_port, threads, delivery
):
    """Consume page views, predict, update user state, produce one ad query per event."""
    from stream.runner import run_workers

    if batch_max:
        settings = settings.replace(batch_max=batch_max)
    if delivery:
        settings = settings.replace(delivery=delivery)
    if metrics_port is not None:
        settings = settings.replace(metrics_port=metrics_port)
    check_policy_or_fail(settings, policy, policy_model)
    ensure_topics_or_fail(settings)
    restarts = run_workers(settings, model_path, policy, policy_model, workers, threads)
    click.echo(f"stopped ({restarts} worker restarts)")


@stream.command("log-clicks")
@settings_options
@click.option(
    "--out",
    "log_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Click-log directory (LOG_DIR/ad_impressions, LOG_DIR/ad_clicks).",
)
@click.option("--max-seconds", type=float, default=None, help="Stop after this long.")
@click.option(
    "--restart/--no-restart",
    default=True,
    show_default=True,
    help="Run the logger in a child process and start it again with backoff if it dies "
    "(broker, Redis or disk failing), as `astec stream run` does for its workers.",
)
def log_clicks(settings, log_dir, max_seconds, restart):
    """Consume ad-queries and ad-clicks into the durable click log; commit after fsync.

    Runs under a supervisor until SIGTERM/SIGINT; a record that cannot be logged goes to the
    dead-letter topic with its reason. Prints the counts (and the number of restarts)."""
    from stream.click_logger import supervise

    ensure_topics_or_fail(settings)
    counts = supervise(settings, log_dir, max_seconds=max_seconds, restart=restart)
    click.echo(json.dumps(counts))


def _since(ctx, param, value):
    """--since: seconds since the epoch, or an ISO 8601 time (UTC unless it names a zone)."""
    from datetime import UTC, datetime

    if value is None:
        return 0.0
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is neither seconds since the epoch nor an ISO 8601 time"
        ) from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


@stream.command("replay-dead-letters")
@settings_options
@click.option(
    "--reason",
    required=True,
    help="Replay the dead letters whose reason contains this text (e.g. 'Redis', 'predict').",
)
@click.option(
    "--since",
    callback=_since,
    default=None,
    help="Only dead letters written at or after this time (epoch seconds or ISO 8601).",
)
@click.option("--dry-run", is_flag=True, help="Count what would be replayed; send nothing.")
def replay_dead_letters_cmd(settings, reason, since, dry_run):
    """Send matching dead letters back to their source topic (each event once per run; the
    workers and the click logger are idempotent by event id, so a replay counts nothing
    twice). Prints the counts (JSON)."""
    from stream.dead_letter_replay import replay_dead_letters

    ensure_topics_or_fail(settings)
    try:
        counts = replay_dead_letters(settings, reason, since, dry_run)
    except TimeoutError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(json.dumps(counts))


@stream.command()
@settings_options
def metrics(settings):
    """Print every live consumer's metrics (JSON lines) from Redis."""
    import redis

    from stream.consumer_metrics import read_all
    from stream.state_store import connect, redis_address

    try:
        snaps = read_all(connect(settings.redis.url.reveal(), retries=1), settings.redis.key_prefix)
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError) as e:
        raise click.ClickException(
            f"no Redis answers at {redis_address(settings.redis.url.reveal())} ({e}): start one "
            "with "
            "`astec infra up` or set REDIS_URL (or --services-dir)"
        ) from None
    if not snaps:
        click.echo(
            f"no consumer has published metrics under '{settings.redis.key_prefix}' in the last "
            "minutes: is `astec stream run` running against this Redis?",
            err=True,
        )
    for m in snaps:
        click.echo(json.dumps(m))


@stream.command()
@settings_options
@click.option(
    "--world",
    "world_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="World directory (`astec simulate world`).",
)
@traffic_options(rate=200.0, duration=30.0, warmup=0.0)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--drain",
    type=click.FloatRange(min=0),
    default=15.0,
    show_default=True,
    help="Seconds to wait for the last ad queries after sending.",
)
@scenario_options
def simulate(settings, world_dir, rate, duration, warmup, seed, drain, scenario, known_model):
    """Produce page views from simulated users; answer ad queries with clicks (click model)."""
    from simulator.cli_simulate import resolve_scenario
    from stream.live_sim import known_words, run_simulation

    sc = resolve_scenario(scenario, world_dir)
    known = known_words(known_model) if known_model else None
    ensure_topics_or_fail(settings)
    click.echo(
        json.dumps(
            run_simulation(
                settings,
                world_dir,
                rate,
                duration,
                seed,
                drain,
                warmup_s=warmup,
                scenario=sc,
                known=known,
            )
        )
    )
