"""Settings for the services and the stream: defaults < services.json < config file < env.

One resolution order lets the same code run on loopback services started by `astec infra up`
(their ports and password are read from DIR/services.json) and against a production Kafka
cluster and Redis (a TOML/JSON config file, or `KAFKA_BOOTSTRAP` / `REDIS_URL` / `ASTEC_*` env).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_SERVICES_DIR = ".astec/services"


class ConfigError(ValueError):
    """A setting could not be read; the message names the source and the field."""


@dataclass(frozen=True)
class Settings:
    """Everything a service, consumer or producer needs to find and use Kafka and Redis."""

    kafka_bootstrap: str = "127.0.0.1:9092"
    # Kafka client security, passed to every consumer, producer and admin client of both client
    # libraries (never printed: the password and redis_url are left out of repr)
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str = "PLAIN"
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = field(default="", repr=False)
    kafka_ssl_cafile: str = ""
    kafka_ssl_certfile: str = ""
    kafka_ssl_keyfile: str = ""
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    # at-least-once: offsets are committed after the outputs are acknowledged; a crash can repeat
    # ad queries (never lose one; the click logger dedupes by event id). exactly-once: a worker's
    # ad queries, dead letters and input offsets commit in one Kafka transaction (readers see
    # committed data only). At-least-once is the default: exactly-once's answers become visible
    # when their transaction commits, up to commit_interval_ms (plus a commit) later, and at low
    # rates it spent 1.3-2.7x at-least-once's Kafka time per event (`astec bench stream
    # --delivery ...` measures both; docs/benchmarks-stream.md)
    delivery: str = "at-least-once"
    services_dir: str = DEFAULT_SERVICES_DIR
    # topics
    topic_page_views: str = "page-views"
    topic_ad_queries: str = "ad-queries"
    topic_ad_clicks: str = "ad-clicks"
    topic_dead_letters: str = "dead-letters"
    partitions: int = 4  # more (16, 32) gained little at 500/s and raised the p99 at 1000/s
    # 0: from the cluster's size when a topic is created (stream.topics.replication_for): 3 (with
    # min.insync.replicas 2) on 3+ brokers, 1 / 1 on one; an existing topic of another replication
    # or partition count is refused by every stream command
    replication_factor: int = 0
    min_insync_replicas: int = 0
    # producers (both delivery modes idempotent, acks=all, retried without limit within this):
    # a message unacknowledged after it fails the worker, whose uncommitted input then replays
    delivery_timeout_ms: int = 120000
    # consumers (short timeouts: a killed worker's partitions move within the session timeout)
    consumer_group: str = "astec-stream"
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
    consumer_retry_backoff_ms: int = 20
    # at-least-once: offsets of settled batches are committed at most this often (and on
    # shutdown / rebalance); exactly-once: one transaction spans every batch of this long (as
    # Kafka Streams' 100 ms), so its commit's round trips are paid once per interval, not per batch
    commit_interval_ms: int = 100
    batch_max: int = 256
    # the workers' consumer: "confluent" (librdkafka: ~0.2 fewer cores at 200-1,000 events/s) or
    # "kafka-python"
    consumer_client: str = "confluent"
    # the workers' producer: "confluent" (librdkafka) or "kafka-python", and its linger
    producer_client: str = "confluent"
    producer_linger_ms: int = 2
    max_message_bytes: int = 16384
    # prediction and user state; a GRU policy must fit them (checked when the stream starts):
    # its window K <= state_k, and the topk it was trained on == top_k
    top_k: int = 10
    state_k: int = 16
    state_ttl_s: int = 30 * 86400
    dedup_ttl_s: int = 7 * 86400
    # replay window of the dedupe: the last dedup_n event ids per user (8 bytes each) beside the
    # states; a replay older than that many of the user's visits would be stored again
    dedup_n: int = 128
    # a page whose title holds no word the model knows: "skip" shows no ad (counted in no_query;
    # its state keeps no queries), "prior" shows the learners' prior, the same for every such page
    no_evidence: str = "skip"
    redis_key_prefix: str = "astec"
    models_dir: str = "models"  # the engine registry the dashboard shows
    metrics_interval_s: float = 1.0
    metrics_port: int = 0  # worker i serves Prometheus metrics on metrics_port + i (0: off)
    # where those metrics, /healthz and /readyz listen: loopback, or "0.0.0.0" (any address of
    # this host) for a Prometheus server on another host
    metrics_host: str = "127.0.0.1"
    # replicas that must hold a batch's Redis writes before its offsets are committed (WAIT):
    # -1 = 1 where the primary has replicas (a failover then loses no committed visit), 0 = off,
    # n >= 1; a batch the replicas do not acknowledge within redis_wait_timeout_ms is retried
    redis_wait_replicas: int = -1
    redis_wait_timeout_ms: int = 1000

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"field {name!r} is {getattr(self, name)!r}, expected one of "
                    f"{', '.join(allowed)}"
                )

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    def kafka_python_options(self) -> dict[str, Any]:
        """Connection and security keyword arguments for kafka-python's clients."""
        out: dict[str, Any] = {
            "bootstrap_servers": self.kafka_bootstrap,
            "security_protocol": self.kafka_security_protocol,
        }
        if self.kafka_security_protocol.startswith("SASL"):
            out.update(
                sasl_mechanism=self.kafka_sasl_mechanism,
                sasl_plain_username=self.kafka_sasl_username,
                sasl_plain_password=self.kafka_sasl_password,
            )
        if self.kafka_security_protocol.endswith("SSL"):
            out.update(
                {
                    k: v
                    for k, v in (
                        ("ssl_cafile", self.kafka_ssl_cafile),
                        ("ssl_certfile", self.kafka_ssl_certfile),
                        ("ssl_keyfile", self.kafka_ssl_keyfile),
                    )
                    if v
                }
            )
        return out

    def librdkafka_options(self) -> dict[str, Any]:
        """The same connection and security settings in librdkafka's (confluent-kafka's) names."""
        out: dict[str, Any] = {
            "bootstrap.servers": self.kafka_bootstrap,
            "security.protocol": self.kafka_security_protocol,
        }
        if self.kafka_security_protocol.startswith("SASL"):
            out.update(
                {
                    "sasl.mechanism": self.kafka_sasl_mechanism,
                    "sasl.username": self.kafka_sasl_username,
                    "sasl.password": self.kafka_sasl_password,
                }
            )
        if self.kafka_security_protocol.endswith("SSL"):
            out.update(
                {
                    k: v
                    for k, v in (
                        ("ssl.ca.location", self.kafka_ssl_cafile),
                        ("ssl.certificate.location", self.kafka_ssl_certfile),
                        ("ssl.key.location", self.kafka_ssl_keyfile),
                    )
                    if v
                }
            )
        return out

    def topics(self) -> list[str]:
        return [
            self.topic_page_views,
            self.topic_ad_queries,
            self.topic_ad_clicks,
            self.topic_dead_letters,
        ]


