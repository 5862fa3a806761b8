"""Redis with replicas on loopback: Sentinel (one primary, two replicas, three sentinels) or a
Cluster (three primaries with a replica each), for `astec infra up --redis sentinel|cluster`
and the failover tests.

Every node is a redis-server like the single one of infra.services: loopback only, the same
password (`requirepass`, and `masterauth` so any node can follow a new primary), AOF fsynced as
REDIS_APPENDFSYNC says, each in its own 0700 directory under DIR/redis-<topology>/. The
topology is recorded in DIR/redis-topology.json (0600: PIDs, ports, the URL with its password),
and the `redis.url` of DIR/services.json is pointed at it, so every command that reads the
services finds it: `redis+sentinel://:PW@127.0.0.1:S1,S2,S3/astec` or
`redis+cluster://:PW@127.0.0.1:P1,P2,P3` (stream.redis_connect).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.private_dirs import private_dir
from infra.services import (
    REDIS_APPENDFSYNC,
    SERVICES_FILE,
    Proc,
    ServiceError,
    _is_ours,
    _kill9,
    _spawn,
    _terminate,
    _wait_until,
    _write_private,
    free_port,
    port_in_use,
    read_record,
    redis_binary,
)

TOPOLOGY_FILE = "redis-topology.json"
SERVICE_NAME = "astec"  # the primary's name under Sentinel
TOPOLOGIES = ("single", "sentinel", "cluster")


@dataclass
class Topology:
    kind: str  # "sentinel" or "cluster"
    password: str
    nodes: list[Proc]  # data nodes (Sentinel: the first started as the primary)
    sentinels: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        if self.kind == "sentinel":
            ports = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
            return f"redis+sentinel://:{self.password}@{ports}/{SERVICE_NAME}"
        ports = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"redis+cluster://:{self.password}@{ports}"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "password": self.password,
            "url": self.url,
            "nodes": [asdict(n) for n in self.nodes],
            "sentinels": [asdict(s) for s in self.sentinels],
        }

    @classmethod
    def from_json(cls, d: dict) -> Topology:
        return cls(
            d["kind"],
            d["password"],
            [Proc(**n) for n in d["nodes"]],
            [Proc(**s) for s in d["sentinels"]],
        )


def _client(port: int, password: str):
    import redis

    return redis.Redis(
        host="127.0.0.1", port=port, password=password, socket_timeout=2, socket_connect_timeout=2
    )


def start_node(
    base: Path, password: str, port: int | None = None, *extra: str, timeout: float = 20.0
) -> Proc:
    """One redis-server on loopback in base/node-<port> (password, AOF, no RDB snapshots)."""
    port = port or free_port()
    d = private_dir(base / f"node-{port}")
    log = d / "redis.log"
    proc = _spawn(
        [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--requirepass",
            password,
            "--masterauth",
            password,
            "--appendonly",
            "yes",
            "--appendfsync",
            REDIS_APPENDFSYNC,
            "--dir",
            str(d),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--save",
            "",
            # a new replica syncs at once (the default waits 5 s for others to share the sync)
            "--repl-diskless-sync-delay",
            "0",
            *extra,
        ],
        log,
    )

    def answers() -> bool:
        c = _client(port, password)
        try:
            return bool(c.ping())
        finally:
            c.close()

    try:
        _wait_until(answers, proc, "redis-server", log, timeout)
    except ServiceError:
        _terminate(proc.pid)
        raise
    return Proc(proc.pid, port, redis_binary(), str(log))


def _start_sentinel(base: Path, password: str, primary_port: int, quorum: int) -> Proc:
    port = free_port()
    d = private_dir(base / f"sentinel-{port}")
    conf = d / "sentinel.conf"
    _write_private(
        conf,
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                f"dir {d}",
                "protected-mode yes",
                f"requirepass {password}",
                f"sentinel monitor {SERVICE_NAME} 127.0.0.1 {primary_port} {quorum}",
                f"sentinel auth-pass {SERVICE_NAME} {password}",
                f"sentinel sentinel-pass {password}",
                f"sentinel down-after-milliseconds {SERVICE_NAME} 1000",
                f"sentinel failover-timeout {SERVICE_NAME} 5000",
                f"sentinel parallel-syncs {SERVICE_NAME} 1",
                "",
            ]
        ),
    )
    log = d / "sentinel.log"
    proc = _spawn([redis_binary(), str(conf), "--sentinel"], log)

    def answers() -> bool:
        c = _client(port, password)
        try:
            return c.sentinel_get_master_addr_by_name(SERVICE_NAME) is not None
        finally:
            c.close()

    try:
        _wait_until(answers, proc, "redis sentinel", log, 20.0)
    except ServiceError:
        _terminate(proc.pid)
        raise
    return Proc(proc.pid, port, redis_binary(), str(log))


def _wait(check, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - "not yet"
            last = exc
        time.sleep(0.2)
    raise ServiceError(f"{what} within {timeout:.0f}s (last error: {last})")


def online_replicas(client) -> int:
    info = client.info("replication")
    return sum(1 for i in range(info["connected_slaves"]) if info[f"slave{i}"]["state"] == "online")


def start_sentinel(data_dir: str | Path, password: str, replicas: int = 2) -> Topology:
    """A primary, `replicas` replicas and three sentinels (quorum 2) on free loopback ports."""
    base = private_dir(Path(data_dir).resolve() / "redis-sentinel")
    topo = Topology("sentinel", password, [])
    try:
        primary = start_node(base, password)
        topo.nodes.append(primary)
        for _ in range(replicas):
            topo.nodes.append(
                start_node(base, password, None, "--replicaof", "127.0.0.1", str(primary.port))
            )
        c = _client(primary.port, password)
        _wait(
            lambda: online_replicas(c) == replicas,
            f"{replicas} replicas in sync with the primary",
            30,
        )
        c.close()
        for _ in range(3):
            topo.sentinels.append(_start_sentinel(base, password, primary.port, 2))
        s = _client(topo.sentinels[0].port, password)
        _wait(
            lambda: s.sentinel_master(SERVICE_NAME)["num-other-sentinels"] >= 2,
            "the sentinels finding each other",
            30,
        )
        s.close()
    except BaseException:
        stop_topology_procs(topo)
        raise
    return topo


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free and valid too."""
    while True:
        port = free_port()
        if port <= 55535 and not port_in_use(port + 10000):
            return port


