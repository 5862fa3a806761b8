"""Data-set figures: hand-checked on a tiny matrix, matched to the published debian-related
figures, and `astec data stats` on TSV/XC input and on malformed input."""

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from click.testing import CliRunner

from engine.datastats import dataset_stats
from infra.cli import cli

DEBIAN = Path("/work/shared/data/debian-related")


def test_stats_by_hand():
    # 4 points (one unlabelled), 6 labels (two never used)
    Y = sp.csr_matrix(
        np.array(
            [
                [1, 1, 0, 0, 0, 1],
                [1, 0, 0, 0, 0, 1],
                [1, 0, 1, 0, 0, 1],
                [0, 0, 0, 0, 0, 0],
            ],
            dtype=np.float32,
        )
    )
    s = dataset_stats(Y, texts=["a b c", "d", "e  f", ""])
    assert s["N"] == 4 and s["L"] == 6 and s["nnz"] == 8
    assert s["labels_per_point_mean"] == 2.0 and s["labels_per_point_median"] == 2.5
    assert s["points_with_0_labels"] == 1
    # label counts: [3, 1, 1, 0, 0, 3]
    assert s["points_per_label_mean"] == pytest.approx(8 / 6)
    assert s["points_per_label_median"] == 1.0
    assert s["labels_with_0_points"] == 2
    assert s["frac_labels_le5_points"] == 1.0
    assert s["label_freq_quantiles"]["min"] == 0 and s["label_freq_quantiles"]["max"] == 3
    assert s["words_per_point_mean"] == 1.5  # 3 + 1 + 2 + 0 words
    json.dumps(s)  # JSON-ready


@pytest.mark.skipif(not DEBIAN.exists(), reason="debian-related data not present")
def test_cli_stats_matches_published_debian_figures(tmp_path):
    ref = json.loads((DEBIAN / "stats.json").read_text())
    out = tmp_path / "s.json"
    r = CliRunner().invoke(
        cli, ["data", "stats", str(DEBIAN / "train.tsv"), "--json-out", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "labels_per_point_mean" in r.output
    s = json.loads(out.read_text())
    assert (s["N"], s["L"]) == (ref["N_train"], ref["L"])
    assert s["labels_per_point_mean"] == pytest.approx(ref["avg_labels_per_point"], abs=5e-4)
    assert s["points_per_label_mean"] == pytest.approx(ref["avg_points_per_label"], abs=5e-4)
    assert s["words_per_point_mean"] == pytest.approx(ref["avg_words_per_point"], abs=5e-4)
    assert s["labels_with_0_points"] == ref["labels_with_0_train_points"]
    assert s["frac_labels_le5_points"] == pytest.approx(
        ref["frac_labels_le5_train_points"], abs=5e-5
    )
    assert s["label_freq_quantiles"]["max"] == ref["max_label_train_freq"]
    assert s["points_per_label_median"] == ref["median_label_train_freq"]


def test_cli_stats_on_xc_file_and_bad_file(tmp_path):
    xc = tmp_path / "train.txt"
    xc.write_text("2 5 3\n0,2 0:1 4:0.5\n 1:2\n")
    r = CliRunner().invoke(cli, ["data", "stats", str(xc)])
    assert r.exit_code == 0, r.output
    assert "xc-sparse" in r.output and "features_per_point_mean" in r.output

    bad = tmp_path / "bad.tsv"
    bad.write_text("fine\t1\nbroken line\n")
    r = CliRunner().invoke(cli, ["data", "stats", str(bad)])
    assert r.exit_code != 0
    assert f"{bad}:2: tab missing" in r.output
    assert "Traceback" not in r.output
