"""Data I/O: every format reads what users have on disk, round-trips, and names the bad line."""

import json
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from engine.formats import (
    FormatError,
    detect_format,
    load_dataset,
    read_label_names,
    read_npz,
    read_predictions,
    read_text_lines,
    read_text_tsv,
    read_xc_matrix,
    read_xc_sparse,
    write_label_names,
    write_npz,
    write_predictions,
    write_predictions_csr,
    write_text_tsv,
    write_xc_matrix,
    write_xc_sparse,
)

DEBIAN = Path("/work/shared/data/debian-related")


def _w(tmp_path, name, content):
    p = tmp_path / name
    p.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return p


def _raises(path, line, fragment, fn, *args):
    with pytest.raises(FormatError) as ei:
        fn(path, *args)
    msg = str(ei.value)
    assert msg.startswith(f"{path}:{line}:" if line else f"{path}:"), msg
    assert fragment in msg, msg
    return msg


# --- text TSV -------------------------------------------------------------------------------


def test_tsv_reads_texts_labels_and_unlabelled_points(tmp_path):
    p = _w(tmp_path, "d.tsv", "a game of chess\t3,1,1\nno labels here\t\nx y\t0\n")
    texts, Y = read_text_tsv(p)
    assert texts == ["a game of chess", "no labels here", "x y"]
    assert Y.shape == (3, 4) and Y.dtype == np.float32
    assert Y.toarray().tolist() == [[0, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]
    _, Y = read_text_tsv(p, num_labels=10)
    assert Y.shape == (3, 10)


def test_tsv_round_trip_and_crlf(tmp_path):
    texts = ["alpha beta", "γάμμα unicode", ""]
    Y = sp.csr_matrix(np.array([[1, 0, 1], [0, 0, 0], [0, 1, 0]], dtype=np.float32))
    write_text_tsv(tmp_path / "o.tsv", texts, Y)
    t2, Y2 = read_text_tsv(tmp_path / "o.tsv", 3)
    assert t2 == texts and (Y2 != Y).nnz == 0
    crlf = _w(tmp_path, "crlf.tsv", "a\t1\r\nb\t0,2\r\n")
    t3, Y3 = read_text_tsv(crlf)
    assert t3 == ["a", "b"] and Y3.toarray().tolist() == [[0, 1, 0], [1, 0, 1]]


def test_tsv_writer_rejects_tabs_in_text(tmp_path):
    with pytest.raises(ValueError, match="tab"):
        write_text_tsv(tmp_path / "o.tsv", ["a\tb"], sp.csr_matrix((1, 2), dtype=np.float32))


@pytest.mark.parametrize(
    "content,line,fragment",
    [
        ("ok\t1\nmissing tab 2\n", 2, "tab missing"),
        ("ok\t1\nin\tside\t2\n", 2, "tabs are not allowed"),
        ("ok\t1\nbad\tx,2\n", 2, "'x'"),
        ("ok\t1\nbad\t1,,2\n", 2, "empty label id"),
        ("ok\t1\nbad\t1,2,\n", 2, "empty label id"),
        ("ok\t1\nbad\t2.5\n", 2, "'2.5'"),
        ("ok\t1\nok\t2\nneg\t-3\n", 3, "-3 out of range"),
    ],
)
def test_tsv_errors_name_the_line(tmp_path, content, line, fragment):
    _raises(_w(tmp_path, "bad.tsv", content), line, fragment, read_text_tsv)


def test_tsv_label_id_beyond_num_labels(tmp_path):
    p = _w(tmp_path, "d.tsv", "a\t0\nb\t1,5\n")
    _raises(p, 2, "label id 5 out of range (must be < 5)", read_text_tsv, 5)


def test_empty_file_and_bad_encoding(tmp_path):
    _raises(_w(tmp_path, "e.tsv", b""), None, "empty file", read_text_tsv)
    msg = _raises(
        _w(tmp_path, "enc.tsv", b"ok\t1\ncaf\xe9\t2\n"), 2, "not valid UTF-8", read_text_tsv
    )
    assert "byte offset 8" in msg


def test_label_names_round_trip(tmp_path):
    names = ["libc6", "389 D", "", "python3-numpy"]
    write_label_names(tmp_path / "labels.txt", names)
    assert read_label_names(tmp_path / "labels.txt") == names


# --- Extreme Classification Repository formats ------------------------------------------------

XC = "3 5 4\n0,2 0:1.5 3:0.25\n 1:2\n3 4:1\n"


def test_xc_sparse_reads_header_labels_and_features(tmp_path):
    X, Y = read_xc_sparse(_w(tmp_path, "train.txt", XC))
    assert X.shape == (3, 5) and Y.shape == (3, 4)
    assert np.allclose(X.toarray(), [[1.5, 0, 0, 0.25, 0], [0, 2, 0, 0, 0], [0, 0, 0, 0, 1]])
    assert Y.toarray().tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]]


