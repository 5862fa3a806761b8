"""`astec infra up|status|down` starts real services, records them, and stops exactly those PIDs;
settings resolve defaults < config file < env."""

from __future__ import annotations

import json

import pytest
import redis
from click.testing import CliRunner

from infra.cli import cli
from infra.services import pid_alive
from stream.settings import ConfigError, Settings, load_settings
from testkit.paths import REPO


def test_infra_up_status_down(tmp_path):
    runner = CliRunner()
    data_dir = tmp_path / "svc"
    result = runner.invoke(cli, ["infra", "up", "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    info = json.loads((data_dir / "services.json").read_text())
    kpid, rpid = info["kafka"]["pid"], info["redis"]["pid"]
    try:
        assert pid_alive(kpid) and pid_alive(rpid)
        st = runner.invoke(cli, ["infra", "status", "--data-dir", str(data_dir)])
        assert st.exit_code == 0, st.output
        status = json.loads(st.output)
        assert status["kafka"]["answers"] and status["redis"]["answers"]
        assert info["redis"]["password"] not in st.output

        # Redis: loopback, password required, AOF on; settings find the services via the dir
        settings = load_settings(services_dir=str(data_dir), env={})
        assert settings.kafka.bootstrap == f"127.0.0.1:{info['kafka']['port']}"
        client = redis.Redis.from_url(settings.redis.url.reveal())
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=info["redis"]["port"]).ping()
        client.close()

        # a second `up` is idempotent: same processes
        again = runner.invoke(cli, ["infra", "up", "--data-dir", str(data_dir)])
        assert again.exit_code == 0, again.output
        assert json.loads((data_dir / "services.json").read_text())["kafka"]["pid"] == kpid
    finally:
        down = runner.invoke(cli, ["infra", "down", "--data-dir", str(data_dir)])
    assert down.exit_code == 0, down.output
    assert not pid_alive(kpid) and not pid_alive(rpid)
    assert not (data_dir / "services.json").exists()
    st = runner.invoke(cli, ["infra", "status", "--data-dir", str(data_dir)])
    assert st.exit_code == 1


def test_settings_precedence(tmp_path):
    cfg = tmp_path / "astec.toml"
    cfg.write_text('[astec]\nkafka_bootstrap = "broker-a:9092"\npartitions = 12\nstate_k = 8\n')
    s = load_settings(
        cfg,
        env={"KAFKA_BOOTSTRAP": "broker-b:9092", "ASTEC_STATE_K": "32"},
        services_dir=str(tmp_path),
    )
    assert s.kafka.bootstrap == "broker-b:9092"  # env beats file
    assert s.topics.partitions == 12  # file beats default
    assert s.state.k == 32
    assert s.redis.url.reveal() == "redis://127.0.0.1:6379/0"
    assert load_settings(cfg, env={}, state_k=4, services_dir=str(tmp_path)).state.k == 4


def test_settings_errors_name_source_and_field(tmp_path):
    cfg = tmp_path / "bad.json"
    cfg.write_text('{"partitons": 3}')
    with pytest.raises(ConfigError, match=r"bad.json.*'partitons'"):
        load_settings(cfg, env={}, services_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"ASTEC_PARTITIONS.*'partitions'"):
        load_settings(env={"ASTEC_PARTITIONS": "four"}, services_dir=str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"ASTEC_PRODUCER_CLIENT.*'producer_client'.*'librdkafka'"
    ):
        load_settings(env={"ASTEC_PRODUCER_CLIENT": "librdkafka"}, services_dir=str(tmp_path))
    assert (
        load_settings(
            env={"ASTEC_PRODUCER_CLIENT": "kafka-python", "ASTEC_DELIVERY": "at-least-once"},
            services_dir=str(tmp_path),
        ).producer.client
        == "kafka-python"
    )
    with pytest.raises(ConfigError, match=r"ASTEC_CONSUMER_CLIENT.*'consumer_client'.*'rdkafka'"):
        load_settings(env={"ASTEC_CONSUMER_CLIENT": "rdkafka"}, services_dir=str(tmp_path))


def test_consumer_retry_backoff_reaches_every_consumer(tmp_path):
    # kafka-python's poll sleeps min(poll timeout, retry_backoff_ms) after an empty fetch, and
    # records that arrive meanwhile wait: the setting must reach the consumers the stream builds
    from stream.topics import make_consumer

    s = load_settings(env={"ASTEC_CONSUMER_RETRY_BACKOFF_MS": "7"}, services_dir=str(tmp_path))
    assert s.consumer.retry_backoff_ms == 7
    assert (
        Settings().consumer.retry_backoff_ms < 100
    )  # kafka-python's default stalled paced streams
    c = make_consumer(s.replace(kafka_bootstrap="127.0.0.1:1"), [], None, api_version=(2, 5))
    try:
        assert c.config["retry_backoff_ms"] == 7
    finally:
        c.close()


def test_deploy_example_config_loads(tmp_path):
    import os

    path = os.path.join(REPO, "infra", "deploy", "astec.example.toml")
    s = load_settings(
        path, env={"REDIS_URL": "redis://:pw@redis.internal:6379/0"}, services_dir=str(tmp_path)
    )
    assert s.kafka.bootstrap.count(",") == 2 and s.topics.replication_factor == 3
    assert s.redis.url.reveal() == "redis://:pw@redis.internal:6379/0"


def test_a_malformed_record_is_refused_naming_its_file(tmp_path):
    """A truncated or hand-edited record of started processes is one error naming the file,
    never half-trusted (stopping the wrong PIDs)."""
    from infra.redis_topologies import TOPOLOGY_FILE, read_topology
    from infra.services import SERVICES_FILE, ServiceError, read_info

    assert read_info(tmp_path) is None and read_topology(tmp_path) is None
    (tmp_path / SERVICES_FILE).write_text('{"data_dir": "x", "kafka": {"pid": 1')
    (tmp_path / TOPOLOGY_FILE).write_text('{"kind": "sentinel"}')
    with pytest.raises(ServiceError, match=f"{SERVICES_FILE}: malformed services record"):
        read_info(tmp_path)
    with pytest.raises(ServiceError, match=f"{TOPOLOGY_FILE}: malformed Redis topology record"):
        read_topology(tmp_path)
