"""A local Apache Kafka cluster of N KRaft nodes on loopback (`astec infra up --brokers N`).

Nodes 1..min(N, 3) are broker and controller (a quorum of 3 from three nodes up: one node can
be lost), the others brokers only. Every node has its own ports, data and log directories under
DIR/kafka-cluster/node-<id>/, its own bounded heap (ASTEC_KAFKA_HEAP) and SASL/PLAIN on both
listeners; the cluster id, ports and the password are kept in DIR/kafka-cluster/state.json, so
a node restarted after a crash finds its storage and its ports. The internal topics (offsets,
transactions) are replicated min(N, 3) times with min.insync.replicas 2 from three nodes up,
like the stream's own topics (stream.topics.replication_for). Readiness: every node answers a
metadata request that lists all N brokers.

infra.services records the nodes in DIR/services.json beside Redis (node 1 as `kafka`, the
others in `kafka.nodes`); `stop_node`, `restart_node` and `leader_of` are the fault tests' and
operators' handles on one node.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from engine.private_dirs import private_dir
from infra.services import (
    _LOG4J2,
    KAFKA_USER,
    Proc,
    ServiceError,
    _cluster_id,
    _is_ours,
    _kill9,
    _terminate,
    _wait_port_free,
    _write_private,
    format_storage,
    free_port,
    java_binary,
    kafka_classpath,
    port_in_use,
    spawn_kafka,
)

CLUSTER_DIR = "kafka-cluster"
QUORUM = 3  # controllers at most (KRaft voters)

log = logging.getLogger(__name__)


def cluster_dir(data_dir: Path) -> Path:
    return Path(data_dir) / CLUSTER_DIR


def _state(cdir: Path, brokers: int) -> dict:
    """Cluster id, password and each node's ports: chosen at the first start, kept after."""
    path = cdir / "state.json"
    if path.is_file():
        try:
            state = json.loads(path.read_text())
        except ValueError as exc:
            raise ServiceError(f"{path}: malformed cluster state: {exc}") from None
        if len(state["nodes"]) != brokers:
            raise ServiceError(
                f"{cdir} holds a cluster of {len(state['nodes'])} nodes, not {brokers}: "
                f"start it with --brokers {len(state['nodes'])} or use another --data-dir"
            )
        return state
    taken: set[int] = set()

    def port() -> int:
        p = free_port()
        while p in taken:
            p = free_port()
        taken.add(p)
        return p

    return {
        "cluster_id": _cluster_id(),
        "password": secrets.token_hex(16),
        "nodes": {
            str(i): {"port": port(), "controller_port": port()} for i in range(1, brokers + 1)
        },
    }


def _properties(cdir: Path, node: int, state: dict) -> str:
    nodes = state["nodes"]
    n = len(nodes)
    voters = range(1, min(n, QUORUM) + 1)
    controller = node in voters
    rf, isr = min(n, 3), (2 if n >= 3 else 1)
    me = nodes[str(node)]
    jaas = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{KAFKA_USER}" password="{state["password"]}" '
        f'user_{KAFKA_USER}="{state["password"]}";'
    )
    listeners = f"CLIENT://127.0.0.1:{me['port']}"
    if controller:
        listeners += f",CONTROLLER://127.0.0.1:{me['controller_port']}"
    return "\n".join(
        [
            f"process.roles={'broker,controller' if controller else 'broker'}",
            f"node.id={node}",
            "controller.quorum.voters="
            + ",".join(f"{v}@127.0.0.1:{nodes[str(v)]['controller_port']}" for v in voters),
            f"listeners={listeners}",
            f"advertised.listeners=CLIENT://127.0.0.1:{me['port']}",
            "listener.security.protocol.map=CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=CLIENT",
            "sasl.enabled.mechanisms=PLAIN",
            "sasl.mechanism.inter.broker.protocol=PLAIN",
            "sasl.mechanism.controller.protocol=PLAIN",
            f"listener.name.client.plain.sasl.jaas.config={jaas}",
            f"listener.name.controller.plain.sasl.jaas.config={jaas}",
            f"log.dirs={cdir / f'node-{node}' / 'data'}",
            "num.partitions=4",
            f"default.replication.factor={rf}",
            f"min.insync.replicas={isr}",
            f"offsets.topic.replication.factor={rf}",
            "offsets.topic.num.partitions=8",
            f"transaction.state.log.replication.factor={rf}",
            f"transaction.state.log.min.isr={isr}",
            "transaction.state.log.num.partitions=8",
            f"share.coordinator.state.topic.replication.factor={rf}",
            f"share.coordinator.state.topic.min.isr={isr}",
            "unclean.leader.election.enable=false",
            "group.initial.rebalance.delay.ms=0",
            "num.network.threads=2",
            "num.io.threads=2",
            "log.retention.hours=168",
            "",
        ]
    )


