"""The label-name match: what it scores, that training chooses its weight on validation, and
that the exported predictor adds exactly what the model adds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from engine.export import export_model
from engine.label_text import LabelText
from engine.predictor import Predictor, PredictorError
from testkit.engine_models import assert_model_parity, corpus, model_like, train_small


def _idf(L, df):
    return math.log((L + 1) / (df + 1)) + 1


def test_match_is_the_idf_share_of_the_name_in_the_title():
    names = ["python3-requests", "libssl3", "ant", "python3-lxml", "++", "Émile-2"]
    lt = LabelText(names)
    L = len(names)
    titles = [
        "Python HTTP for humans: requests",
        "SSL library libssl",
        "Another Neat Tool",
        "",
        "émile reader",
    ]
    rows = np.repeat(np.arange(len(titles)), L)
    labels = np.tile(np.arange(L), len(titles))
    m = lt.scores([lt.title_ids(t) for t in titles], rows, labels).reshape(len(titles), L)
    # python3-requests: components (python3|python) and (requests), both found -> 1
    assert m[0, 0] == pytest.approx(1.0)
    # python3-lxml shares only its python component; its idf is lower than lxml's
    py, lxml = _idf(L, 2), _idf(L, 1)
    assert m[0, 3] == pytest.approx(py / (py + lxml))
    # "libssl" in the title is libssl3's digit-less spelling: the whole name
    assert m[1, 1] == pytest.approx(1.0)
    # a name is not matched by words it does not contain, nor by an empty title
    assert m[2, 2] == 0 and (m[3] == 0).all()
    assert (m[:, 4] == 0).all()  # a name with no words scores 0, no crash
    assert m[4, 5] == pytest.approx(_idf(L, 1) / (_idf(L, 1) + _idf(L, 1)))  # unicode, lower-cased
    assert (
        lt.add_to(titles, rows, labels, np.ones(labels.size, np.float32), 0.0).tolist()
        == [1.0] * labels.size
    )


@pytest.mark.parametrize("theta", [0.3, 0.5, 1.0])
def test_candidates_are_every_label_matched_at_least_theta(theta):
    """The inverted index (heaviest components only) finds exactly the labels a brute-force
    scan of every name finds."""
    texts, _, names = corpus()
    lt = LabelText(names)
    titles = [lt.title_ids(t) for t in texts[:120] + names[:40] + ["", "zzzz"]]
    rows, labels = lt.candidates(titles, theta)
    assert (np.diff(rows * len(names) + labels) > 0).all()  # grouped by row, ascending
    want = set()
    for i, t in enumerate(titles):
        m = lt.scores([t], np.zeros(len(names), np.int64), np.arange(len(names)))
        want |= {(i, j) for j in np.nonzero(m >= theta - 1e-6)[0].tolist()}
    assert set(zip(rows.tolist(), labels.tolist(), strict=True)) == want
    assert len(want) >= 40  # at least every name finds itself
    # the predictor's compiled kernels find the same labels and add the same matches
    from engine import kernels

    ptr = np.cumsum([0] + [t.size for t in titles])
    ids = np.concatenate(titles)
    kr, kl = kernels.name_candidates_rows(ptr, ids, *lt._index(theta), lt.piece, lt.weight, theta)
    assert np.array_equal(kr, rows) and np.array_equal(kl, labels)
    y = np.zeros(labels.size, np.float32)
    kernels.add_name_match_rows(rows, labels, y, ptr, ids, lt.piece, lt.weight, 0.5)
    np.testing.assert_allclose(y, 0.5 * lt.scores(titles, rows, labels), atol=1e-6)


def test_single_title_match_by_bitmap_equals_the_search():
    """The single-title kernels look a name's spellings up in a bitmap of the title's ids; the
    batch kernel bisects the sorted ids. Both must give the same float32 sums on every label,
    for titles with repeated words, none of the names' words, or ids at word boundaries."""
    from engine import kernels

    ids = np.array([0, 63, 64, 127, 128, 1000, 64], np.int64)  # unsorted, one repeated
    bits = kernels._bitmap(ids)
    assert [i for i in range(1100) if kernels._has(bits, i)] == [0, 63, 64, 127, 128, 1000]
    assert not kernels._has(kernels._bitmap(np.zeros(0, np.int64)), 0)
    texts, _, names = corpus()
    lt = LabelText(names)
    L = len(names)
    assert len(lt.vocab) > 128  # the bitmaps span several words
    titles = texts[:80] + names[:40] + ["", "zzzz", names[3] + " " + names[3] + " " + names[7]]
    titles += [" ".join(sorted(lt.vocab)[::7])]  # many ids, far apart
    rng = np.random.default_rng(0)
    for t in titles:
        tids = lt.title_ids(t)
        labels = np.arange(L, dtype=np.int64)
        y0 = rng.random(L).astype(np.float32)
        got, want = y0.copy(), y0.copy()
        kernels.add_name_match(labels, got, tids, lt.piece, lt.weight, 0.3)
        ptr = np.array([0, tids.size], np.int64)
        kernels.add_name_match_rows(
            np.zeros(L, np.int64), labels, want, ptr, tids, lt.piece, lt.weight, 0.3
        )
        assert got.tobytes() == want.tobytes()
        for theta in (0.3, 1.0):
            cand = kernels.name_candidates(tids, *lt._index(theta), lt.piece, lt.weight, theta)
            m = lt.scores([tids], np.zeros(L, np.int64), labels)
            assert set(cand.tolist()) == set(np.flatnonzero(m >= theta - 1e-6).tolist())


