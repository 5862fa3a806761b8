"""XML metrics: hand-computed cases and a loop-based reference with pyxclib's definitions."""

from math import log, log2

import numpy as np
import pytest
import scipy.sparse as sp

from engine.ranking_metrics import (
    evaluate,
    inv_propensity,
    ndcg,
    precision,
    psndcg,
    psprecision,
    topk,
)


def csr(rows, L):
    """Binary CSR from a list of label-id lists."""
    indptr = np.cumsum([0] + [len(r) for r in rows])
    idx = np.array([i for r in rows for i in r], dtype=np.int32)
    return sp.csr_matrix((np.ones(len(idx), np.float32), idx, indptr), shape=(len(rows), L))


def scores(rows, L):
    """Score CSR from a list of {label: score} dicts (explicit entries only)."""
    indptr = np.cumsum([0] + [len(r) for r in rows])
    idx = np.array([i for r in rows for i in r], dtype=np.int32)
    val = np.array([s for r in rows for s in r.values()], dtype=np.float32)
    return sp.csr_matrix((val, idx, indptr), shape=(len(rows), L))


# point 0: true {0, 2}; point 1: no labels; point 2: true {1}
Y_SMALL = csr([[0, 2], [], [1]], 4)
# ties: point 0 ranks 0, then 1 before 2 (equal scores, lower id first); point 2 ranks 0 then 1
P_SMALL = scores([{2: 0.5, 1: 0.5, 0: 0.9}, {3: 0.7}, {1: 0.2, 0: 0.2}], 4)
IP_SMALL = np.array([1.0, 2.0, 3.0, 4.0])


def test_topk_breaks_ties_by_lower_label_id_and_pads():
    ids = topk(P_SMALL, 3)
    assert ids.tolist() == [[0, 1, 2], [3, -1, -1], [0, 1, -1]]


def test_hand_computed_precision_and_ndcg():
    p = precision(Y_SMALL, P_SMALL, k=5)
    # the no-label point counts as 0; P@5 divides by 5 although points have < 5 predictions
    assert p[0] == pytest.approx(1 / 3)
    assert p[2] == pytest.approx((2 / 3 + 0 + 1 / 3) / 3)
    assert p[4] == pytest.approx((2 / 5 + 0 + 1 / 5) / 3)
    n = ndcg(Y_SMALL, P_SMALL, k=3)
    assert n[0] == pytest.approx(1 / 3)
    idcg0 = 1 + 1 / log2(3)  # point 0 has 2 true labels
    assert n[2] == pytest.approx((1.5 / idcg0 + (1 / log2(3)) / 1) / 3)


def test_hand_computed_psp_and_psndcg_normalised_by_best_ranking():
    psp = psprecision(Y_SMALL, P_SMALL, IP_SMALL, k=3)
    # best top-1: label 2 (1/p = 3) for point 0, label 1 (2) for point 2 -> 5; ours hits 1
    assert psp[0] == pytest.approx(1 / 5)
    assert psp[2] == pytest.approx(1.0)
    psn = psndcg(Y_SMALL, P_SMALL, IP_SMALL, k=3)
    assert psn[0] == pytest.approx(1 / 5)
    idcg0 = 1 + 1 / log2(3)
    ours = (1 + 3 / 2) / idcg0 + 2 / log2(3)
    best = (3 + 1 / log2(3)) / idcg0 + 2
    assert psn[2] == pytest.approx(ours / best)


def test_evaluate_reports_percentages_and_psp_only_with_propensities():
    m = evaluate(Y_SMALL, P_SMALL, ks=(1, 3))
    assert set(m) == {"P@1", "P@3", "nDCG@1", "nDCG@3"}
    assert m["P@1"] == pytest.approx(100 / 3)
    m = evaluate(Y_SMALL, P_SMALL, inv_prop=IP_SMALL)
    assert m["PSP@1"] == pytest.approx(20.0)
    assert m["PSP@3"] == pytest.approx(100.0)
    assert set(m) == {f"{n}@{k}" for n in ("P", "nDCG", "PSP", "PSnDCG") for k in (1, 3, 5)}


def test_perfect_predictions_score_100_on_normalised_metrics():
    Y = csr([[3], [0, 1, 2], [4, 5]], 6)
    ip = inv_propensity(Y)
    # rank true labels by propensity weight, as the best achievable ranking does
    P = Y.multiply(sp.csr_matrix(ip[None, :])).tocsr()
    m = evaluate(Y, P, inv_prop=ip)
    assert m["P@1"] == pytest.approx(100.0)
    for name in ("nDCG", "PSP", "PSnDCG"):
        for k in (1, 3, 5):
            assert m[f"{name}@{k}"] == pytest.approx(100.0), (name, k)


