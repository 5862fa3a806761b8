"""`astec infra up --redis sentinel|cluster` starts the topology and no single redis-server
beside it: services.json names only the topology's URL, `status` checks it through that URL and
lists its nodes, `down` stops every node, and `up` without --redis goes back to one server."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infra.cli import cli
from infra.services import pid_alive
from stream.settings import load_settings
from stream.state_store import connect

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]


@pytest.mark.parametrize(("topology", "nodes"), [("sentinel", 6), ("cluster", 6)])
def test_infra_up_with_a_topology_starts_no_single_redis(tmp_path, topology, nodes):
    runner = CliRunner()
    d = tmp_path / "svc"
    args = ["--data-dir", str(d)]
    up = runner.invoke(cli, ["infra", "up", *args, "--redis", topology, "--no-create-topics"])
    assert up.exit_code == 0, up.output
    try:
        info = json.loads((d / "services.json").read_text())
        topo = json.loads((d / "redis-topology.json").read_text())
        assert "pid" not in info["redis"] and "port" not in info["redis"]
        assert info["redis"]["url"] == topo["url"]
        assert info["redis"]["url"].startswith(f"redis+{topology}://")
        assert not (d / "redis").exists(), "the single redis-server's directory was made"
        pids = [p["pid"] for p in topo["nodes"] + topo["sentinels"]]
        assert len(pids) == nodes and all(map(pid_alive, pids))

        # the stream's settings find the topology, and it stores
        s = load_settings(services_dir=str(d), env={})
        assert s.redis.url.reveal() == topo["url"]
        client = connect(s.redis.url.reveal())
        client.set("{t}:k", b"v")
        assert client.get("{t}:k") == b"v"
        client.close()

        st = runner.invoke(cli, ["infra", "status", *args])
        assert st.exit_code == 0, st.output
        status = json.loads(st.output)
        assert status["redis"]["answers"] and status["redis"]["topology"] == f"redis+{topology}"
        assert sorted(n["pid"] for n in status["redis"]["nodes"]) == sorted(pids)
        assert all(n["alive"] for n in status["redis"]["nodes"])
        assert topo["password"] not in st.output

        env = runner.invoke(cli, ["infra", "env", *args])
        assert f"REDIS_URL={topo['url']}" in env.output.replace("'", "")

        # a second `up` keeps the same processes
        again = runner.invoke(
            cli, ["infra", "up", *args, "--redis", topology, "--no-create-topics"]
        )
        assert again.exit_code == 0, again.output
        assert json.loads((d / "redis-topology.json").read_text())["nodes"] == topo["nodes"]
        assert "pid" not in json.loads((d / "services.json").read_text())["redis"]

        # back to one redis-server: the topology is stopped, the single server recorded
        single = runner.invoke(cli, ["infra", "up", *args, "--no-create-topics"])
        assert single.exit_code == 0, single.output
        info = json.loads((d / "services.json").read_text())
        assert info["redis"]["url"].startswith("redis://") and pid_alive(info["redis"]["pid"])
        assert not (d / "redis-topology.json").exists() and not any(map(pid_alive, pids))
        pids = [info["redis"]["pid"], info["kafka"]["pid"]]
    finally:
        down = runner.invoke(cli, ["infra", "down", *args])
    assert down.exit_code == 0, down.output
    assert not any(map(pid_alive, pids))
    assert runner.invoke(cli, ["infra", "status", *args]).exit_code == 1