def test_training_chooses_the_weight_on_validation_and_logs_it(tmp_path):
    model = train_small(tmp_path / "model")
    t = model.train_log["label_text"]
    table = t["label_text_weight_selection"]
    assert [r["label_text_weight"] for r in table] == list(model.config.name_match.grid)
    best = max(table, key=lambda r: r["objective"])["objective"]
    chosen = next(r for r in table if r["label_text_weight"] == t["label_text_weight"])
    assert chosen["objective"] == best and model.label_text_weight == t["label_text_weight"]
    # a model trained without names (or with the feature off) has no match
    assert train_small(tmp_path / "off", name_match={"enabled": False}).label_text is None


def test_predictor_adds_what_the_model_adds(tmp_path):
    """A configured weight reaches the saved model, the export and both predictor paths; it
    changes the ranking (the match is really applied) and the predictor agrees with the model."""
    texts, _, names = corpus()
    model = train_small(tmp_path / "model", name_match={"weight": 0.2})
    assert model.label_text_weight == 0.2 and model.label_text is not None
    export_model(tmp_path / "model", tmp_path / "pred", progress=False)
    p = Predictor.load(tmp_path / "pred")
    assert p.label_text_weight == 0.2
    test = [*texts[480:], names[3], "", "zzzz unknown"]
    ids_t, sc_t = assert_model_parity(model_like(model, tmp_path / "pred"), p, test)
    # labels only their names find join the shortlists of both implementations
    lr, probe = model.learners[0], names[:300]
    X = model.transform(probe)
    plain = lr.shortlist(X, model.config)[0]
    named = lr.shortlist(X, model.config, extra=model._name_candidates(probe))[0]
    added = [
        (i, j) for i in range(len(probe)) for j in set(named[i].indices) - set(plain[i].indices)
    ]
    assert any(j == i for i, j in added)  # a title that is a label's name finds it
    rows, labels = p._name_candidates(p._title_rows(probe))
    assert set(added) <= set(zip(rows.tolist(), labels.tolist(), strict=True))
    # without the match the same learners rank differently on some titles
    model.label_text = None
    ids_0, sc_0 = model.predict(test, k=10)
    assert not np.allclose(sc_0, sc_t)
    # every label ranked both ways scores exactly 0.2 * its match more
    lt = LabelText(names)
    checked = 0
    for r, t in enumerate(test):
        for pos, lab in enumerate(ids_t[r]):
            if lab >= 0 and lab in ids_0[r]:
                m = lt.scores([lt.title_ids(t)], np.zeros(1, np.int64), np.array([lab]))[0]
                assert sc_t[r][pos] == pytest.approx(
                    sc_0[r][list(ids_0[r]).index(lab)] + 0.2 * m, abs=1e-5
                )
                checked += m > 0
    assert checked >= 10
    # a title that is exactly a label's name matches that name fully
    assert lt.scores([lt.title_ids(names[3])], np.zeros(1, np.int64), np.array([3]))[
        0
    ] == pytest.approx(1.0)


def test_bad_weight_in_predictor_config_is_refused(tmp_path):
    from engine.manifest import write_manifest

    train_small(tmp_path / "model")
    export_model(tmp_path / "model", tmp_path / "pred", progress=False)
    cfg_path = tmp_path / "pred" / "predictor.json"
    cfg = json.loads(cfg_path.read_text())
    meta = json.loads((tmp_path / "pred" / "manifest.json").read_text())
    cfg["label_text_weight"] = "lots"
    cfg_path.write_text(json.dumps(cfg))
    write_manifest(tmp_path / "pred", {k: v for k, v in meta.items() if k not in ("files",)})
    with pytest.raises(PredictorError, match="label_text_weight"):
        Predictor.load(tmp_path / "pred")


def test_export_without_label_text_serves_the_model_without_it(tmp_path):
    """`astec export --no-label-text` gives the model's predictions without the match (what
    bench predict's parity then compares against)."""
    from click.testing import CliRunner

    from engine.cli_export import export as export_cmd

    texts, _, names = corpus()
    model = train_small(tmp_path / "model", name_match={"weight": 0.2})
    r = CliRunner().invoke(
        export_cmd,
        ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "p"), "--no-label-text"],
    )
    assert r.exit_code == 0, r.output
    p = Predictor.load(tmp_path / "p")
    assert p.label_text is None and p.label_text_weight == 0
    test = texts[480:] + names[:20]
    m = model_like(model, tmp_path / "p")
    assert m.label_text is None
    assert_model_parity(m, p, test)
