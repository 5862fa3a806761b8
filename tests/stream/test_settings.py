"""Settings: users' keys (environment, config file, command line) keep their flat names while
code reads sections; secrets never print; both Kafka clients get the same connection."""

from __future__ import annotations

import copy
import json
import logging
import pickle

import pytest

from stream.settings import ConfigError, Secret, Settings, load_settings, settings_env

# every key users could set before the settings had sections, with a valid non-default value
FLAT_KEYS = {
    "kafka_bootstrap": "broker-1:9093,broker-2:9093",
    "kafka_security_protocol": "SASL_SSL",
    "kafka_sasl_mechanism": "SCRAM-SHA-512",
    "kafka_sasl_username": "astec-worker",
    "kafka_sasl_password": "kafka-pw-7f3a",
    "kafka_ssl_cafile": "/etc/astec/ca.pem",
    "kafka_ssl_certfile": "/etc/astec/client.pem",
    "kafka_ssl_keyfile": "/etc/astec/client.key",
    "redis_url": "redis://:redis-pw-91c2@redis.internal:6380/2",
    "delivery": "at-least-once",
    "services_dir": "/nonexistent/services",
    "topic_page_views": "pv",
    "topic_ad_queries": "aq",
    "topic_ad_clicks": "ac",
    "topic_dead_letters": "dl",
    "partitions": 8,
    "replication_factor": 3,
    "min_insync_replicas": 2,
    "delivery_timeout_ms": 60000,
    "consumer_group": "g1",
    "session_timeout_ms": 7000,
    "heartbeat_interval_ms": 1500,
    "max_poll_interval_ms": 20000,
    "poll_timeout_ms": 30,
    "fetch_wait_max_ms": 250,
    "consumer_retry_backoff_ms": 15,
    "commit_interval_ms": 200,
    "batch_max": 128,
    "consumer_client": "kafka-python",
    "producer_client": "kafka-python",
    "producer_linger_ms": 5,
    "max_message_bytes": 32768,
    "top_k": 12,
    "state_k": 24,
    "state_ttl_s": 3600,
    "dedup_ttl_s": 1800,
    "dedup_n": 64,
    "no_evidence": "prior",
    "redis_key_prefix": "astec-prod",
    "models_dir": "/srv/models",
    "metrics_interval_s": 2.5,
    "metrics_port": 9400,
    "metrics_host": "0.0.0.0",
    "redis_wait_replicas": 1,
    "redis_wait_timeout_ms": 500,
}
PASSWORDS = ("kafka-pw-7f3a", "redis-pw-91c2")


def _read_back(s: Settings) -> dict:
    return {k: v.reveal() if isinstance(v, Secret) else v for k, v in s.flat().items()}


def test_flat_keys_unchanged_in_env_file_and_command_line(tmp_path):
    assert set(Settings().flat()) == set(FLAT_KEYS)  # no key added, renamed or dropped
    env = {f"ASTEC_{k.upper()}": str(v) for k, v in FLAT_KEYS.items()}
    assert _read_back(load_settings(env=env)) == FLAT_KEYS

    cfg = tmp_path / "astec.json"
    cfg.write_text(json.dumps({"astec": FLAT_KEYS}))
    assert _read_back(load_settings(cfg, env={})) == FLAT_KEYS
    assert _read_back(load_settings(env={}, **FLAT_KEYS)) == FLAT_KEYS

    # the short aliases operators already export
    aliased = load_settings(
        env={
            "KAFKA_BOOTSTRAP": "b:1",
            "REDIS_URL": "redis://:x@r:2/0",
            "KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
            "KAFKA_SASL_USERNAME": "u",
            "KAFKA_SASL_PASSWORD": "p",
            "ASTEC_SERVICES_DIR": str(tmp_path / "none"),
        }
    )
    assert (aliased.kafka.bootstrap, aliased.redis.url.reveal()) == ("b:1", "redis://:x@r:2/0")
    assert (aliased.kafka.sasl_mechanism, aliased.kafka.sasl_password.reveal()) == (
        "SCRAM-SHA-256",
        "p",
    )


