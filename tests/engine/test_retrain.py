"""Retrain from click logs: promote only if not worse, and a kill -9 mid-way changes nothing."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine.formats import read_label_names, read_text_tsv
from engine.registry import Registry
from simulator.traffic import LogSettings, simulate_logs
from simulator.world import generate_world

pytestmark = pytest.mark.slow

TINY = {
    "network": {"embedding_dim": 32},
    "surrogate": {"epochs": 1},
    "shortlist": {"negatives": 50, "knn_neighbours": 10, "centroid_neighbours": 20},
    "extreme": {"epochs": 1},
    "rerank": {"enabled": False},
    "search": {"candidates": 50},
    "training": {"threads": 1},
}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    root = tmp_path_factory.mktemp("retrain")
    world = generate_world(n_queries=1500, n_pages=2500, n_users=20, seed=4)
    simulate_logs(world, root / "logs", LogSettings(days=3, seed=4, search_clicks_per_day=6000))
    (root / "tiny.json").write_text(json.dumps(TINY))
    return root


def _retrain(root, models, *extra, wait=True):
    cmd = [
        sys.executable,
        "-m",
        "infra.cli",
        "retrain",
        "--logs",
        str(root / "logs"),
        "--models",
        str(models),
        "--config",
        str(root / "tiny.json"),
        "--quiet",
        *extra,
    ]
    if not wait:
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd()
        )
    r = subprocess.run(
        cmd, capture_output=True, text=True, cwd=os.getcwd(), timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_promotes_first_then_only_when_not_worse(logs, tmp_path):
    models = tmp_path / "models"
    first = _retrain(logs, models, "--keep", "2")
    reg = Registry(models)
    assert first["promoted"] and first["previous"] is None
    assert reg.current() == first["version"]
    v1 = reg.path(first["version"])
    assert (v1 / "predictor" / "manifest.json").is_file() and (v1 / "data" / "train.tsv").is_file()
    meta = reg.meta(first["version"])
    assert meta["holdout"]["since"] == "2026-01-07" and meta["train_until"] == "2026-01-06"
    assert 0 < meta["metrics_holdout"]["P@1"] <= 100
    # the held-out day is the version's test set, in the model's label space
    test_texts, test_Y = read_text_tsv(v1 / "data" / "test.tsv")
    assert len(test_texts) == meta["data"]["points_test"] > 0
    assert test_Y.shape[1] <= len(read_label_names(v1 / "data" / "labels.txt"))
    # demand an impossible improvement: the new version is kept on disk but not promoted
    second = _retrain(logs, models, "--keep", "2", "--tolerance", "-1000")
    assert not second["promoted"] and second["previous"] == first["version"]
    assert reg.current() == first["version"]
    assert second["metrics_current"]["P@1"] == pytest.approx(first["metrics_new"]["P@1"], abs=1e-6)
    third = _retrain(logs, models, "--keep", "2", "--tolerance", "1000")
    assert third["promoted"] and reg.current() == third["version"]
    assert reg.versions() == [second["version"], third["version"]]  # keep=2 pruned the oldest


def test_killed_retrain_leaves_current_version_untouched(logs, tmp_path):
    models = tmp_path / "models"
    first = _retrain(logs, models)
    reg = Registry(models)
    pointer = (models / "CURRENT").read_bytes()
    proc = _retrain(logs, models, wait=False)
    deadline = time.time() + 120
    staged = None
    while time.time() < deadline and proc.poll() is None:
        staged = [
            d
            for d in (models / "versions").iterdir()
            if d.name.startswith(".staging-") and (d / "data" / "labels.txt").exists()
        ]
        if staged:
            break
        time.sleep(0.02)
    assert staged and proc.poll() is None, "retrain finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)  # mid-training: dataset written, model not yet
    proc.wait()
    assert (models / "CURRENT").read_bytes() == pointer
    assert reg.current() == first["version"] and reg.versions() == [first["version"]]
    assert staged[0].exists()  # the half-built version is left in staging only
    again = _retrain(logs, models)  # the next retrain cleans up and succeeds
    assert not staged[0].exists()
    assert again["promoted"] and reg.current() == again["version"]
    assert len(reg.versions()) == 2