_FIELDS = {f.name: f for f in fields(Settings)}
_CHOICES = {
    "producer_client": ("confluent", "kafka-python"),
    "consumer_client": ("confluent", "kafka-python"),
    "delivery": ("exactly-once", "at-least-once"),
    "no_evidence": ("skip", "prior"),
    "kafka_security_protocol": ("PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"),
    "kafka_sasl_mechanism": ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"),
}
_ENV_ALIASES = {
    "KAFKA_BOOTSTRAP": "kafka_bootstrap",
    "REDIS_URL": "redis_url",
    "KAFKA_SECURITY_PROTOCOL": "kafka_security_protocol",
    "KAFKA_SASL_MECHANISM": "kafka_sasl_mechanism",
    "KAFKA_SASL_USERNAME": "kafka_sasl_username",
    "KAFKA_SASL_PASSWORD": "kafka_sasl_password",
}


def _coerce(name: str, value: Any, source: str) -> Any:
    """Convert a raw value (env strings included) to the field's type, or say where it broke."""
    kind = _FIELDS[name].type
    try:
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError("a boolean is not an integer")
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "str":
            if not isinstance(value, (str, int, float)):
                raise ValueError(f"expected a string, got {type(value).__name__}")
            if name in _CHOICES and str(value) not in _CHOICES[name]:
                raise ValueError(f"{value!r} is not one of {', '.join(_CHOICES[name])}")
            return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: field {name!r}: {exc}") from None
    raise ConfigError(f"{source}: field {name!r} has unsupported type {kind}")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a TOML or JSON settings file (flat keys, or a [astec] / {"astec": ...} table)."""
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
        data = data["astec"]
    out = {}
    for key, value in data.items():
        if key not in _FIELDS:
            raise ConfigError(f"{p}: unknown setting {key!r} (known: {', '.join(sorted(_FIELDS))})")
        out[key] = _coerce(key, value, str(p))
    return out


def services_overrides(services_dir: str | os.PathLike) -> dict[str, Any]:
    """Bootstrap, SASL credentials and Redis URL of services started by `astec infra up` there."""
    path = Path(services_dir) / "services.json"
    if not path.is_file():
        return {}
    try:
        info = json.loads(path.read_text())
        out = {"kafka_bootstrap": info["kafka"]["bootstrap"], "redis_url": info["redis"]["url"]}
        if info["kafka"].get("sasl_username"):
            out.update(
                kafka_security_protocol="SASL_PLAINTEXT",
                kafka_sasl_mechanism="PLAIN",
                kafka_sasl_username=info["kafka"]["sasl_username"],
                kafka_sasl_password=info["kafka"]["sasl_password"],
            )
        return out
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: malformed services record: {exc}") from None


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out = {}
    for var, name in _ENV_ALIASES.items():
        if env.get(var):
            out[name] = env[var]
    for name in _FIELDS:
        var = f"ASTEC_{name.upper()}"
        if env.get(var):
            out[name] = _coerce(name, env[var], f"environment variable {var}")
    return out


def load_settings(
    config_file: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Resolve settings: defaults < services.json < config file ($ASTEC_CONFIG) < env < overrides.

    Explicit keyword overrides (from command-line options) win over everything; None values are
    ignored so click options can be passed straight through.
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
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, value, "command line")
    values["services_dir"] = str(services_dir)
    return Settings(**values)


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment variables that make a child process resolve exactly these settings."""
    env = {f"ASTEC_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(Settings)}
    for var, name in _ENV_ALIASES.items():
        env[var] = str(getattr(settings, name))
    return env
