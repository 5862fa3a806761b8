"""Settings for the services and the stream: defaults < services.json < config file < env.

One resolution order lets the same code run on loopback services started by `astec infra up`
(their ports and password are read from DIR/services.json) and against a production Kafka
cluster and Redis (a TOML/JSON config file, or `KAFKA_BOOTSTRAP` / `REDIS_URL` / `ASTEC_*` env).

Code reads a setting from its section (`settings.kafka.bootstrap`, `settings.consumer.group`);
users name it by its flat key (`kafka_bootstrap`, `consumer_group`) in the environment
(`ASTEC_<KEY>`), on the command line and in a config file, which may also group keys by section
(`[kafka] bootstrap = ...`). Each field carries its flat key where it differs from its name, and
its allowed values as a Literal type.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

DEFAULT_SERVICES_DIR = ".astec/services"


class ConfigError(ValueError):
    """A setting could not be read; the message names the source and the field."""


class Secret:
    """A password or a URL holding one: repr and str show '***', so a logged or printed
    Settings never leaks it; `reveal()` hands the value to the client that needs it."""

    __slots__ = ("_value",)
    _value: str

    def __init__(self, value: str = "") -> None:
        object.__setattr__(self, "_value", str(value))

    def reveal(self) -> str:
        return self._value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Secret cannot be changed")

    def __reduce__(self) -> tuple[type, tuple[str]]:
        # copies, and the Settings a spawned worker process receives, carry the value
        return (Secret, (self._value,))

    def __str__(self) -> str:
        return "***" if self._value else ""

    def __repr__(self) -> str:
        return repr(str(self))

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def flat_key(flat: str) -> dict[str, str]:
    """Field metadata: the flat key users write for a field whose name differs from it."""
    return {"key": flat}


def _check_choices(section: Any) -> None:
    """Refuse a value outside its field's Literal type (code that builds Settings directly)."""
    for f in fields(section):
        allowed = _choices(type(section), f.name)
        if allowed and getattr(section, f.name) not in allowed:
            raise ConfigError(
                f"field {f.metadata.get('key', f.name)!r} is {getattr(section, f.name)!r}, "
                f"expected one of {', '.join(allowed)}"
            )


