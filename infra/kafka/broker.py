"""Apache Kafka as the loopback broker: one KRaft JVM (broker + controller) on 127.0.0.1.

The jars are not a Python package: `make kafka` copies `org.apache.kafka:kafka_2.13` and its
runtime dependencies (plus a log4j2 binding, so the broker logs to a file) from Maven into
.astec/kafka/libs (or $ASTEC_KAFKA_LIBS). This module writes a single-node dev configuration
under the services dir, formats the KRaft storage on first start and builds the java command
line; infra.services starts, waits for and stops the process like the Tansu one.
"""
from __future__ import annotations

import base64
import os
import shutil
import subprocess
import uuid
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBS_ENV = "ASTEC_KAFKA_LIBS"
DEFAULT_LIBS = REPO / ".astec" / "kafka" / "libs"
INSTALL_HINT = ("run `make kafka` in the repository (it runs `mvn -f infra/kafka/pom.xml "
                "dependency:copy-dependencies` into .astec/kafka/libs; Maven Central must be "
                "reachable), or point $ASTEC_KAFKA_LIBS at a directory holding Kafka's jars "
                "(e.g. the libs/ of an Apache Kafka 4.x download)")
LOG4J2 = Path(__file__).resolve().parent / "log4j2.properties"
# 512 MiB bounds a dev broker on a shared 24 GiB / 2-core box: its heap holds request buffers and
# metadata only (the log itself is in the OS page cache), and Kafka's own scripts default to 1 GiB
# for production-sized traffic. Fixed (Xms = Xmx) as Kafka recommends, so G1 never resizes.
# $KAFKA_HEAP_OPTS / $KAFKA_JVM_PERFORMANCE_OPTS override, as in Kafka's kafka-run-class.sh.
HEAP_OPTS = "-Xms512m -Xmx512m"
JVM_OPTS = ("-server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 "
            "-XX:+ExplicitGCInvokesConcurrent -Djava.awt.headless=true")


class KafkaNotInstalled(RuntimeError):
    """Kafka's jars (or java) are missing; the message names the install command."""


def libs_dir() -> Path:
    return Path(os.environ.get(LIBS_ENV) or DEFAULT_LIBS)


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    path = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not path or not os.access(path, os.X_OK):
        raise KafkaNotInstalled("java not found (JAVA_HOME or PATH): Apache Kafka 4.x needs "
                                "Java 17 or newer (Debian: apt-get install openjdk-17-jre-headless)")
    return path


def check_installed(libs: Path | None = None) -> Path:
    """The libs dir, if it holds the Kafka server jar; else a KafkaNotInstalled naming the fix."""
    libs = libs or libs_dir()
    if not any(libs.glob("kafka_2.13-*.jar")):
        raise KafkaNotInstalled(f"Apache Kafka's jars are not installed: no kafka_2.13-*.jar in "
                                f"{libs}; {INSTALL_HINT}")
    return libs


def find_class(libs: Path, candidates: list[str]) -> str:
    """The first of `candidates` (dotted class names) present in a jar of `libs`: Kafka moves its
    tools between the Scala core and Java modules across versions."""
    wanted = {c.replace(".", "/") + ".class": c for c in candidates}
    found = set()
    for jar in sorted(libs.glob("kafka*.jar")):
        with zipfile.ZipFile(jar) as z:
            found |= wanted.keys() & set(z.namelist())
    for path, name in wanted.items():
        if path in found:
            return name
    raise KafkaNotInstalled(f"none of {candidates} in the jars of {libs}; {INSTALL_HINT}")


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (as kafka-storage
    random-uuid prints)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()


def server_properties(log_dir: Path, port: int, controller_port: int, partitions: int) -> str:
    """A single-node dev broker: replication 1 everywhere, no rebalance delay, topics created on
    demand (the stream still creates its own with `ensure_topics`), retention honoured."""
    return "\n".join([
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@127.0.0.1:{controller_port}",
        f"listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        f"log.dirs={log_dir}",
        f"num.partitions={partitions}",
        "default.replication.factor=1",
        "min.insync.replicas=1",
        "auto.create.topics.enable=true",
        # internal topics: one replica, and few partitions (the defaults, 50 for offsets, make the
        # first group join create 50 logs on a 2-core box)
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=4",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "transaction.state.log.num.partitions=4",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        "log.retention.hours=24",
        "",
    ])


def jvm_argv(java: str, libs: Path, log_dir: Path, main: str, args: list[str],
             heap_opts: str | None = None) -> list[str]:
    heap = (heap_opts or os.environ.get("KAFKA_HEAP_OPTS", HEAP_OPTS)).split()
    perf = os.environ.get("KAFKA_JVM_PERFORMANCE_OPTS", JVM_OPTS).split()
    return [java, *heap, *perf, f"-Dlog4j2.configurationFile={LOG4J2}",
            f"-Dkafka.logs.dir={log_dir}", "-cp", str(libs / "*"), main, *args]


def prepare(data_dir: Path, port: int, controller_port: int, partitions: int = 4,
            timeout: float = 120.0) -> tuple[list[str], Path]:
    """Write the config, format the storage on first start; returns (argv, properties file).

    The properties file name carries the port, so the broker's command line names it and a
    PID check can tell our JVM from another one."""
    libs = check_installed()
    java = java_binary()
    home = data_dir / "kafka"
    logs = home / "data"
    home.mkdir(parents=True, exist_ok=True)
    for old in home.glob("server-*.properties"):
        old.unlink()
    props = home / f"server-{port}.properties"
    props.write_text(server_properties(logs, port, controller_port, partitions))
    if not (logs / "meta.properties").is_file():
        tool = find_class(libs, ["kafka.tools.StorageTool", "org.apache.kafka.tools.StorageTool"])
        argv = jvm_argv(java, libs, home, tool,   # a short-lived tool: a small, growing heap
                        ["format", "-t", new_cluster_id(), "-c", str(props)], "-Xmx256m")
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"formatting Kafka storage in {logs} failed ({res.returncode}): "
                               f"{(res.stderr or res.stdout)[-2000:]}")
    main = find_class(libs, ["kafka.Kafka"])
    return jvm_argv(java, libs, home, main, [str(props)]), props