def _prepare(data_dir: Path, brokers: int) -> dict:
    """Write every node's files (formatting its storage the first time); returns the state."""
    java, cp = java_binary(), kafka_classpath()
    cdir = private_dir(cluster_dir(data_dir))
    state = _state(cdir, brokers)
    _write_private(cdir / "state.json", json.dumps(state, indent=2))
    for node in range(1, brokers + 1):
        ndir = private_dir(cdir / f"node-{node}")
        props = ndir / "server.properties"
        _write_private(props, _properties(cdir, node, state))
        _write_private(ndir / "log4j2.properties", _LOG4J2.format(log=ndir / "server.log"))
        if (ndir / "data" / "meta.properties").is_file():
            continue
        format_storage(java, cp, ndir, state["cluster_id"], f"node {node}'s storage")
    return state


def _spawn_node(data_dir: Path, node: int) -> Proc:
    ndir = cluster_dir(data_dir) / f"node-{node}"
    state = json.loads((cluster_dir(data_dir) / "state.json").read_text())
    me = state["nodes"][str(node)]
    for port in (me["port"], me["controller_port"]):
        if port_in_use(port):
            raise ServiceError(f"port {port} of Kafka node {node} is in use by another process")
    java = java_binary()
    props = ndir / "server.properties"
    proc = spawn_kafka(java, kafka_classpath(), ndir, props, ndir / "stdout.log")
    return Proc(proc.pid, me["port"], java, str(ndir / "server.log"), marker=str(props))


def bootstrap(procs: list[Proc]) -> str:
    return ",".join(f"127.0.0.1:{p.port}" for p in procs)


def brokers_seen(port: int, password: str, timeout_s: float = 3.0) -> int:
    """How many brokers the node on `port` lists in its metadata (0: it does not answer)."""
    from confluent_kafka.admin import AdminClient

    conf: dict[str, Any] = {
        "bootstrap.servers": f"127.0.0.1:{port}",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": KAFKA_USER,
        "sasl.password": password,
        "log_level": 0,
        "logger": logging.getLogger("infra.kafka_cluster.check"),
    }
    admin = AdminClient(conf)
    try:
        return len(admin.list_topics(timeout=timeout_s).brokers)
    except Exception:  # noqa: BLE001 - not answering yet
        return 0


class NodeExited(ServiceError):
    """A node's JVM ended while it was being waited for."""


def _exit_status(p: Proc) -> int | None:
    """A node's wait status once it ended; None while it runs. For a child of this process its
    exit decides, not its command line: one read while the JVM starts under load has come back
    without the program's name, and a running node was reported as ended."""
    try:
        pid, status = os.waitpid(p.pid, os.WNOHANG)
    except ChildProcessError:  # started by another process: its command line is all there is
        return None if _is_ours(p) else -1
    return None if pid == 0 else status


def _why_exited(p: Proc, status: int) -> str:
    """Everything known about a node that ended: its exit status (when this process started
    it), the last ERROR lines of its server.log and the last lines of its stdout."""
    how = (
        "status unknown (not started by this process)"
        if status == -1
        else f"killed by signal {os.WTERMSIG(status)}"
        if os.WIFSIGNALED(status)
        else f"exit code {os.WEXITSTATUS(status)}"
    )
    log = Path(p.log)
    out = log.with_name("stdout.log")
    errors = [
        line
        for line in (log.read_text(errors="replace").splitlines() if log.exists() else [])
        if " ERROR " in line or " FATAL " in line
    ][-5:]
    tail = out.read_text(errors="replace").splitlines()[-5:] if out.exists() else []
    return "\n".join(
        [f"pid {p.pid} ({how}), log {p.log}", *("  " + s[:400] for s in errors + tail)]
    )


def wait_ready(data_dir: Path, procs: list[Proc], password: str, timeout: float = 240.0) -> None:
    """Until every node answers and lists every broker; one error naming the late nodes' logs."""
    n = len(json.loads((cluster_dir(data_dir) / "state.json").read_text())["nodes"])
    deadline = time.monotonic() + timeout
    waiting = list(procs)
    while waiting:
        ended = [(p, st) for p in waiting if (st := _exit_status(p)) is not None]
        if ended:
            raise NodeExited(
                "Kafka node(s) exited before answering: "
                + "; ".join(_why_exited(p, st) for p, st in ended)
            )
        waiting = [p for p in waiting if brokers_seen(p.port, password) < n]
        if waiting and time.monotonic() > deadline:
            raise ServiceError(
                f"Kafka node(s) not ready with {n} brokers within {timeout:.0f}s: "
                + "; ".join(f"port {p.port}, log {p.log}" for p in waiting)
            )
        if waiting:
            time.sleep(0.5)