def test_inv_propensity_formula_and_unseen_labels():
    Y = csr([[0]] * 10 + [[]] * 90, 2)  # N = 100, N_0 = 10, N_1 = 0
    A, B = 0.55, 1.5
    C = (log(100) - 1) * (B + 1) ** A
    ip = inv_propensity(Y, A=A, B=B, num_labels=3)  # label 2 never seen in training
    assert ip == pytest.approx([1 + C * 11.5**-A, 1 + C * 1.5**-A, 1 + C * 1.5**-A])
    from_counts = inv_propensity(np.array([10, 0, 0]), n_train=100, A=A, B=B)
    assert from_counts == pytest.approx(ip)
    with pytest.raises(ValueError, match="n_train"):
        inv_propensity(np.array([1, 2]))


def test_arrays_and_csr_inputs_agree():
    ids = np.array([[2, 1, 0], [3, -1, -1], [1, 0, -1]])
    sc = np.array([[0.5, 0.5, 0.9], [0.7, 0, 0], [0.2, 0.2, 0]])
    a = evaluate(Y_SMALL, (ids, sc), inv_prop=IP_SMALL)
    b = evaluate(Y_SMALL, P_SMALL, inv_prop=IP_SMALL)
    assert a == pytest.approx(b)
    ranked = np.array([[0, 1, 2], [3, -1, -1], [0, 1, -1]])
    assert evaluate(Y_SMALL, ranked, inv_prop=IP_SMALL) == pytest.approx(b)
    assert evaluate(Y_SMALL, (ranked, None), inv_prop=IP_SMALL) == pytest.approx(b)


def test_bad_predictions_raise_clear_errors():
    with pytest.raises(ValueError, match="label id 7 is >= the number of labels 4"):
        evaluate(Y_SMALL, np.array([[7], [0], [0]]))
    with pytest.raises(ValueError, match="2 prediction rows but 3 test points"):
        evaluate(Y_SMALL, np.array([[0], [0]]))
    with pytest.raises(ValueError, match="inv_prop has 2 entries"):
        evaluate(Y_SMALL, P_SMALL, inv_prop=np.ones(2))


# ---- loop-based reference (test only), written straight from the definitions -------------


def reference(Y_rows, ranked, ip, k):
    """pyxclib's metrics, one point at a time."""
    n = len(Y_rows)
    P = np.zeros(k)
    N = np.zeros(k)
    psp_num = np.zeros(k)
    psp_den = np.zeros(k)
    psn_num = np.zeros(k)
    psn_den = np.zeros(k)
    for row, pred in zip(Y_rows, ranked, strict=True):
        true = set(row)
        best = sorted(true, key=lambda l: (-ip[l], l))
        for kk in range(1, k + 1):
            top = pred[:kk]
            hits = [l in true for l in top]
            P[kk - 1] += sum(hits) / kk
            idcg = sum(1 / log2(j + 2) for j in range(min(kk, len(true)))) or 1.0
            N[kk - 1] += sum(h / log2(j + 2) for j, h in enumerate(hits)) / idcg
            psp_num[kk - 1] += sum(ip[l] for l, h in zip(top, hits, strict=True) if h) / kk
            psp_den[kk - 1] += sum(ip[l] for l in best[:kk]) / kk
            psn_num[kk - 1] += (
                sum(
                    ip[l] / log2(j + 2) for j, (l, h) in enumerate(zip(top, hits, strict=True)) if h
                )
                / idcg
            )
            psn_den[kk - 1] += sum(ip[l] / log2(j + 2) for j, l in enumerate(best[:kk])) / idcg
    return {"P": P / n, "nDCG": N / n, "PSP": psp_num / psp_den, "PSnDCG": psn_num / psn_den}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_metrics_match_loop_reference_on_random_data(seed):
    rng = np.random.default_rng(seed)
    n, L, k = 200, 30, 7
    Y_rows = [
        sorted(rng.choice(L, size=rng.integers(0, 6), replace=False).tolist()) for _ in range(n)
    ]
    Y = csr(Y_rows, L)
    Y_train = csr([rng.choice(L, size=3, replace=False).tolist() for _ in range(50)], L)
    ip = inv_propensity(Y_train)
    # scores on a coarse grid so ties happen; each point predicts 0..12 labels
    pred_rows = [
        {
            int(l): float(rng.integers(0, 4))
            for l in rng.choice(L, size=rng.integers(0, 13), replace=False)
        }
        for _ in range(n)
    ]
    P = scores(pred_rows, L)
    ranked = [[l for l, _ in sorted(r.items(), key=lambda ls: (-ls[1], ls[0]))] for r in pred_rows]
    ref = reference(Y_rows, ranked, ip, k)
    got = {
        "P": precision(Y, P, k),
        "nDCG": ndcg(Y, P, k),
        "PSP": psprecision(Y, P, ip, k),
        "PSnDCG": psndcg(Y, P, ip, k),
    }
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-10, err_msg=name)
