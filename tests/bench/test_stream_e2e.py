"""`astec bench stream` end to end, as a user runs it: it starts its own broker and Redis, every
event of both phases gets its ad, exactly once in exactly-once mode, both delivery modes run side
by side, and the run leaves no service data behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.paths import REPO, STREAM_DATA

pytestmark = [pytest.mark.services, pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(REPO)


def test_bench_stream_answers_every_event_and_removes_its_services(astec_predictor, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "bench.json"
    env = {**os.environ, "TMPDIR": str(tmp)}
    for k in ("KAFKA_BOOTSTRAP", "REDIS_URL"):  # the bench must start its own services
        env.pop(k, None)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "bench",
            "stream",
            "--model",
            astec_predictor,
            "--events",
            "150",
            "--workers",
            "1",
            "--rate",
            "40",
            "--paced-seconds",
            "3",
            "--warmup-events",
            "50",
            "--warmup-seconds",
            "1",
            "--delivery",
            "exactly-once",
            "--delivery",
            "at-least-once",
            "--titles",
            os.path.join(STREAM_DATA, "train.tsv"),
            "--users",
            "20",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=220,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [run["delivery"] for run in r["runs"]] == ["exactly-once", "at-least-once"]
    # one unreported warm-up pass per mode, on its own topics: the measured phases count none of it
    assert r["warmup_events"] == 50
    for mode in ("exactly-once", "at-least-once"):
        assert f"[{mode}] warm-up: 50 events" in res.stdout
        assert f"[{mode}] warm-up: 1s paced at 40/s" in res.stdout
    for run in r["runs"]:
        sat = run["saturation"]
        assert sat["answered"] == sat["events"] == 150 and sat["complete"]
        (paced,) = run["paced"]
        assert paced["complete"] and paced["answered"] == paced["events"] == 120
        assert 0 < paced["e2a_ms"]["p50"] <= paced["e2a_ms"]["p99"]
        assert paced["e2a_ms"]["first_quarter_p99"] > 0 and paced["e2a_ms"]["last_quarter_p99"] > 0
        assert paced["cpu"]["peak_rss_mb"]["broker"] > 0
    assert r["runs"][0]["duplicates_on_output"] == 0
    assert not list(tmp.glob("astec-bench-services-*"))
    assert Path(r["worker_log"]).exists()  # the workers' log stays: the JSON points at it


@pytest.mark.parametrize("command", [["stream", "run"], ["bench", "stream", "--events", "10"]])
def test_a_directory_that_is_no_predictor_is_refused_before_anything_starts(command, tmp_path):
    """One clear error naming the directory and what a model is, not workers restarting on it
    for minutes."""
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    res = subprocess.run(
        [sys.executable, "-m", "infra.cli", *command, "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert res.returncode != 0
    assert f"Error: {tmp_path}: not a model" in res.stderr
    assert "an exported predictor (`astec export`)" in res.stderr
    assert "Traceback" not in res.stderr
    assert not list((tmp_path / "tmp").iterdir())  # no services, no workers' log