@dataclass(frozen=True, slots=True)
class KafkaConnection:
    """Where the brokers are and how every consumer, producer and admin client of both client
    libraries authenticates to them."""

    bootstrap: str = field(default="127.0.0.1:9092", metadata=flat_key("kafka_bootstrap"))
    security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] = field(
        default="PLAINTEXT", metadata=flat_key("kafka_security_protocol")
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = field(
        default="PLAIN", metadata=flat_key("kafka_sasl_mechanism")
    )
    sasl_username: str = field(default="", metadata=flat_key("kafka_sasl_username"))
    sasl_password: Secret = field(default=Secret(), metadata=flat_key("kafka_sasl_password"))
    ssl_cafile: str = field(default="", metadata=flat_key("kafka_ssl_cafile"))
    ssl_certfile: str = field(default="", metadata=flat_key("kafka_ssl_certfile"))
    ssl_keyfile: str = field(default="", metadata=flat_key("kafka_ssl_keyfile"))

    def __post_init__(self) -> None:
        _check_choices(self)

    def kafka_python_options(self) -> dict[str, Any]:
        """Connection and security keyword arguments for kafka-python's clients."""
        return self._client_options(1)

    def librdkafka_options(self) -> dict[str, Any]:
        """The same connection and security settings in librdkafka's (confluent-kafka's) names."""
        return self._client_options(2)

    def _client_options(self, column: int) -> dict[str, Any]:
        sasl = self.security_protocol.startswith("SASL")
        ssl = self.security_protocol.endswith("SSL")
        out: dict[str, Any] = {}
        for row in KAFKA_CLIENT_OPTIONS:
            value = getattr(self, row[0])
            if (row[3] == "sasl" and not sasl) or (row[3] == "ssl" and not (ssl and value)):
                continue
            out[row[column]] = value.reveal() if isinstance(value, Secret) else value
        return out


# One row per Kafka client setting: (KafkaConnection field, kafka-python keyword, librdkafka
# key, when it is passed). "sasl": with a SASL_* protocol; "ssl": with an *SSL protocol, and
# only when set (each library then falls back to its own default trust store)
KAFKA_CLIENT_OPTIONS: tuple[tuple[str, str, str, Literal["always", "sasl", "ssl"]], ...] = (
    ("bootstrap", "bootstrap_servers", "bootstrap.servers", "always"),
    ("security_protocol", "security_protocol", "security.protocol", "always"),
    ("sasl_mechanism", "sasl_mechanism", "sasl.mechanism", "sasl"),
    ("sasl_username", "sasl_plain_username", "sasl.username", "sasl"),
    ("sasl_password", "sasl_plain_password", "sasl.password", "sasl"),
    ("ssl_cafile", "ssl_cafile", "ssl.ca.location", "ssl"),
    ("ssl_certfile", "ssl_certfile", "ssl.certificate.location", "ssl"),
    ("ssl_keyfile", "ssl_keyfile", "ssl.key.location", "ssl"),
)


@dataclass(frozen=True, slots=True)
class RedisConnection:
    """Where the users' state lives (the URL holds the password) and how safely it is written."""

    # redis:// (one endpoint), redis+sentinel:// or redis+cluster://
    url: Secret = field(default=Secret("redis://127.0.0.1:6379/0"), metadata=flat_key("redis_url"))
    key_prefix: str = field(default="astec", metadata=flat_key("redis_key_prefix"))
    # replicas that must hold a batch's Redis writes before its offsets are committed (WAIT):
    # -1 = 1 where the primary has replicas (a failover then loses no committed visit), 0 = off,
    # n >= 1; a batch the replicas do not acknowledge within wait_timeout_ms is retried
    wait_replicas: int = field(default=-1, metadata=flat_key("redis_wait_replicas"))
    wait_timeout_ms: int = field(default=1000, metadata=flat_key("redis_wait_timeout_ms"))


@dataclass(frozen=True, slots=True)
class Topics:
    """The stream's topics and the shape every stream command requires of them."""

    page_views: str = field(default="page-views", metadata=flat_key("topic_page_views"))
    ad_queries: str = field(default="ad-queries", metadata=flat_key("topic_ad_queries"))
    ad_clicks: str = field(default="ad-clicks", metadata=flat_key("topic_ad_clicks"))
    dead_letters: str = field(default="dead-letters", metadata=flat_key("topic_dead_letters"))
    partitions: int = 4  # more (16, 32) gained little at 500/s and raised the p99 at 1000/s
    # 0: from the cluster's size when a topic is created (stream.topics.replication_for): 3 (with
    # min.insync.replicas 2) on 3+ brokers, 1 / 1 on one; an existing topic of another replication
    # or partition count is refused by every stream command
    replication_factor: int = 0
    min_insync_replicas: int = 0
    # a page view larger than this is a dead letter; producers' request limits derive from it
    max_message_bytes: int = 16384

    def names(self) -> list[str]:
        return [self.page_views, self.ad_queries, self.ad_clicks, self.dead_letters]


@dataclass(frozen=True, slots=True)
class ConsumerSettings:
    """The workers' consumers (short timeouts: a killed worker's partitions move within the
    session timeout) and how they batch and commit."""

    group: str = field(default="astec-stream", metadata=flat_key("consumer_group"))
    # "confluent" (librdkafka: ~0.2 fewer cores at 200-1,000 events/s) or "kafka-python"
    client: Literal["confluent", "kafka-python"] = field(
        default="confluent", metadata=flat_key("consumer_client")
    )
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000
    max_poll_interval_ms: int = 10000
    poll_timeout_ms: int = 20
    # how long the broker may hold a fetch that finds nothing new (it answers as soon as a
    # record arrives, so this adds no latency); short waits make every idle consumer send tens of
    # empty fetches a second, which cost the broker a large share of a core
    fetch_wait_max_ms: int = 500
    # kafka-python consumers: poll sleeps min(poll timeout, retry_backoff_ms) whenever a fetch has
    # just come back empty and no other is in flight, and new records wait out that sleep: its
    # default of 100 ms stalls a paced stream by up to 100 ms
    retry_backoff_ms: int = field(default=20, metadata=flat_key("consumer_retry_backoff_ms"))
    # at-least-once: offsets of settled batches are committed at most this often (and on
    # shutdown / rebalance); exactly-once: one transaction spans every batch of this long (as
    # Kafka Streams' 100 ms), so its commit's round trips are paid once per interval, not per batch
    commit_interval_ms: int = 100
    batch_max: int = 256

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass(frozen=True, slots=True)
class ProducerSettings:
    """The workers' producers: both delivery modes idempotent, acks=all, retried without limit
    within delivery_timeout_ms; a message unacknowledged after it fails the worker, whose
    uncommitted input then replays."""

    client: Literal["confluent", "kafka-python"] = field(
        default="confluent", metadata=flat_key("producer_client")
    )
    linger_ms: int = field(default=2, metadata=flat_key("producer_linger_ms"))
    delivery_timeout_ms: int = 120000

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What a visit gets; a GRU policy must fit it (checked when the stream starts): the topk it
    was trained on == top_k."""

    top_k: int = 10
    # a page whose title holds no word the model knows: "skip" shows no ad (counted in no_query;
    # its state keeps no queries), "prior" shows the learners' prior, the same for every such page
    no_evidence: Literal["skip", "prior"] = "skip"

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass(frozen=True, slots=True)
class StateSettings:
    """What each user's state in Redis keeps and for how long: its last k states (a GRU
    policy's window K must be <= k) and the event ids that dedupe replays."""

    k: int = field(default=16, metadata=flat_key("state_k"))
    ttl_s: int = field(default=30 * 86400, metadata=flat_key("state_ttl_s"))
    dedup_ttl_s: int = 7 * 86400
    # replay window of the dedupe: the last dedup_n event ids per user (8 bytes each) beside the
    # states; a replay older than that many of the user's visits would be stored again
    dedup_n: int = 128


@dataclass(frozen=True, slots=True)
class OpsSettings:
    """What operators see: metrics, health endpoints and the model registry the dashboard shows."""

    models_dir: str = "models"
    metrics_interval_s: float = 1.0
    metrics_port: int = 0  # worker i serves Prometheus metrics on metrics_port + i (0: off)
    # where those metrics, /healthz and /readyz listen: loopback, or "0.0.0.0" (any address of
    # this host) for a Prometheus server on another host
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a service, consumer or producer needs to find and use Kafka and Redis, one
    section per concern. Build variants with `replace(**flat_keys)`."""

    kafka: KafkaConnection = field(default_factory=KafkaConnection)
    redis: RedisConnection = field(default_factory=RedisConnection)
    topics: Topics = field(default_factory=Topics)
    consumer: ConsumerSettings = field(default_factory=ConsumerSettings)
    producer: ProducerSettings = field(default_factory=ProducerSettings)
    prediction: Prediction = field(default_factory=Prediction)
    state: StateSettings = field(default_factory=StateSettings)
    ops: OpsSettings = field(default_factory=OpsSettings)
    # exactly-once (the default): a worker's ad queries, dead letters and input offsets of every
    # batch of a commit interval commit in one Kafka transaction (readers see committed data
    # only), so a crash or a rebalance repeats no answer; an answer becomes visible when its
    # transaction commits (event->ad p50 ~65 ms against ~10 ms). at-least-once: offsets are
    # committed after the outputs are acknowledged; a crash can repeat ad queries (never lose
    # one; the click logger dedupes by event id). Both measured side by side by `astec bench
    # stream --delivery exactly-once --delivery at-least-once` (docs/benchmarks-stream.md)
    delivery: Literal["at-least-once", "exactly-once"] = "exactly-once"
    # where `astec infra up` recorded the loopback services it started (services.json)
    services_dir: str = DEFAULT_SERVICES_DIR

    def __post_init__(self) -> None:
        _check_choices(self)
        python_clients = [
            key
            for key, client in (
                ("consumer_client", self.consumer.client),
                ("producer_client", self.producer.client),
            )
            if client == "kafka-python"
        ]
        if self.delivery == "exactly-once" and python_clients:
            # the worker's transactions (offsets sent with the consumer's group metadata) are
            # built on librdkafka's API only
            raise ConfigError(
                f"delivery 'exactly-once' (also the default) needs the confluent (librdkafka) "
                f"clients, and {' and '.join(python_clients)} is 'kafka-python': set delivery "
                f"(ASTEC_DELIVERY) to at-least-once, or the client(s) to confluent"
            )

    def replace(self, **changes: Any) -> Settings:
        """These settings with some changed, named by their flat keys (`consumer_group=...`)."""
        by_section: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        for flat, raw in changes.items():
            if flat not in _PATHS:
                raise ConfigError(f"unknown setting {flat!r}")
            section, name = _PATHS[flat]
            secret = _kind(flat) is Secret and not isinstance(raw, Secret)
            value = Secret(str(raw)) if secret else raw
            if section:
                by_section.setdefault(section, {})[name] = value
            else:
                top[name] = value
        for section, values in by_section.items():
            top[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **top)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (secrets stay Secret)."""
        return {
            k: getattr(getattr(self, sec), name) if sec else getattr(self, name)
            for k, (sec, name) in _PATHS.items()
        }


SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(Settings)
    if f.default_factory is not dataclasses.MISSING
}


