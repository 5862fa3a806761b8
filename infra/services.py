"""Start, check and stop the real loopback services: an Apache Kafka broker (KRaft) and
redis-server.

Kafka runs as one JVM that is both broker and controller, from the jars `make install` resolved
with Maven into infra/kafka/lib (infra/kafka/pom.xml pins them; nothing is downloaded here). Its
storage is formatted once under DIR/kafka/data and survives `down`/`up` and a crash; its clients
authenticate with SASL/PLAIN (a password made at the first start, kept in DIR/kafka/state.json).
Redis runs with a password and AOF under DIR/redis. Everything under DIR is readable by its owner
only (0700 directories, 0600 files).

Each start records PIDs, ports and passwords in DIR/services.json; `stop` signals exactly those
PIDs after checking the process is still the one we started (PIDs and ports can be reused by
someone else's broker): the broker by its properties file on its command line, Redis by its port.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine.private_dirs import private_dir

SERVICES_FILE = "services.json"
KAFKA_USER = "astec"
KAFKA_HEAP = os.environ.get("ASTEC_KAFKA_HEAP", "512m")
KAFKA_LIB = Path(__file__).resolve().parent / "kafka" / "lib"
# Redis fsyncs its AOF before it answers ("always"), so a visit whose offset a worker committed
# after Redis answered survives a Redis crash. With "everysec" it does not: while a background
# fsync is slow Redis postpones its AOF write() but still answers, and the SIGKILL fault test lost
# 43 of 300 acknowledged visits once that way. "always" costs +3.6 ms median per pipelined batch
# here (p99 15-56 ms against 5 ms); ASTEC_REDIS_APPENDFSYNC=everysec trades that back
REDIS_APPENDFSYNC = os.environ.get("ASTEC_REDIS_APPENDFSYNC", "always")


class ServiceError(RuntimeError):
    """A service did not start, answer or stop; the message says which and where its log is."""


@dataclass
class Proc:
    pid: int
    port: int
    binary: str
    log: str
    marker: str = ""  # a string on the process' command line that only our process has


@dataclass
class ServicesInfo:
    data_dir: str
    kafka: Proc
    redis: Proc | None  # None: Redis is a topology with replicas (infra.redis_topologies)
    redis_password: str
    started_at: float
    kafka_password: str = ""
    kafka_nodes: list[Proc] = field(default_factory=list)  # nodes 2..N of a cluster
    topology_url: str = ""  # the topology's URL, when redis is None

    @property
    def kafka_bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{p.port}" for p in [self.kafka, *self.kafka_nodes])

    @property
    def redis_url(self) -> str:
        if self.redis is None:
            return self.topology_url
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis.port}/0"

    def to_json(self) -> dict:
        return {
            "data_dir": self.data_dir,
            "started_at": self.started_at,
            "kafka": {
                **asdict(self.kafka),
                "bootstrap": self.kafka_bootstrap,
                "sasl_username": KAFKA_USER,
                "sasl_password": self.kafka_password,
                "nodes": [asdict(p) for p in self.kafka_nodes],
            },
            "redis": {
                **(asdict(self.redis) if self.redis else {}),
                "url": self.redis_url,
                "password": self.redis_password,
            },
        }

    @classmethod
    def from_json(cls, d: dict) -> ServicesInfo:
        k = {f: d["kafka"][f] for f in ("pid", "port", "binary", "log")}
        single = "pid" in d["redis"]  # else a topology, named by its URL alone
        r = {f: d["redis"][f] for f in ("pid", "port", "binary", "log")} if single else {}
        return cls(
            d["data_dir"],
            Proc(**k, marker=d["kafka"].get("marker", "")),
            Proc(**r, marker=d["redis"].get("marker", "")) if single else None,
            d["redis"]["password"],
            d["started_at"],
            d["kafka"].get("sasl_password", ""),
            [Proc(**p) for p in d["kafka"].get("nodes", [])],
            "" if single else d["redis"]["url"],
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_alive(pid: int) -> bool:
    """True if the PID runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _is_ours(proc: Proc) -> bool:
    """The PID still runs the program we started (guards PID reuse): its command line holds our
    marker (the broker's properties path; the JVM's command line has no port) or our port."""
    if not pid_alive(proc.pid):
        return False
    try:
        cmd = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return os.path.basename(proc.binary) in cmd and (proc.marker or str(proc.port)) in cmd