def test_xc_sparse_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    X = sp.random(20, 30, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    X.data = np.round(X.data, 3)
    Y = sp.random(20, 7, density=0.3, format="csr", dtype=np.float32, random_state=rng)
    Y.data[:] = 1
    write_xc_sparse(tmp_path / "o.txt", X, Y)
    X2, Y2 = read_xc_sparse(tmp_path / "o.txt")
    assert X2.shape == X.shape and Y2.shape == Y.shape
    assert np.allclose(X2.toarray(), X.toarray()) and (Y2 != Y).nnz == 0


@pytest.mark.parametrize(
    "content,line,fragment",
    [
        ("3 5 4\n0 0:1\n1 1:1\n", 3, "header says N=3"),
        ("1 5 4\n0 0:1\n1 1:1\n", 3, "header says N=1"),
        ("2 5 4\n0 0:1\n4 1:1\n", 3, "label id 4 out of range (must be < 4)"),
        ("2 5 4\n0 0:1\n1 5:1\n", 3, "feature id 5 out of range (must be < 5)"),
        ("2 5 4\n0 0:1\n1 3:abc\n", 3, "'abc'"),
        ("2 5 4\n0 0:1\nx,2 3:1\n", 3, "'x'"),
        ("2 5 4\n0 0:1\n1 3: 1\n", 3, "in pair '3:'"),
        ("2 5\n0 0:1\n1 1:1\n", 1, "bad header"),
        ("2 5 4\n0 0:1\n1 1:2:3 4\n", 3, "bad pair '1:2:3'"),
        ("2 5 4\n0 0:1 2\n1 1:2\n", 2, "bad pair '2'"),
        ("2 5 4\n0 0:1\n1 1:nan\n", 3, "not finite"),
        ("2 5 4\n0 0:1\n1 1.5:2\n", 3, "'1.5'"),
    ],
)
def test_xc_sparse_errors_name_the_line(tmp_path, content, line, fragment):
    _raises(_w(tmp_path, "bad.txt", content), line, fragment, read_xc_sparse)


def test_xc_split_files_pairs_and_bare_labels(tmp_path):
    Xf = read_xc_matrix(_w(tmp_path, "trn_X_Xf.txt", "2 4\n0:0.5 3:1\n\n"))
    assert np.allclose(Xf.toarray(), [[0.5, 0, 0, 1], [0, 0, 0, 0]])
    Y = read_xc_matrix(_w(tmp_path, "trn_X_Y.txt", "2 3\n0:1 2:1\n1:1\n"))
    assert Y.toarray().tolist() == [[1, 0, 1], [0, 1, 0]]
    bare = read_xc_matrix(_w(tmp_path, "bare_X_Y.txt", "2 3\n0,2\n1\n"))
    assert (bare != Y).nnz == 0
    _raises(
        _w(tmp_path, "oob_X_Y.txt", "2 3\n0:1\n3:1\n"),
        3,
        "column id 3 out of range",
        read_xc_matrix,
    )
    write_xc_matrix(tmp_path / "o.txt", Xf)
    assert np.allclose(read_xc_matrix(tmp_path / "o.txt").toarray(), Xf.toarray())


# --- predictions and npz ------------------------------------------------------------------------


def test_predictions_keep_best_first_order(tmp_path):
    p = _w(tmp_path, "pred.txt", "7:0.9 2:0.5 4:0.1\n\n3:0.7\n")
    M = read_predictions(p, num_labels=10)
    assert M.shape == (3, 10)
    assert M.indices[M.indptr[0] : M.indptr[1]].tolist() == [7, 2, 4]
    assert M.indptr.tolist() == [0, 3, 3, 4]
    _raises(_w(tmp_path, "bad.txt", "1:0.5\n2:zz\n"), 2, "'zz'", read_predictions)


def test_write_predictions_dense_and_csr(tmp_path):
    ids = np.array([[5, 1, -1], [0, 2, 3]])
    scores = np.array([[0.9, 0.4, 0.0], [0.8, 0.7, 0.1]], dtype=np.float32)
    write_predictions(tmp_path / "p.txt", ids, scores)
    assert (tmp_path / "p.txt").read_text().splitlines() == ["5:0.9 1:0.4", "0:0.8 2:0.7 3:0.1"]
    S = sp.csr_matrix(np.array([[0.1, 0.0, 0.9, 0.5]], dtype=np.float32))
    write_predictions_csr(tmp_path / "q.txt", S)
    assert (tmp_path / "q.txt").read_text() == "2:0.9 3:0.5 0:0.1\n"


def test_npz_round_trip_without_pickle(tmp_path):
    S = sp.random(5, 9, density=0.4, format="csr", dtype=np.float32, random_state=1)
    write_npz(tmp_path / "score.npz", S)
    assert detect_format(tmp_path / "score.npz") == "npz"
    assert np.allclose(read_npz(tmp_path / "score.npz").toarray(), S.toarray())
    _raises(_w(tmp_path, "not.npz", "hello\n"), None, "not a scipy sparse .npz", read_npz)


# --- load_dataset -------------------------------------------------------------------------------


def test_load_dataset_tsv_uses_sibling_label_names(tmp_path):
    _w(tmp_path, "labels.txt", "a\nb\nc\nd\ne\n")
    ds = load_dataset(_w(tmp_path, "train.tsv", "t one\t0,1\nt two\t1\n"))
    assert ds.Y.shape == (2, 5) and ds.label_names[4] == "e" and ds.X is None
    assert ds.texts == ["t one", "t two"] and ds.source.startswith("text-tsv:")
    few = _w(tmp_path, "few.txt", "a\n")
    # the data file's line holding the first id beyond the names, and the names file
    with pytest.raises(FormatError) as ei:
        load_dataset(tmp_path / "train.tsv", few)
    assert str(ei.value).startswith(f"{tmp_path / 'train.tsv'}:1: label id 1, but {few} names")


def test_load_dataset_xc_single_split_and_raw_text(tmp_path):
    ds = load_dataset(_w(tmp_path, "train.txt", XC))
    assert ds.X.shape == (3, 5) and ds.Y.shape == (3, 4) and ds.texts is None
    _w(tmp_path, "trn_X_Xf.txt", "2 4\n0:0.5 3:1\n1:1\n")
    _w(tmp_path, "trn_X_Y.txt", "2 3\n0:1 2:1\n1:1\n")
    ds = load_dataset(tmp_path / "trn_X_Xf.txt")
    assert ds.X.shape == (2, 4) and ds.Y.toarray().tolist() == [[1, 0, 1], [0, 1, 0]]
    titles = _w(tmp_path, "trn_X.txt", "first title\nsecond: title\n")
    ds = load_dataset(titles)  # finds trn_X_Y.txt by name
    assert ds.texts == ["first title", "second: title"] and ds.Y.shape == (2, 3)
    other = _w(tmp_path, "titles.txt", "only\none\n")
    assert load_dataset(other, tmp_path / "trn_X_Y.txt").Y.nnz == 3
    _raises(other, None, "without labels", load_dataset)
    assert read_text_lines(other) == ["only", "one"]


@pytest.mark.skipif(not DEBIAN.exists(), reason="debian-related data not present")
def test_debian_related_reads_with_published_counts():
    stats = json.loads((DEBIAN / "stats.json").read_text())
    ds = load_dataset(DEBIAN / "train.tsv")
    assert ds.Y.shape == (stats["N_train"], stats["L"])
    assert ds.Y.nnz / ds.Y.shape[0] == pytest.approx(stats["avg_labels_per_point"], abs=1e-3)