def test_config_file_sections_equal_flat_keys(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text(
        'kafka_bootstrap = "b:9092"\nconsumer_group = "g"\nstate_k = 8\n'
        'redis_url = "redis://:pw@r:6379/0"\ndelivery = "at-least-once"\n'
    )
    sectioned = tmp_path / "sections.toml"
    sectioned.write_text(
        'delivery = "at-least-once"\n[kafka]\nbootstrap = "b:9092"\n[consumer]\ngroup = "g"\n'
        '[state]\nk = 8\n[redis]\nurl = "redis://:pw@r:6379/0"\n'
    )
    a = load_settings(flat, env={}, services_dir=str(tmp_path))
    b = load_settings(sectioned, env={}, services_dir=str(tmp_path))
    assert a == b and b.consumer.group == "g" and b.state.k == 8
    nested = tmp_path / "nested.toml"
    nested.write_text('[astec]\nstate_k = 8\n[astec.kafka]\nbootstrap = "b:9092"\n')
    assert load_settings(nested, env={}, services_dir=str(tmp_path)).kafka.bootstrap == "b:9092"
    nested.write_text('[astec]\nstate_k = 8\n[kafka]\nbootstrap = "b:9092"\n')
    with pytest.raises(ConfigError, match=r"nested.toml: section \[kafka\] beside \[astec\]"):
        load_settings(nested, env={}, services_dir=str(tmp_path))
    sectioned.write_text('[kafka]\nbootstrp = "b:9092"\n')
    with pytest.raises(ConfigError, match=r"sections.toml.*'bootstrp' in \[kafka\]"):
        load_settings(sectioned, env={}, services_dir=str(tmp_path))


def test_settings_env_round_trips_every_key():
    s = load_settings(env={}, **FLAT_KEYS)
    env = settings_env(s)
    assert load_settings(env=env) == s
    assert env["REDIS_URL"] == FLAT_KEYS["redis_url"]  # a child process gets the real secret
    assert env["ASTEC_KAFKA_SASL_PASSWORD"] == FLAT_KEYS["kafka_sasl_password"]


def test_secrets_never_print(caplog):
    s = load_settings(env={}, **FLAT_KEYS)
    log = logging.getLogger("astec.test")
    with caplog.at_level(logging.INFO):
        log.info("settings %s / %r / %s", s, s, s.redis)
        log.info(f"{s.kafka} {s.redis.url} {s.kafka.sasl_password!r}")
    shown = [repr(s), str(s), caplog.text, repr(s.flat())]
    for text in shown:
        for pw in PASSWORDS:
            assert pw not in text
    assert "redis.internal" not in repr(s)  # the URL prints as a whole: no part of it
    assert "sasl_password='***'" in repr(s) and str(s.redis.url) == "***"
    assert repr(Settings().kafka.sasl_password) == "''"  # unset shows as unset
    assert s.kafka.sasl_password.reveal() == "kafka-pw-7f3a"
    assert s.redis.url.reveal() == FLAT_KEYS["redis_url"]
    # the workers are spawned processes that receive the settings pickled
    assert pickle.loads(pickle.dumps(s)) == s == copy.deepcopy(s)


@pytest.mark.parametrize(
    ("key", "bad", "allowed"),
    [
        ("delivery", "at-most-once", "at-least-once, exactly-once"),
        ("kafka_security_protocol", "TLS", "PLAINTEXT, SASL_PLAINTEXT, SASL_SSL, SSL"),
        ("kafka_sasl_mechanism", "GSSAPI", "PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
        ("consumer_client", "rdkafka", "confluent, kafka-python"),
        ("producer_client", "librdkafka", "confluent, kafka-python"),
        ("no_evidence", "guess", "skip, prior"),
    ],
)
def test_a_value_outside_its_choices_names_field_and_source(tmp_path, key, bad, allowed):
    none = str(tmp_path / "none")
    var = f"ASTEC_{key.upper()}"
    with pytest.raises(ConfigError, match=rf"environment variable {var}: field '{key}'.*{allowed}"):
        load_settings(env={var: bad}, services_dir=none)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'{key} = "{bad}"\n')
    with pytest.raises(ConfigError, match=rf"bad.toml: field '{key}': '{bad}' is not one of"):
        load_settings(cfg, env={}, services_dir=none)
    with pytest.raises(ConfigError, match=rf"command line: field '{key}'.*{allowed}"):
        load_settings(env={}, services_dir=none, **{key: bad})
    with pytest.raises(ConfigError, match=rf"field '{key}' is '{bad}', expected one of {allowed}"):
        Settings().replace(**{key: bad})


def test_exactly_once_with_a_kafka_python_client_is_refused_with_the_way_out(tmp_path):
    """Exactly-once is the default and needs librdkafka's transactions: a user who picks
    kafka-python gets one line naming the client and the setting to change, before any worker
    starts, not a worker that dies at its first batch."""
    none = str(tmp_path / "none")
    assert Settings().delivery == "exactly-once"
    with pytest.raises(
        ConfigError,
        match=r"'exactly-once' \(also the default\).*consumer_client.*"
        r"ASTEC_DELIVERY\) to at-least-once",
    ):
        load_settings(env={"ASTEC_CONSUMER_CLIENT": "kafka-python"}, services_dir=none)
    with pytest.raises(ConfigError, match=r"producer_client is 'kafka-python'"):
        Settings().replace(producer_client="kafka-python")
    s = load_settings(
        env={"ASTEC_CONSUMER_CLIENT": "kafka-python", "ASTEC_DELIVERY": "at-least-once"},
        services_dir=none,
    )
    assert (s.consumer.client, s.delivery) == ("kafka-python", "at-least-once")


def test_replace_takes_flat_keys_and_refuses_unknown_ones():
    s = Settings().replace(consumer_group="g", state_k=4, redis_url="redis://:pw@h:1/0")
    assert (s.consumer.group, s.state.k, s.redis.url.reveal()) == ("g", 4, "redis://:pw@h:1/0")
    assert s.topics == Settings().topics  # untouched sections stay as they were
    with pytest.raises(ConfigError, match=r"unknown setting 'consumer\.group'"):
        Settings().replace(**{"consumer.group": "g"})


# kafka-python's and librdkafka's options as both were written out by hand before they came
# from one table: the same keys and values for each security protocol
TLS = {"kafka_ssl_cafile": "/ca.pem", "kafka_ssl_certfile": "", "kafka_ssl_keyfile": "/k.pem"}
SASL = {"kafka_sasl_username": "u", "kafka_sasl_password": "p", "kafka_sasl_mechanism": "PLAIN"}


@pytest.mark.parametrize(
    ("protocol", "python_options", "rd_options"),
    [
        ("PLAINTEXT", {}, {}),
        (
            "SASL_PLAINTEXT",
            {"sasl_mechanism": "PLAIN", "sasl_plain_username": "u", "sasl_plain_password": "p"},
            {"sasl.mechanism": "PLAIN", "sasl.username": "u", "sasl.password": "p"},
        ),
        (
            "SASL_SSL",
            {
                "sasl_mechanism": "PLAIN",
                "sasl_plain_username": "u",
                "sasl_plain_password": "p",
                "ssl_cafile": "/ca.pem",
                "ssl_keyfile": "/k.pem",
            },
            {
                "sasl.mechanism": "PLAIN",
                "sasl.username": "u",
                "sasl.password": "p",
                "ssl.ca.location": "/ca.pem",
                "ssl.key.location": "/k.pem",
            },
        ),
        (
            "SSL",
            {"ssl_cafile": "/ca.pem", "ssl_keyfile": "/k.pem"},
            {"ssl.ca.location": "/ca.pem", "ssl.key.location": "/k.pem"},
        ),
    ],
)
def test_both_clients_get_the_same_connection(protocol, python_options, rd_options):
    s = Settings().replace(
        kafka_bootstrap="b:9092", kafka_security_protocol=protocol, **SASL, **TLS
    )
    assert s.kafka.kafka_python_options() == {
        "bootstrap_servers": "b:9092",
        "security_protocol": protocol,
        **python_options,
    }
    assert s.kafka.librdkafka_options() == {
        "bootstrap.servers": "b:9092",
        "security.protocol": protocol,
        **rd_options,
    }