def _flat_paths() -> dict[str, tuple[str, str]]:
    """flat key -> (section, field name); section "" for the top-level fields."""
    out: dict[str, tuple[str, str]] = {}
    for f in fields(Settings):
        if f.name in SECTIONS:
            for g in fields(SECTIONS[f.name]):
                out[g.metadata.get("key", g.name)] = (f.name, g.name)
        else:
            out[f.name] = ("", f.name)
    return out


_PATHS = _flat_paths()
_HINTS = {cls: typing.get_type_hints(cls) for cls in [Settings, *SECTIONS.values()]}


def _choices(cls: type, name: str) -> tuple[str, ...]:
    hint = _HINTS[cls][name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def _kind(flat: str) -> Any:
    section, name = _PATHS[flat]
    return _HINTS[SECTIONS[section] if section else Settings][name]


def _coerce(flat: str, value: Any, source: str) -> Any:
    """Convert a raw value (env strings included) to the field's type, or say where it broke."""
    kind = _kind(flat)
    section, name = _PATHS[flat]
    choices = _choices(SECTIONS[section] if section else Settings, name)
    try:
        if kind is int:
            if isinstance(value, bool):
                raise ValueError("a boolean is not an integer")
            return int(value)
        if kind is float:
            return float(value)
        if kind is str or kind is Secret or choices:
            if not isinstance(value, (str, int, float)):
                raise ValueError(f"expected a string, got {type(value).__name__}")
            if choices and str(value) not in choices:
                raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
            return Secret(str(value)) if kind is Secret else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: field {flat!r}: {exc}") from None
    raise ConfigError(f"{source}: field {flat!r} has unsupported type {kind}")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML or JSON settings file: flat keys, sections (`[kafka] bootstrap = ...`) or
    both, at the top level or in an [astec] / {"astec": ...} table."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a table of settings at the top level")
    if isinstance(data.get("astec"), dict):
        beside = sorted(k for k in data if k in SECTIONS)
        if beside:  # read, they would override [astec]; ignored, they would be lost silently
            raise ConfigError(
                f"{p}: section [{beside[0]}] beside [astec]: write it as [astec.{beside[0]}]"
            )
        data = data["astec"]
    out = {}
    for k, value in data.items():
        if k in SECTIONS and isinstance(value, dict):
            names = {name: flat for flat, (sec, name) in _PATHS.items() if sec == k}
            for name, v in value.items():
                if name not in names:
                    raise ConfigError(
                        f"{p}: unknown setting {name!r} in [{k}] (known: {', '.join(names)})"
                    )
                out[names[name]] = _coerce(names[name], v, f"{p} [{k}]")
            continue
        if k not in _PATHS:
            raise ConfigError(f"{p}: unknown setting {k!r} (known: {', '.join(sorted(_PATHS))})")
        out[k] = _coerce(k, value, str(p))
    return out


