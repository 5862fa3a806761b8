"""`astec retrain` names the GRU policy that no longer fits the engine it promoted (another label
space, or none recorded), with the command that retrains it; a policy of the promoted engine's
label space is not named."""

import json
import subprocess
import sys

import pytest

from engine.manifest import read_manifest
from engine.registry import Registry
from engine.retrain import policies_to_retrain
from simulator.traffic import LogSettings, simulate_logs
from simulator.world import generate_world

pytestmark = pytest.mark.slow

TINY = {
    "embedding_dim": 32,
    "surrogate_epochs": 1,
    "extreme_epochs": 1,
    "reranker": False,
    "num_threads": 1,
    "shortlist_size": 50,
    "predict_shortlist": 50,
    "centroid_neighbours": 20,
    "knn_neighbours": 10,
}


def gru_version(models, manifest: dict) -> str:
    """A promoted GRU registry version whose manifest.json is `manifest` (all the check reads)."""
    reg = Registry(models / "gru")
    st = reg.stage()
    (st.path / "manifest.json").write_text(json.dumps(manifest))
    reg.commit(st, {"kind": "gru-policy"})
    reg.promote(st.version)
    return st.version


def test_retrain_names_the_policy_to_retrain(tmp_path):
    world = generate_world(n_queries=1500, n_pages=2500, n_users=20, seed=4)
    simulate_logs(world, tmp_path / "logs", LogSettings(days=3, seed=4, search_clicks_per_day=6000))
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    models = tmp_path / "models"
    old = gru_version(models, {"engine_version": "old", "engine_label_space": "0" * 64})
    r = subprocess.run(
        [sys.executable, "-m", "infra.cli", "retrain", "--logs", str(tmp_path / "logs"),
         "--models", str(models), "--config", str(tmp_path / "tiny.json"), "--quiet"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["promoted"]
    [p] = out["policies_to_retrain"]
    assert p["version"] == old and p["reason"] == "trained on another label space"
    assert f"GRU policy {old}" in r.stderr and "astec personalize train --logs" in r.stderr
    # the promoted engine's fingerprint: a policy recording it fits; one recording none does not
    space = read_manifest(Registry(models).path(out["version"]) / "predictor")["label_space"]
    assert len(space) == 64
    gru_version(models, {"engine_label_space": space})
    assert policies_to_retrain(models, space) == []
    none = gru_version(models, {"engine_version": out["version"]})
    assert policies_to_retrain(models, space)[0]["version"] == none
    assert "no engine label space" in policies_to_retrain(models, space)[0]["reason"]
