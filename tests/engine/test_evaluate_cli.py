"""`astec evaluate` on small files: table, JSON, PSP only with --train, clear input errors."""

import json

import numpy as np
import pytest
import scipy.sparse as sp
from click.testing import CliRunner

from engine.ranking_metrics import evaluate, inv_propensity
from infra.cli import cli


@pytest.fixture
def files(tmp_path):
    (tmp_path / "labels.txt").write_text("libc6\ngtk\npython3\nperl\nzlib\n", encoding="utf-8")
    (tmp_path / "train.tsv").write_text(
        "GNU C library\t0\nGTK toolkit\t1,0\nPython interpreter\t2,0\nPerl\t3\n", encoding="utf-8"
    )
    (tmp_path / "test.tsv").write_text(
        "GNU C library docs\t0\nGTK bindings for Python\t1,2\ncompression\t4\n", encoding="utf-8"
    )
    # label 4 (zlib) never occurs in training; point 2 predicts nothing it needs
    (tmp_path / "pred.txt").write_text("0:0.9 1:0.1\n2:0.8 1:0.8 0:0.1\n0:0.3\n", encoding="utf-8")
    return tmp_path


def expected(files, with_train):
    Y = sp.csr_matrix(([1.0] * 4, [0, 1, 2, 4], [0, 1, 3, 4]), shape=(3, 5))
    P = sp.csr_matrix(
        ([0.9, 0.1, 0.8, 0.8, 0.1, 0.3], [0, 1, 2, 1, 0, 0], [0, 2, 5, 6]), shape=(3, 5)
    )
    Yt = sp.csr_matrix(([1.0] * 6, [0, 1, 0, 2, 0, 3], [0, 1, 3, 5, 6]), shape=(4, 5))
    return evaluate(Y, P, inv_prop=inv_propensity(Yt) if with_train else None)


def test_prints_table_and_writes_json_with_psp(files):
    out_json = files / "out" / "metrics.json"
    r = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--test",
            str(files / "test.tsv"),
            "--pred",
            str(files / "pred.txt"),
            "--train",
            str(files / "train.tsv"),
            "--json-out",
            str(out_json),
        ],
    )
    assert r.exit_code == 0, r.output
    want = expected(files, with_train=True)
    lines = {ln.split()[0]: ln.split()[1:] for ln in r.output.splitlines() if ln.strip()}
    assert lines["metric"] == ["@1", "@3", "@5"]
    for name in ("P", "nDCG", "PSP", "PSnDCG"):
        assert [float(x) for x in lines[name]] == pytest.approx(
            [want[f"{name}@{k}"] for k in (1, 3, 5)], abs=0.006
        )
    # P@1: point 0 hits libc6, point 1's tie (python3, gtk at 0.8) puts gtk (lower id) first
    assert want["P@1"] == pytest.approx(200 / 3)
    data = json.loads(out_json.read_text())
    assert data["metrics"] == pytest.approx(want)
    assert data["num_points"] == 3 and data["num_labels"] == 5
    assert data["propensity"] == {"A": 0.55, "B": 1.5}


def test_without_train_says_why_psp_is_missing(files):
    r = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--test",
            str(files / "test.tsv"),
            "--pred",
            str(files / "pred.txt"),
            "--max-k",
            "3",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "PSP/PSnDCG not computed" in r.output and "--train" in r.output
    assert "PSP " not in r.output.replace("PSP/", "")
    assert "@5" not in r.output


def test_npz_predictions_give_the_same_metrics(files):
    P = sp.csr_matrix(
        ([0.9, 0.1, 0.8, 0.8, 0.1, 0.3], [0, 1, 2, 1, 0, 0], [0, 2, 5, 6]),
        shape=(3, 5),
        dtype=np.float32,
    )
    sp.save_npz(files / "pred.npz", P)
    out_json = files / "m.json"
    r = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--test",
            str(files / "test.tsv"),
            "--pred",
            str(files / "pred.npz"),
            "--train",
            str(files / "train.tsv"),
            "--json-out",
            str(out_json),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(out_json.read_text())["metrics"] == pytest.approx(expected(files, True))


def test_point_count_mismatch_fails_clearly(files):
    (files / "short.txt").write_text("0:0.9\n2:0.8\n", encoding="utf-8")
    r = CliRunner().invoke(
        cli, ["evaluate", "--test", str(files / "test.tsv"), "--pred", str(files / "short.txt")]
    )
    assert r.exit_code != 0
    assert "has 2 prediction rows but" in r.output and "has 3 test points" in r.output


def test_label_id_beyond_num_labels_fails_naming_file_and_line(files):
    (files / "bad.txt").write_text("0:0.9\n2:0.8 7:0.5\n0:0.1\n", encoding="utf-8")
    r = CliRunner().invoke(
        cli, ["evaluate", "--test", str(files / "test.tsv"), "--pred", str(files / "bad.txt")]
    )
    assert r.exit_code != 0
    assert "bad.txt:2" in r.output and "7" in r.output
    P = sp.csr_matrix(([1.0], [9], [0, 1, 1, 1]), shape=(3, 10), dtype=np.float32)
    sp.save_npz(files / "bad.npz", P)
    r = CliRunner().invoke(
        cli, ["evaluate", "--test", str(files / "test.tsv"), "--pred", str(files / "bad.npz")]
    )
    assert r.exit_code != 0
    assert "bad.npz" in r.output and "label id 9" in r.output and "only 5 labels" in r.output


def test_without_label_names_a_prediction_above_the_test_max_id_is_a_miss(tmp_path):
    # no labels.txt: L is only known from ids, so label 5 (absent from the test set) is a miss
    (tmp_path / "test.tsv").write_text("a\t0\nb\t1\n", encoding="utf-8")
    (tmp_path / "pred.txt").write_text("0:1 5:0.5\n5:1 1:0.5\n", encoding="utf-8")
    out_json = tmp_path / "m.json"
    r = CliRunner().invoke(
        cli,
        [
            "evaluate",
            "--test",
            str(tmp_path / "test.tsv"),
            "--pred",
            str(tmp_path / "pred.txt"),
            "--json-out",
            str(out_json),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "inferred from label ids" in r.output
    m = json.loads(out_json.read_text())["metrics"]
    assert m["P@1"] == pytest.approx(50.0) and m["P@3"] == pytest.approx(100 / 3)


def test_old_option_spellings_still_work_and_both_at_once_is_an_error(files, tmp_path):
    """Scripts written for `--k` / `--json` keep running (with a warning); mixing old and new
    spellings of one option is refused rather than silently picking one."""
    base = ["evaluate", "--test", str(files / "test.tsv"), "--pred", str(files / "pred.txt")]
    out = tmp_path / "old.json"
    r = CliRunner().invoke(cli, [*base, "--k", "3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "--k is deprecated; use --max-k" in r.output
    assert "@3" in r.output and "@5" not in r.output
    assert json.loads(out.read_text())["metrics"]["P@3"] >= 0
    for both in (["--k", "3", "--max-k", "3"], ["--max-k", "3", "--k", "3"]):
        r = CliRunner().invoke(cli, [*base, *both])
        assert r.exit_code == 2 and "not both" in r.output, r.output
    r = CliRunner().invoke(cli, ["evaluate", "--help"])
    assert "--max-k" in r.output and "--json-out" in r.output
    assert "--k " not in r.output and "--json " not in r.output
