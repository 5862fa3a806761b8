"""The compiled scorer (the serving backend "compiled") gives the numpy reference's logits,
whatever the windows' lengths and the candidates' padding, and a policy whose scorer output
layer is zero (training kept its linear start) is served by the linear term alone."""

import numpy as np
import pytest

from personalization.features import EventBatch
from personalization.logit_kernel import candidate_logits, kernel_weights
from personalization.scoring import candidate_logits as reference_logits

H, Q, M, F, L, K, C, DIN = 8, 5, 7, 17, 50, 6, 11, 23


def _weights(rng, dense=True):
    def g(*shape):
        return rng.normal(0, 0.4, shape).astype(np.float32)

    return {
        "gru.w_ih": g(3 * H, DIN),
        "gru.b_ih": g(3 * H),
        "gru.w_hh": g(3 * H, H),
        "gru.b_hh": g(3 * H),
        "user.w": g(Q, H),
        "user.b": g(Q),
        "query_table": g(L, Q),
        "log_pop": g(L),
        "mlp.w1": g(M, F + Q),
        "mlp.b1": g(M),
        "mlp.w2": g(1, M) if dense else np.zeros((1, M), np.float32),
        "mlp.b2": g(1),
        "lin.w": g(F),
    }


def _batch(rng, B=40):
    n = rng.integers(1, K + 1, B)  # right-aligned windows of 1..K states
    mask = np.arange(K)[None, :] >= (K - n)[:, None]
    z = np.where(mask[..., None], rng.normal(0, 1, (B, K, DIN)), 0).astype(np.float32)
    z[:, :, -4:] *= rng.random((B, K, 4)) < 0.3  # sparse columns, as the cluster evidence
    c = rng.integers(1, C + 1, B)
    cand_mask = np.arange(C)[None, :] < c[:, None]
    cand = np.where(cand_mask, rng.integers(0, L, (B, C)), -1)
    feats = np.where(cand_mask[..., None], rng.normal(0, 1, (B, C, F)), 0).astype(np.float32)
    return EventBatch(z=z, state_mask=mask, cand_ids=cand, cand_mask=cand_mask, feats=feats)


@pytest.mark.parametrize("dense", [True, False])
def test_compiled_logits_equal_the_numpy_reference(dense):
    rng = np.random.default_rng(5)
    w = _weights(rng, dense)
    b = _batch(rng)
    got = candidate_logits(kernel_weights(w), b.z, b.state_mask, b.cand_ids, b.cand_mask, b.feats)
    want = reference_logits(w, b)
    fin = np.isfinite(want)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.isfinite(got), fin)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    if dense:  # the sequence reaches the logits: other windows, other logits
        z2 = np.ascontiguousarray(b.z[::-1])
        moved = candidate_logits(
            kernel_weights(w), z2, b.state_mask, b.cand_ids, b.cand_mask, b.feats
        )
        assert np.abs(moved[fin] - got[fin]).max() > 1e-3


def test_a_zero_output_layer_serves_the_linear_term_whatever_the_gru():
    rng = np.random.default_rng(6)
    w = _weights(rng, dense=False)
    b = _batch(rng)
    kw = kernel_weights(w)
    assert kw[-1] is False  # the GRU and the MLP are skipped
    lin = b.feats @ w["lin.w"] + w["mlp.b2"][0]
    got = candidate_logits(kw, b.z, b.state_mask, b.cand_ids, b.cand_mask, b.feats)
    np.testing.assert_allclose(got[b.cand_mask], lin[b.cand_mask], rtol=1e-5, atol=1e-5)
    w2 = {**w, "gru.w_ih": w["gru.w_ih"] * 3, "mlp.w1": -w["mlp.w1"]}
    again = candidate_logits(
        kernel_weights(w2), b.z, b.state_mask, b.cand_ids, b.cand_mask, b.feats
    )
    np.testing.assert_array_equal(again, got)
