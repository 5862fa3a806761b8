"""PECOS XR-Linear as a peer: both benches train and run it in its own environment (made here on
first use, ~15 s of pip), the project's environment never gets libpecos, and the printed
summaries name the fastest and the most accurate peer."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from bench.pecos_worker import topk_ids, topk_pairs
from testkit.astec_cli import astec
from testkit.paths import STREAM_DATA

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def pecos_env():
    """PECOS' environment, made when missing (what `make peers-pecos` does)."""
    from bench import pecos_peer

    try:
        return pecos_peer.env_python(echo=lambda m: print(m, file=sys.stderr))
    except pecos_peer.PecosEnvError as e:  # no package registry reachable from here
        pytest.skip(f"PECOS' environment could not be made: {e}")


def _tiny(tmp_path):
    words = [f"w{i}" for i in range(40)]
    lines = [f"{words[i % 40]} {words[(i * 7) % 40]} item\t{i % 40 // 4}" for i in range(240)]
    data = tmp_path / "DATA"
    data.mkdir()
    (data / "train.tsv").write_text("\n".join(lines[:200]) + "\n")
    (data / "test.tsv").write_text("\n".join(lines[200:]) + "\n")
    (data / "labels.txt").write_text("\n".join(f"label{j}" for j in range(10)) + "\n")
    return data


def test_topk_of_pecos_scores_best_first_ties_to_lower_id_padded():
    P = sp.csr_matrix(
        np.array([[0.1, 0.9, 0.0, 0.9], [0.0, 0.0, 0.0, 0.0], [0.2, 0.0, 0.7, 0.0]], np.float32)
    )
    np.testing.assert_array_equal(topk_ids(P, 3), [[1, 3, 0], [-1, -1, -1], [2, 0, -1]])
    pairs = topk_pairs(P, 2)
    assert [[i for i, _ in row] for row in pairs] == [[1, 3], [], [2, 0]]
    assert pairs[2][0][1] == pytest.approx(0.7)


def test_bench_peers_runs_pecos_in_its_own_environment(pecos_env, tmp_path):
    _tiny(tmp_path)
    out = astec(
        "bench",
        "peers",
        "--train",
        "DATA/train.tsv",
        "--test",
        "DATA/test.tsv",
        "--labels",
        "DATA/labels.txt",
        "--methods",
        "pecos,parabel",
        "--json-out",
        "peers.json",
        timeout=280,
        cwd=tmp_path,
    )
    pecos, parabel = json.loads((tmp_path / "peers.json").read_text())
    assert pecos["method"] == "pecos" and "error" not in pecos, pecos
    assert pecos["P@1"] > 50.0 and pecos["PSP@5"] > 0 and pecos["train_cpu_s"] >= 0.0
    assert pecos["peak_rss_mb"] > 0 and "train_ratio" in pecos and "train_ratio" in parabel
    fastest = min((pecos, parabel), key=lambda r: r["train_s"])["method"]
    assert f"fastest peer: {fastest}" in out, out
    assert "most accurate peer by P@1:" in out and "by PSP@5:" in out
    # the project's own environment keeps its numpy / scipy: libpecos is not in it
    assert importlib.util.find_spec("pecos") is None


def test_bench_predict_serves_pecos_beside_the_predictor(pecos_env, tmp_path):
    from bench.engine_predict import run_bench
    from engine.export import export_model
    from testkit.engine_models import train_small

    train_small(tmp_path / "model")
    export_model(tmp_path / "model", tmp_path / "predictor", progress=False)
    held_out = (Path(STREAM_DATA) / "train.tsv").read_text(encoding="utf-8").splitlines()[480:]
    test = tmp_path / "test.tsv"
    test.write_text("".join(ln + "\n" for ln in held_out))
    rep = run_bench(
        str(tmp_path / "predictor"),
        str(test),
        None,
        STREAM_DATA + "/train.tsv",
        ["predictor", "pecos"],
        n=64,
        n_latency=32,
        k=10,
        peer_dir=str(tmp_path / "peers"),
    )
    assert not rep["skipped"], rep["skipped"]
    pe = rep["systems"]["pecos"]
    assert pe["latency_one_text"]["p50_ms"] > 0 and pe["load_s"] > 0
    assert pe["accuracy"]["P@1"] > 20.0, pe["accuracy"]  # a trained model, not a guess
    assert (tmp_path / "peers" / "pecos").is_dir() and rep["peer_training"]["pecos_train_s"] >= 0
    assert rep["peers"]["fastest_p50"]["system"] == "pecos"
    assert rep["peers"]["most_accurate"]["system"] == "pecos"
    ratio = rep["peers"]["fastest_p50"]["predictor_over_peer_p50"]
    assert ratio == pytest.approx(
        rep["systems"]["predictor"]["latency_one_text"]["p50_ms"]
        / pe["latency_one_text"]["p50_ms"],
        rel=1e-2,
    )
    assert "p50_le_fastest_peer" in rep["targets"]