def services_overrides(services_dir: str | os.PathLike) -> dict[str, Any]:
    """Bootstrap, SASL credentials and Redis URL of services started by `astec infra up` there."""
    path = Path(services_dir) / "services.json"
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
        out = {
            "kafka_bootstrap": info["kafka"]["bootstrap"],
            "redis_url": Secret(info["redis"]["url"]),
        }
        if info["kafka"].get("sasl_username"):
            out.update(
                kafka_security_protocol="SASL_PLAINTEXT",
                kafka_sasl_mechanism="PLAIN",
                kafka_sasl_username=info["kafka"]["sasl_username"],
                kafka_sasl_password=Secret(info["kafka"]["sasl_password"]),
            )
        return out
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: malformed services record: {exc}") from None


_ENV_ALIASES = {
    "KAFKA_BOOTSTRAP": "kafka_bootstrap",
    "REDIS_URL": "redis_url",
    "KAFKA_SECURITY_PROTOCOL": "kafka_security_protocol",
    "KAFKA_SASL_MECHANISM": "kafka_sasl_mechanism",
    "KAFKA_SASL_USERNAME": "kafka_sasl_username",
    "KAFKA_SASL_PASSWORD": "kafka_sasl_password",
}


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for var, flat in _ENV_ALIASES.items():
        if env.get(var):
            out[flat] = _coerce(flat, env[var], f"environment variable {var}")
    for flat in _PATHS:
        var = f"ASTEC_{flat.upper()}"
        if env.get(var):
            out[flat] = _coerce(flat, env[var], f"environment variable {var}")
    return out


