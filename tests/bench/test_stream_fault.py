"""`astec bench stream --fault kill-leader`: a Kafka node killed in the middle of each paced
phase of a real 3-node cluster, figures read off the ad reader's arrivals, and the node started
again before the next phase (a second kill with the first node still down would leave one
replica of two required, and page views would be refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bench.stream_fault import LeaderKill
from testkit.paths import REPO, STREAM_DATA

_BENCH = [sys.executable, "-m", "infra.cli", "bench", "stream", "--model"]


def _kill_at(t: float) -> LeaderKill:
    k = LeaderKill(services_dir="unused", settings=None, at_s=5.0)  # type: ignore[arg-type]
    k.node, k.partition, k.t_kill = 2, 1, t
    return k


def test_figures_find_the_stall_and_split_the_events_the_kill_could_hold():
    """Answers every 0.1 s, none from 100.12 to 108.0 (the kill at 100.0): the longest gap is
    that stall, timed from the kill; the 'before' p99 covers events answered before the kill,
    the 'after' p99 the ones answered after it (those held included), not the steady ones."""
    sent = np.arange(90.0, 130.0, 0.1)
    got = sent + 0.02
    held = (got > 100.2) & (got < 108.0)
    got[held] = 108.0 + (sent[held] - 100.2) * 0.01  # held, then answered in a burst
    arr = np.stack([got, sent, sent + 0.01], axis=1)
    f = _kill_at(100.0).figures(arr)
    assert f["node"] == 2 and f["partition"] == 1
    assert f["longest_gap_s"] == pytest.approx(7.88, abs=0.02)
    assert f["gap_starts_after_kill_s"] == pytest.approx(0.12, abs=0.02)
    assert f["p99_ms_before"] == pytest.approx(20.0, abs=0.5)
    assert f["p99_ms_minute_after"] > 7000  # the held events' wait
    assert f["max_ms_minute_after"] == pytest.approx(7800, abs=60)
    assert f["p99_ms_after_the_gap"] == pytest.approx(20.0, abs=0.5)  # back to its pace
    assert f["minute_after_covered_s"] == pytest.approx(29.9, abs=0.05)


def test_a_kill_that_never_happened_is_reported_not_measured():
    k = LeaderKill(services_dir="unused", settings=None, at_s=50.0)  # type: ignore[arg-type]
    f = k.figures(np.zeros((0, 3)))
    assert f["error"] == "the phase ended before 50.0 s: no kill"
    assert "longest_gap_s" not in f
    k.error = "KafkaException: no leader"
    assert k.figures(np.zeros((0, 3)))["error"] == "KafkaException: no leader"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--brokers", "1"], "--fault kill-leader needs a Kafka cluster (--brokers 3)"),
        (["--brokers", "3", "--fault-at", "40"], "40 s is not inside a 30 s paced phase"),
    ],
)
def test_a_fault_the_run_cannot_inject_is_refused_before_anything_starts(
    astec_predictor, tmp_path, args, message
):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    res = subprocess.run(
        [*_BENCH, astec_predictor, "--paced-seconds", "30", "--fault", "kill-leader", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=False,
    )
    assert res.returncode == 2 and message in " ".join(res.stderr.split()), res.stderr
    assert not list(tmp_path.iterdir())  # no services started


@pytest.mark.services
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_each_paced_phase_loses_a_leader_and_nothing_acknowledged(astec_predictor, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "bench.json"
    env = {**os.environ, "TMPDIR": str(tmp)}
    for k in ("KAFKA_BOOTSTRAP", "REDIS_URL"):  # the bench starts its own cluster
        env.pop(k, None)
    args = ["--brokers", "3", "--events", "100", "--warmup-events", "0", "--warmup-seconds", "0"]
    args += ["--workers", "2"]
    args += ["--rate", "40", "--rate", "40", "--paced-seconds", "12", "--fault", "kill-leader"]
    args += ["--fault-at", "4", "--delivery", "at-least-once", "--users", "20", "--out", str(out)]
    args += ["--titles", os.path.join(STREAM_DATA, "train.tsv")]
    res = subprocess.run(
        [*_BENCH, astec_predictor, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=400,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    r = json.loads(out.read_text())
    assert r["fault"] == "kill-leader"
    (run,) = r["runs"]
    assert len(run["paced"]) == 2
    for phase in run["paced"]:
        f = phase["fault"]
        assert "error" not in f, f
        assert f["node"] in (1, 2, 3) and 0 <= f["partition"] < r["partitions"]
        # the kill hit while views flowed, and every acknowledged view was answered after it
        assert phase["complete"] and phase["answered"] == phase["events"] == 480
        assert f["longest_gap_s"] > 0 and f["minute_after_covered_s"] > 5
        assert f["p99_ms_minute_after"] > 0
    assert "killed at 4s: 0 unanswered" in res.stdout
    assert not list(tmp.glob("astec-bench-services-*"))