def start_cluster(data_dir: str | Path, password: str, primaries: int = 3) -> Topology:
    """`primaries` primaries with one replica each (redis-cli --cluster create)."""
    redis_cli = shutil.which("redis-cli")
    if not redis_cli:
        raise ServiceError("redis-cli not found on PATH (Debian's redis-tools)")
    base = private_dir(Path(data_dir).resolve() / "redis-cluster")
    topo = Topology("cluster", password, [])
    try:
        for _ in range(2 * primaries):
            port = _cluster_port()
            topo.nodes.append(
                start_node(
                    base,
                    password,
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(base / f"node-{port}" / "nodes.conf"),
                    "--cluster-node-timeout",
                    "2000",
                )
            )
        res = subprocess.run(
            [
                redis_cli,
                "--no-auth-warning",
                "-a",
                password,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in topo.nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if res.returncode != 0:
            raise ServiceError(f"redis-cli --cluster create failed: {res.stdout[-1500:]}")
        for n in topo.nodes:
            c = _client(n.port, password)
            _wait(
                lambda c=c: c.cluster("info")["cluster_state"] == "ok",
                f"cluster state ok on node {n.port}",
                30,
            )
            # each primary's replica in sync before the cluster is used, as under Sentinel
            _wait(
                lambda c=c: c.info("replication")["role"] != "master" or online_replicas(c) >= 1,
                f"the replica of primary {n.port} in sync",
                30,
            )
            c.close()
    except BaseException:
        stop_topology_procs(topo)
        raise
    return topo


def stop_topology_procs(topo: Topology) -> list[str]:
    stopped = []
    for p in [*topo.sentinels, *topo.nodes]:
        if _is_ours(p):
            _terminate(p.pid)
            stopped.append(f"redis {topo.kind} pid {p.pid} port {p.port}")
    return stopped


def kill_node(p: Proc) -> None:
    """SIGKILL one node (a crash, for the failover tests)."""
    if _is_ours(p):
        _kill9(p.pid)


def start_topology(data_dir: str | Path, kind: str, password: str) -> Topology:
    """Start the topology and record it (DIR/redis-topology.json; services.json's redis.url)."""
    d = Path(data_dir).resolve()
    old = read_topology(d)
    if old is not None:
        if old.kind == kind and all(_is_ours(p) for p in [*old.nodes, *old.sentinels]):
            _point_services_at(d, old.url)
            return old
        stop_topology(d)
    topo = start_sentinel(d, password) if kind == "sentinel" else start_cluster(d, password)
    _write_private(d / TOPOLOGY_FILE, json.dumps(topo.to_json(), indent=2))
    _point_services_at(d, topo.url)
    return topo


def _point_services_at(d: Path, url: str) -> None:
    path = d / SERVICES_FILE
    if path.is_file():
        info = json.loads(path.read_text())
        info["redis"]["url"] = url
        _write_private(path, json.dumps(info, indent=2))


def read_topology(data_dir: str | Path) -> Topology | None:
    return read_record(Path(data_dir) / TOPOLOGY_FILE, Topology.from_json, "Redis topology")


def stop_topology(data_dir: str | Path) -> list[str]:
    """Stop exactly the recorded topology's processes and forget it."""
    d = Path(data_dir).resolve()
    topo = read_topology(d)
    if topo is None:
        return []
    stopped = stop_topology_procs(topo)
    (d / TOPOLOGY_FILE).unlink(missing_ok=True)
    return stopped