def start_cluster(data_dir: Path, brokers: int, timeout: float = 240.0) -> tuple[list[Proc], str]:
    """Start the N nodes together (a controller quorum needs its voters up at once) and wait
    until every one is ready; returns them (node 1 first) and the SASL password."""
    if brokers < 1:
        raise ServiceError(f"--brokers must be at least 1, got {brokers}")
    state = _prepare(Path(data_dir), brokers)
    procs: list[Proc] = []
    try:
        for node in range(1, brokers + 1):
            procs.append(_spawn_node(Path(data_dir), node))
        wait_ready(Path(data_dir), procs, state["password"], timeout)
    except ServiceError:
        for p in procs:
            _terminate(p.pid, timeout=30)
        raise
    return procs, state["password"]


def stop_node(proc: Proc, kill: bool = False) -> None:
    """SIGTERM (controlled shutdown: leadership moves first) or SIGKILL (a crash) one node,
    and wait until its port is free."""
    if _is_ours(proc):
        if kill:
            _kill9(proc.pid)
        else:
            _terminate(proc.pid, timeout=30)
    _wait_port_free(proc.port)


def restart_node(data_dir: Path, node: int, password: str, down_s: float = 0.0) -> Proc:
    """Start node `node` again on its ports and storage (after stop_node, down_s later) and
    wait until it answers with every broker listed; returns its new process."""
    time.sleep(down_s)
    proc = _spawn_node(Path(data_dir), node)
    try:
        wait_ready(Path(data_dir), [proc], password)
    except NodeExited as first:
        # once more: a node restarted right after a crash has been seen to end during start-up
        # under load; a second exit is the error, with both causes
        log.warning("%s; starting it once more", first)
        _wait_port_free(proc.port)
        proc = _spawn_node(Path(data_dir), node)
        try:
            wait_ready(Path(data_dir), [proc], password)
        except NodeExited as second:
            raise NodeExited(f"{first}\nand again: {second}") from None
    return proc


def leader_of(settings, topic: str, partition: int) -> int:
    """The node id leading `topic`[partition] now (-1: none)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**settings.kafka.librdkafka_options(), "log_level": 0})
    meta = admin.list_topics(topic, timeout=10)
    return int(meta.topics[topic].partitions[partition].leader)


def busiest_partition(settings, topic: str) -> int:
    """The partition of `topic` holding the most messages now (its end offset)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**settings.kafka.librdkafka_options(), "group.id": "astec-probe"})
    try:
        ends = [
            c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(settings.topics.partitions)
        ]
    finally:
        c.close()
    return max(range(len(ends)), key=ends.__getitem__)  # ties: the lowest partition


# ---- one node or all, of the services recorded in DIR/services.json ---------------------------
def node_procs(info) -> dict[int, Proc]:
    """{node id: its process} of the recorded Kafka nodes (one node: {1: the broker})."""
    return dict(enumerate([info.kafka, *info.kafka_nodes], start=1))


def _recorded(data_dir: Path):
    from infra.services import SERVICES_FILE, read_info

    info = read_info(data_dir)
    if info is None:
        raise ServiceError(f"{Path(data_dir) / SERVICES_FILE}: no services recorded")
    if not info.kafka_nodes:
        raise ServiceError(f"{data_dir} runs one Kafka broker, not a cluster (infra up --brokers)")
    return info


def _record_node(info, node: int, proc: Proc) -> None:
    from infra.services import write_info

    if node == 1:
        info.kafka = proc
    else:
        info.kafka_nodes[node - 2] = proc
    write_info(info)


def kill_node(data_dir: str | Path, node: int, signal_kill: bool = True) -> Proc:
    """Stop one recorded node (SIGKILL: a crash, or SIGTERM); it stays recorded, down."""
    info = _recorded(Path(data_dir))
    proc = node_procs(info)[node]
    stop_node(proc, kill=signal_kill)
    return proc


def restart_nodes(
    data_dir: str | Path, nodes: list[int] | None = None, kill: bool = False, down_s: float = 0.0
) -> list[int]:
    """Restart recorded nodes one after another (all of them: a rolling restart), each
    stopped (SIGTERM, or SIGKILL when kill), started again on its ports and storage and ready
    before the next; a node already down is just started. Returns the nodes restarted."""
    info = _recorded(Path(data_dir))
    procs = node_procs(info)
    for node in nodes or sorted(procs):
        if node not in procs:
            raise ServiceError(f"no Kafka node {node} (nodes: {sorted(procs)})")
        stop_node(procs[node], kill=kill)
        _record_node(
            info, node, restart_node(Path(data_dir), node, info.kafka_password, down_s=down_s)
        )
    return nodes or sorted(procs)


def nodes_status(info) -> list[dict]:
    """Per node: pid, port, whether it runs (as our process) and how many brokers it sees."""
    n = len(node_procs(info))
    out = []
    for node, p in node_procs(info).items():
        alive = _is_ours(p)
        seen = brokers_seen(p.port, info.kafka_password) if alive else 0
        out.append(
            {
                "node": node,
                "pid": p.pid,
                "port": p.port,
                "alive": alive,
                "answers": seen > 0,
                "brokers_seen": seen,
                "ready": seen == n,
                "log": p.log,
            }
        )
    return out
