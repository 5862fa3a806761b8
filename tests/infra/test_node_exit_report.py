"""A Kafka node that ends while it is waited for is reported with what an operator needs to
know why: how it ended and the last errors of its logs."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from infra.kafka_cluster import NodeExited, wait_ready
from infra.services import Proc, ServiceError


def test_a_node_that_ended_is_reported_with_its_signal_and_log_errors(tmp_path):
    node = tmp_path / "node-3"
    node.mkdir()
    (tmp_path / "kafka-cluster").mkdir()
    (tmp_path / "kafka-cluster" / "state.json").write_text('{"nodes": {"1": {}, "2": {}, "3": {}}}')
    (node / "server.log").write_text(
        "[t] INFO started\n[t] ERROR [RaftManager id=3] could not open the log\n[t] INFO more\n"
    )
    (node / "stdout.log").write_text("last words of the JVM\n")
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", str(node / "server.properties")]
    )
    child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # ended, not reaped: a zombie, as a crashed node is
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
    proc = Proc(
        child.pid,
        1,
        sys.executable,
        str(node / "server.log"),
        marker=str(node / "server.properties"),
    )
    with pytest.raises(NodeExited) as err:
        wait_ready(tmp_path, [proc], "pw", timeout=5)
    msg = str(err.value)
    assert f"pid {child.pid} (killed by signal 9)" in msg
    assert "could not open the log" in msg and "last words of the JVM" in msg
    assert "INFO more" not in msg
    child.returncode = -9  # reaped above; keep Popen from waiting on it again


def test_a_running_node_is_never_reported_ended_whatever_its_command_line_reads(tmp_path):
    """A JVM's command line read while it starts under load has come back without the program
    (it then failed the start of a healthy cluster): a child of this process that still runs is
    waited for, and only the readiness deadline ends the wait."""
    (tmp_path / "kafka-cluster").mkdir()
    (tmp_path / "kafka-cluster" / "state.json").write_text('{"nodes": {"1": {}}}')
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc = Proc(child.pid, 1, "/usr/bin/java", str(tmp_path / "server.log"), marker="nowhere")
        with pytest.raises(ServiceError, match="not ready with 1 brokers within 1s") as err:
            wait_ready(tmp_path, [proc], "pw", timeout=1)
        assert not isinstance(err.value, NodeExited)
    finally:
        child.kill()
        child.wait()
