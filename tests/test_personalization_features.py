"""The sim_* candidate features: the batched computation equals the definition written as a
plain loop, padding never leaks into them, and the query vectors come out unit-length."""

import numpy as np
import pytest

from personalization.features import F, build_batch, pad_states, sim_table_from_rows


def _loop_sims(T, norm, ids, mask, in_block, cand):
    """Definition: cosine of the candidate's vector with each page's normalised summed vector,
    averaged over the current page / the block / the window, then standardised."""
    K = ids.shape[0]
    pages = []
    for t in range(K):
        v = sum((T[q] for q in ids[t] if q >= 0 and mask[t]), np.zeros(T.shape[1], np.float32))
        n = np.linalg.norm(v)
        pages.append(v / n if n > 1e-6 else v)
    cos = [float(T[cand] @ p) for p in pages]
    cur = cos[K - 1]
    blk = np.mean([c for c, b in zip(cos, in_block, strict=True) if b])
    win = np.mean([c for c, m in zip(cos, mask, strict=True) if m])
    return (np.array([cur, blk, win]) - norm[0]) / norm[1]


def test_sim_features_match_their_definition():
    rng = np.random.default_rng(0)
    L, K, k, D = 40, 5, 4, 6
    T = sim_table_from_rows(rng.standard_normal((L, 12)).astype(np.float32) + 1.0, dim=8)
    assert T.shape == (L + 1, 8)
    assert np.allclose(np.linalg.norm(T[:L], axis=1), 1.0, atol=1e-5) and not T[L].any()
    norm = np.array([0.3, 0.2], np.float32)
    seqs = []
    for n in (5, 3, 1):  # full window, partial window, current page only
        ids = rng.choice(L, (n, k), replace=False) if n * k <= L else None
        ids[0, -1] = -1  # a state with fewer queries
        ts = 1.7e9 + np.array([0, 4000, 4040, 4080, 4120][:n], float)  # a block starts at 1
        seqs.append(
            (
                rng.random((n, D)).astype(np.float32),
                ids,
                -np.sort(-rng.random((n, k)).astype(np.float32), 1),
                ts,
            )
        )
    z, ids, sc, mask, ts = pad_states(seqs, K)
    b = build_batch(z, ids, sc, mask, np.zeros(L, np.float32), ts, T, norm)
    cols = [F["sim_current"], F["sim_block"], F["sim_window"]]
    for r in range(len(seqs)):
        in_block = np.zeros(K, bool)
        n = len(seqs[r][0])
        gaps = np.diff(seqs[r][3])
        first_in_block = (
            K - n + (np.flatnonzero(gaps >= 1800).max() + 1 if (gaps >= 1800).any() else 0)
        )
        in_block[first_in_block:] = True
        for c in np.flatnonzero(b.cand_mask[r]):
            want = _loop_sims(T, norm, ids[r], mask[r], in_block, b.cand_ids[r, c])
            assert b.feats[r, c, cols] == pytest.approx(want, abs=1e-4)
        assert not b.feats[r, ~b.cand_mask[r]].any()


def test_sim_features_are_zero_without_a_table():
    rng = np.random.default_rng(1)
    ids = rng.choice(20, (3, 4), replace=False)
    z, I, S, m, ts = pad_states(
        [
            (
                rng.random((3, 5)).astype(np.float32),
                ids,
                np.ones((3, 4), np.float32),
                1.7e9 + 40.0 * np.arange(3),
            )
        ],
        4,
    )
    b = build_batch(z, I, S, m, np.zeros(20, np.float32), ts)
    assert not b.feats[..., [F["sim_current"], F["sim_block"], F["sim_window"]]].any()
    # a table without its cosine statistics is refused by name (it was a TypeError on None)
    T = sim_table_from_rows(rng.standard_normal((20, 12)).astype(np.float32) + 1.0, dim=8)
    with pytest.raises(ValueError, match="sim_table needs sim_norm"):
        build_batch(z, I, S, m, np.zeros(20, np.float32), ts, T)