def _write_private(path: Path, text: str) -> None:
    """Write a file readable by its owner only (0600 from creation, replaced atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def java_binary() -> str:
    """A `java` of version 17 or later ($JAVA_HOME first), or one line saying what to install."""
    home = os.environ.get("JAVA_HOME")
    path = (
        os.path.join(home, "bin", "java")
        if home and os.path.isfile(os.path.join(home, "bin", "java"))
        else shutil.which("java")
    )
    hint = "install OpenJDK 17 or later (Debian: apt-get install openjdk-17-jre-headless)"
    if not path:
        raise ServiceError(f"java not found on PATH or in $JAVA_HOME: {hint}")
    out = subprocess.run([path, "-version"], capture_output=True, text=True, check=False).stderr
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    major = int(m.group(1)) if m else 0
    if major == 1 and m and m.group(2):
        major = int(m.group(2))
    if major < 17:
        raise ServiceError(
            f"{path} is Java {major or 'of unknown version'}; Apache Kafka 4 "
            f"needs Java 17 or later: {hint}"
        )
    return path


def kafka_classpath() -> str:
    """The broker's classpath: $ASTEC_KAFKA_CLASSPATH, or the jars `make install` put in
    infra/kafka/lib."""
    lib = Path(os.environ.get("ASTEC_KAFKA_CLASSPATH") or KAFKA_LIB)
    if not list(lib.glob("kafka_2.13-*.jar")):
        raise ServiceError(
            f"no Apache Kafka jars in {lib}: run `make install` (it resolves "
            f"infra/kafka/pom.xml with Maven), or set ASTEC_KAFKA_CLASSPATH"
        )
    return str(lib / "*")


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if not path:
        raise ServiceError(
            "redis-server not found on PATH: install Debian's redis-server (`make install` does it)"
        )
    return path


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """Start a daemon in its own session so it outlives the CLI that started it."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )


