"""The compiled serving pass logs what the numpy definition gives: policy.explore's choice for
the same uniforms, its propensities and probabilities, the candidates by descending
probability and explain.margins."""

import numpy as np
import pytest

from personalization.explain import margins
from personalization.policy import explore
from personalization.serve_kernels import serve_rows


@pytest.mark.parametrize(("epsilon", "temperature"), [(0.3, 1.0), (0.1, 2.5), (0.0, 1.0)])
def test_serve_rows_equal_their_numpy_definition(epsilon, temperature):
    rng = np.random.default_rng(3)
    B, C = 400, 12
    cand = rng.choice(60, (B, C)).astype(np.int64)
    n = rng.integers(1, C + 1, B)
    cand[np.arange(C)[None, :] >= n[:, None]] = -1  # rows of 1..C candidates, padding last
    cand[5] = -1
    cand[5, 0] = -1  # a row with nothing to show keeps its first slot (as serve_batch does)
    mask = cand >= 0
    mask[5, 0] = True
    logit = np.where(mask, rng.normal(0, 2, (B, C)), -np.inf).astype(np.float32)
    logit[7, :2] = 1.5  # a tie at the top
    top = np.where(rng.random(B) < 0.8, cand[:, 0], 999)  # the page's top query, or none
    top[9] = -1
    col_ref, prop_ref, probs_ref = explore(
        logit, mask, epsilon, temperature, np.random.default_rng(11)
    )
    col, greedy, p_col, q_col, cand_o, cs, cp, margin = serve_rows(
        logit, mask, cand, epsilon, temperature, np.random.default_rng(11).random(B), top
    )
    R = np.arange(B)
    np.testing.assert_array_equal(col, col_ref)
    np.testing.assert_array_equal(greedy, col == np.argmax(np.where(mask, logit, -np.inf), 1))
    np.testing.assert_allclose(p_col, probs_ref[R, col], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(q_col, prop_ref[R, col], rtol=1e-5, atol=1e-7)
    order = np.argsort(-np.where(mask, probs_ref, -1.0), axis=1, kind="stable")
    want = np.take_along_axis(np.where(mask, cand, -1), order, 1)
    np.testing.assert_array_equal(cand_o, want)
    np.testing.assert_allclose(cs, np.take_along_axis(probs_ref, order, 1) * (want >= 0), atol=1e-6)
    np.testing.assert_allclose(cp, np.take_along_axis(prop_ref, order, 1) * (want >= 0), atol=1e-6)
    np.testing.assert_allclose(margin, margins(cand, probs_ref, col, top), atol=1e-6)
    assert np.isnan(margin[9]) and np.isnan(margin[5])
    np.testing.assert_allclose(cp.sum(1)[~(cand < 0).all(1)], 1.0, atol=1e-5)


def test_page_top_and_sources_follow_their_definitions():
    from personalization.explain import page_top, sources

    rng = np.random.default_rng(4)
    B, K, k = 300, 5, 4
    ids = rng.integers(-1, 30, (B, K, k)).astype(np.int64)
    sc = rng.choice(np.float32([0.1, 0.2, 0.3]), (B, K, k))  # ties: the first one wins
    mask = np.arange(K)[None, :] >= rng.integers(0, K, B)[:, None]
    q = np.where(rng.random(B) < 0.9, ids[:, -1, 0], -1)
    q[:20] = 99  # in no window
    top = page_top(ids[:, -1], sc[:, -1])
    ago = sources(ids, mask, q)
    for b in range(B):
        valid = [j for j in range(k) if ids[b, -1, j] >= 0]
        want = -1
        if valid:
            want = ids[b, -1, max(valid, key=lambda j: (sc[b, -1, j], -j))]
        assert top[b] == want
        hits = [
            a for a in range(K) if mask[b, K - 1 - a] and q[b] >= 0 and q[b] in ids[b, K - 1 - a]
        ]
        assert ago[b] == (hits[0] if hits else -1)