def load_settings(
    config_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Resolve settings: defaults < services.json < config file ($ASTEC_CONFIG) < env < overrides.

    Explicit keyword overrides (from command-line options, by flat key) win over everything;
    None values are ignored so click options can be passed straight through.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    config_file = config_file or env.get("ASTEC_CONFIG") or None
    from_file = read_config_file(config_file) if config_file else {}
    from_env = env_overrides(env)
    services_dir = (
        overrides.get("services_dir")
        or from_env.get("services_dir")
        or from_file.get("services_dir")
        or DEFAULT_SERVICES_DIR
    )
    values.update(services_overrides(services_dir))
    values.update(from_file)
    values.update(from_env)
    for k, value in overrides.items():
        if value is None:
            continue
        if k not in _PATHS:
            raise ConfigError(f"unknown setting {k!r}")
        values[k] = _coerce(k, value, "command line")
    values["services_dir"] = str(services_dir)
    return Settings().replace(**values)


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment variables that make a child process resolve exactly these settings."""
    flat = {k: v.reveal() if isinstance(v, Secret) else str(v) for k, v in settings.flat().items()}
    env = {f"ASTEC_{k.upper()}": v for k, v in flat.items()}
    for var, k in _ENV_ALIASES.items():
        env[var] = flat[k]
    return env