def _wait_until(check, proc: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServiceError(
                f"{what} (pid {proc.pid}) exited with {proc.returncode} before "
                f"answering; log {log}:\n{tail}"
            )
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last_err = exc
        time.sleep(0.2)
    raise ServiceError(
        f"{what} (pid {proc.pid}) did not answer within {timeout:.0f}s "
        f"(last error: {last_err}); log {log}"
    )


def kafka_answers(bootstrap: str, password: str = "", timeout_s: float = 3.0) -> bool:
    """A metadata round trip (SASL/PLAIN as the local user when a password is given)."""
    from kafka import KafkaAdminClient

    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass
    sasl = (
        {
            "security_protocol": "SASL_PLAINTEXT",
            "sasl_mechanism": "PLAIN",
            "sasl_plain_username": KAFKA_USER,
            "sasl_plain_password": password,
        }
        if password
        else {}
    )
    admin = KafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **sasl
    )
    try:
        admin.list_topics()
        return True
    finally:
        admin.close()


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """A PING through the URL's topology (one endpoint, Sentinel's primary, or a cluster)."""
    from stream.redis_connect import redis_client

    client = redis_client(url, retries=0, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    finally:
        client.close()


# ---- Apache Kafka (KRaft) --------------------------------------------------------------------
_LOG4J2 = """status = warn
appender.file.type = RollingFile
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.filePermissions = rw-------
appender.file.filePattern = {log}.%i
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.file.policies.type = Policies
appender.file.policies.size.type = SizeBasedTriggeringPolicy
appender.file.policies.size.size = 20MB
appender.file.strategy.type = DefaultRolloverStrategy
appender.file.strategy.max = 3
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def _server_properties(kdir: Path, port: int, controller_port: int, password: str) -> str:
    """One node that is broker and controller; SASL/PLAIN on both listeners (loopback only);
    replication factors of 1 for the internal topics (transactions and offsets) on one node."""
    jaas = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{KAFKA_USER}" password="{password}" user_{KAFKA_USER}="{password}";'
    )
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
            f"listeners=CLIENT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            f"advertised.listeners=CLIENT://127.0.0.1:{port}",
            "listener.security.protocol.map=CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=CLIENT",
            "sasl.enabled.mechanisms=PLAIN",
            "sasl.mechanism.inter.broker.protocol=PLAIN",
            "sasl.mechanism.controller.protocol=PLAIN",
            f"listener.name.client.plain.sasl.jaas.config={jaas}",
            f"listener.name.controller.plain.sasl.jaas.config={jaas}",
            f"log.dirs={kdir / 'data'}",
            "num.partitions=4",
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=8",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=8",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "group.initial.rebalance.delay.ms=0",
            "num.network.threads=2",
            "num.io.threads=4",
            "log.retention.hours=168",
            "",
        ]
    )


def _kafka_state(kdir: Path) -> dict:
    """Cluster id, ports and password chosen at the first start (kept so data survives)."""
    path = kdir / "state.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise ServiceError(f"{path}: malformed broker state: {exc}") from None
    state = {
        "cluster_id": _cluster_id(),
        "port": 0,
        "controller_port": 0,
        "password": secrets.token_hex(16),
    }
    return state


def _cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (like random-uuid).
    Never one that starts with '-' (1 in 64 would): the storage tool's argument parser reads it
    as an option and the format fails, as Kafka's own Uuid.randomUuid avoids too."""
    import base64

    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def spawn_kafka(java: str, cp: str, node_dir: Path, props: Path, out: Path) -> subprocess.Popen:
    """One Kafka JVM (the single broker or a cluster node) with the bounded heap and its logs in
    node_dir; stdout and stderr to `out`."""
    return _spawn(
        [
            java,
            "-Xms128m",
            f"-Xmx{KAFKA_HEAP}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={node_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={node_dir}",
            "-cp",
            cp,
            "kafka.Kafka",
            str(props),
        ],
        out,
    )


def format_storage(java: str, cp: str, node_dir: Path, cluster_id: str, what: str) -> None:
    """Format a KRaft node's storage (node_dir/data) once, from node_dir's server.properties and
    log4j2.properties; `what` names it in the error."""
    private_dir(node_dir / "data")
    res = subprocess.run(
        [
            java,
            "-Xmx256m",
            "-cp",
            cp,
            f"-Dlog4j2.configurationFile={node_dir / 'log4j2.properties'}",
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={cluster_id}",
            "-c",
            str(node_dir / "server.properties"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if res.returncode != 0:
        raise ServiceError(
            f"formatting {what} in {node_dir / 'data'} failed "
            f"({res.returncode}): {(res.stderr or res.stdout)[-1500:]}"
        )


def start_kafka(
    data_dir: Path, port: int | None = None, timeout: float = 120.0
) -> tuple[Proc, str]:
    """Start (formatting its storage the first time) the broker; returns it and its password.

    Ports recorded at an earlier start are reused while free, so clients configured then still
    find it; otherwise (or when asked) free ones are taken."""
    java, cp = java_binary(), kafka_classpath()
    kdir = private_dir(data_dir / "kafka")
    state = _kafka_state(kdir)
    if port:
        if port_in_use(port):
            raise ServiceError(f"port {port} for the Kafka broker is already in use")
        state["port"] = port
    elif not state["port"] or port_in_use(state["port"]):
        state["port"] = free_port()
    if not state["controller_port"] or port_in_use(state["controller_port"]):
        state["controller_port"] = free_port()
        while state["controller_port"] == state["port"]:
            state["controller_port"] = free_port()
    props = kdir / "server.properties"
    _write_private(
        props, _server_properties(kdir, state["port"], state["controller_port"], state["password"])
    )
    log = kdir / "server.log"
    _write_private(kdir / "log4j2.properties", _LOG4J2.format(log=log))
    _write_private(kdir / "state.json", json.dumps(state, indent=2))
    if not (kdir / "data" / "meta.properties").is_file():
        format_storage(java, cp, kdir, state["cluster_id"], "the Kafka storage")
    out = kdir / "stdout.log"
    proc = spawn_kafka(java, cp, kdir, props, out)
    bootstrap = f"127.0.0.1:{state['port']}"
    try:
        _wait_until(
            lambda: pid_alive(proc.pid) and kafka_answers(bootstrap, state["password"]),
            proc,
            "Kafka broker",
            log,
            timeout,
        )
    except ServiceError:
        _terminate(proc.pid)
        raise
    return Proc(proc.pid, state["port"], java, str(log), marker=str(props)), state["password"]


def start_redis(
    data_dir: Path, password: str, port: int | None = None, timeout: float = 20.0
) -> Proc:
    """redis-server on loopback with a password and AOF persistence under data_dir/redis."""
    port = port or free_port()
    if port_in_use(port):
        raise ServiceError(f"port {port} for Redis is already in use")
    binary = redis_binary()
    rdir = private_dir(data_dir / "redis")
    log = data_dir / "redis.log"
    proc = _spawn(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--requirepass",
            password,
            "--appendonly",
            "yes",
            "--appendfsync",
            REDIS_APPENDFSYNC,
            "--dir",
            str(rdir),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--save",
            "",
        ],
        log,
    )
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        _wait_until(lambda: redis_answers(url), proc, "redis-server", log, timeout)
    except ServiceError:
        _terminate(proc.pid)
        raise
    return Proc(proc.pid, port, binary, str(log))


def _terminate(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL; reaps the child when it is ours."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            pass
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _kill9(pid: int) -> None:
    """SIGKILL and wait until the process is gone (a crash, as a test wants it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        while pid_alive(pid):
            time.sleep(0.05)


R = TypeVar("R")


def read_record(path: Path, from_json: Callable[[dict], R], what: str) -> R | None:
    """A JSON record of started processes (None: none recorded); one error naming the file when
    it does not parse, so a hand-edited or truncated record is never half-trusted."""
    if not path.is_file():
        return None
    try:
        return from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceError(f"{path}: malformed {what} record: {exc}") from None


def read_info(data_dir: str | os.PathLike) -> ServicesInfo | None:
    return read_record(Path(data_dir) / SERVICES_FILE, ServicesInfo.from_json, "services")


def write_info(info: ServicesInfo) -> None:
    _write_private(Path(info.data_dir) / SERVICES_FILE, json.dumps(info.to_json(), indent=2))


def start_services(
    data_dir: str | os.PathLike,
    kafka_port: int | None = None,
    redis_port: int | None = None,
    password: str | None = None,
    brokers: int = 1,
    single_redis: bool = True,
) -> ServicesInfo:
    """Start both services (or return the running ones recorded in data_dir); brokers > 1: a
    cluster of that many Kafka nodes (infra.kafka_cluster). single_redis=False starts no
    redis-server: the caller starts a topology with replicas (infra.redis_topologies) with the
    recorded password, and it alone is recorded as the services' Redis."""
    d = private_dir(Path(data_dir).resolve())
    existing = read_info(d)
    if existing is not None:
        if all(map(_is_ours, [existing.kafka, *existing.kafka_nodes])):
            return _match_redis(existing, single_redis, redis_port)
        stop_services(d)
    password = password or secrets.token_hex(16)
    if brokers > 1:
        from infra.kafka_cluster import start_cluster

        nodes, kafka_password = start_cluster(d, brokers)
    else:
        kafka, kafka_password = start_kafka(d, kafka_port)
        nodes = [kafka]
    try:
        redis_proc = start_redis(d, password, redis_port) if single_redis else None
    except ServiceError:
        for node in nodes:
            _terminate(node.pid, timeout=30)
        raise
    info = ServicesInfo(
        str(d), nodes[0], redis_proc, password, time.time(), kafka_password, nodes[1:]
    )
    write_info(info)
    return info


def _match_redis(info: ServicesInfo, single_redis: bool, port: int | None) -> ServicesInfo:
    """The running services with their Redis as asked: the single redis-server started (again)
    or stopped, the broker left as it is."""
    ours = info.redis is not None and _is_ours(info.redis)
    if single_redis and not ours:
        info.redis = start_redis(Path(info.data_dir), info.redis_password, port)
        info.topology_url = ""
        write_info(info)
    elif not single_redis and info.redis is not None:
        if ours:
            _terminate(info.redis.pid)
        info.redis = None
        write_info(info)
    return info


def _wait_port_free(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while port_in_use(port) and time.monotonic() < deadline:
        time.sleep(0.05)


def restart_redis(data_dir: str | os.PathLike, kill: bool = False) -> ServicesInfo:
    """Stop redis-server (SIGTERM, or SIGKILL when kill) and start it again on the same port/dir."""
    d = Path(data_dir).resolve()
    info = read_info(d)
    if info is None:
        raise ServiceError(f"{d / SERVICES_FILE}: no services recorded")
    if info.redis is None:
        raise ServiceError(
            f"{d / SERVICES_FILE}: Redis is a topology with replicas here, not one redis-server "
            "to restart (infra.redis_topologies.kill_node stops one of its nodes)"
        )
    if _is_ours(info.redis):
        (_kill9 if kill else _terminate)(info.redis.pid)
    _wait_port_free(info.redis.port)
    info.redis = start_redis(d, info.redis_password, info.redis.port)
    write_info(info)
    return info


def restart_kafka(
    data_dir: str | os.PathLike, kill: bool = False, down_s: float = 0.0
) -> ServicesInfo:
    """Stop the broker (SIGTERM: controlled shutdown; or SIGKILL when kill), stay down down_s
    seconds, and start it again on the same ports and storage (clients reconnect)."""
    d = Path(data_dir).resolve()
    info = read_info(d)
    if info is None:
        raise ServiceError(f"{d / SERVICES_FILE}: no services recorded")
    if _is_ours(info.kafka):
        if kill:
            _kill9(info.kafka.pid)
        else:
            _terminate(info.kafka.pid, timeout=30)
    _wait_port_free(info.kafka.port)
    time.sleep(down_s)
    info.kafka, info.kafka_password = start_kafka(d, info.kafka.port)
    write_info(info)
    return info


def stop_services(data_dir: str | os.PathLike) -> list[str]:
    """Stop exactly the processes recorded in data_dir/services.json; returns what was stopped.
    The broker gets 30 s for its controlled shutdown before it is killed."""
    d = Path(data_dir).resolve()
    info = read_info(d)
    if info is None:
        return []
    stopped = []
    kafka = [("kafka", p, 30.0) for p in [info.kafka, *info.kafka_nodes]]
    redis_proc = [("redis", info.redis, 10.0)] if info.redis else []
    for name, proc, grace in [*redis_proc, *kafka]:
        if _is_ours(proc):
            _terminate(proc.pid, timeout=grace)
            stopped.append(f"{name} pid {proc.pid} port {proc.port}")
    (d / SERVICES_FILE).unlink(missing_ok=True)
    return stopped


def services_status(data_dir: str | os.PathLike) -> dict:
    """Whether each recorded service runs (as our PID) and answers; passwords left out."""
    info = read_info(data_dir)
    if info is None:
        return {"running": False, "data_dir": str(Path(data_dir).resolve())}
    out: dict[str, Any] = {
        "data_dir": info.data_dir,
        "kafka_bootstrap": info.kafka_bootstrap,
        "redis_url": info.redis_url.replace(info.redis_password, "***"),
    }
    checks = [
        ("kafka", info.kafka, lambda: kafka_answers(info.kafka_bootstrap, info.kafka_password)),
        ("redis", info.redis, lambda: redis_answers(info.redis_url)),
    ]
    if info.redis is None:  # a topology: it answers through its URL (its nodes: `infra status`)
        checks.pop()
        try:
            answers = redis_answers(info.redis_url)
        except Exception:  # noqa: BLE001 - reported, not raised
            answers = False
        out["redis"] = {"topology": info.redis_url.split("://", 1)[0], "answers": answers}
    for name, proc, check in checks:
        assert proc is not None
        alive = _is_ours(proc)
        try:
            answers = alive and check()
        except Exception:  # noqa: BLE001 - reported, not raised
            answers = False
        out[name] = {
            "pid": proc.pid,
            "port": proc.port,
            "alive": alive,
            "answers": bool(answers),
            "log": proc.log,
        }
    out["running"] = out["kafka"]["answers"] and out["redis"]["answers"]
    return out
