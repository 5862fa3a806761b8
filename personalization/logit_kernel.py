"""The policy's candidate logits in one compiled call: the serving backend "compiled".

`scoring.candidate_logits` (numpy) is the reference and ONNX Runtime runs the exported graph;
at one event per call both spend most of their time dispatching (ONNX Runtime ~50-60 us for
a few hundred thousand multiply-adds). This kernel does the same maths (torch.nn.GRUCell's
gates, the user vector, the scorer's MLP and linear term) per event in one call: the two
larger products (every step's input projection, every candidate's hidden layer) through BLAS,
the rest in loops. It skips the GRU and the MLP where the scorer's output layer is exactly zero
(a policy whose training kept its linear start): their term is then 0 for every input.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# LLVM may reorder sums and fuse multiply-adds; NaN and infinity keep their meaning (padding
# is -inf)
_FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}


def kernel_weights(w: dict[str, np.ndarray]) -> tuple:
    """The weights as `logits` reads them (the BLAS products' right operands transposed)."""
    f32 = np.float32
    return (
        np.ascontiguousarray(w["gru.w_ih"].T, f32),  # [Din, 3H]
        np.ascontiguousarray(w["gru.b_ih"], f32),
        np.ascontiguousarray(w["gru.w_hh"], f32),  # [3H, H]
        np.ascontiguousarray(w["gru.b_hh"], f32),
        np.ascontiguousarray(w["user.w"], f32),  # [Q, H]
        np.ascontiguousarray(w["user.b"], f32),
        np.ascontiguousarray(w["query_table"], f32),  # [L, Q]
        np.ascontiguousarray(w["mlp.w1"].T, f32),  # [F+Q, M]
        np.ascontiguousarray(w["mlp.b1"], f32),
        np.ascontiguousarray(w["mlp.w2"][0], f32),  # [M]
        float(w["mlp.b2"][0]),
        np.ascontiguousarray(w["lin.w"], f32),  # [F]
        bool(np.any(w["mlp.w2"] != 0)),
    )


def candidate_logits(kw: tuple, z, state_mask, cand_ids, cand_mask, feats) -> np.ndarray:
    """Logits [B,C] (-inf on padding) of an EventBatch's fields, `kw` = kernel_weights(w)."""
    return logits(
        np.ascontiguousarray(z, np.float32),
        np.ascontiguousarray(state_mask, np.bool_),
        np.ascontiguousarray(cand_ids, np.int64),
        np.ascontiguousarray(cand_mask, np.bool_),
        np.ascontiguousarray(feats, np.float32),
        *kw,
    )


@njit(cache=True, nogil=True, boundscheck=False, fastmath=_FAST)
def _matvec(W, x, bias, out):
    """out <- W @ x + bias for W [m, n] (each output one contiguous dot product: a reduction
    into a local, which LLVM vectorises; accumulating into `out` it cannot prove unaliased)."""
    n = x.shape[0]
    for j in range(W.shape[0]):
        acc = np.float32(0.0)
        for i in range(n):
            acc += W[j, i] * x[i]
        out[j] = acc + bias[j]


@njit(cache=True, nogil=True, boundscheck=False)
def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


@njit(cache=True, nogil=True, boundscheck=False, fastmath=_FAST)
def logits(
    z, state_mask, cand_ids, cand_mask, feats,
    wx, bx, wh, bh, uw, ub, qtab, w1, b1, w2, b2, lin, dense,
):  # fmt: skip
    """Logits [B,C] (-inf where cand_mask is False) of right-aligned windows z [B,K,Din] /
    state_mask [B,K] and candidates cand_ids / cand_mask [B,C] with hand features feats
    [B,C,F] (personalization.features.EventBatch); dense False: the linear term only."""
    B, K, _ = z.shape
    C, F = feats.shape[1], feats.shape[2]
    H = wh.shape[1]
    Q = uw.shape[0]
    M = w1.shape[1]
    out = np.full((B, C), -np.inf, np.float32)
    h = np.zeros(H, np.float32)
    gi = np.empty((K, 3 * H), np.float32)
    X = np.empty((C, F + Q), np.float32)
    gh = np.empty(3 * H, np.float32)
    u = np.empty(Q, np.float32)
    hid = np.empty((C, M), np.float32)
    for b in range(B):
        if dense:
            np.dot(z[b], wx, gi)  # [K, 3H]: one BLAS product for every step
            h[:] = 0.0
            for t in range(K):  # torch's loop: a masked slot keeps the state
                if not state_mask[b, t]:
                    continue
                _matvec(wh, h, bh, gh)
                for j in range(H):
                    r = _sigmoid(gi[t, j] + bx[j] + gh[j])
                    uz = _sigmoid(gi[t, H + j] + bx[H + j] + gh[H + j])
                    n = math.tanh(gi[t, 2 * H + j] + bx[2 * H + j] + r * gh[2 * H + j])
                    h[j] = n + uz * (h[j] - n)
            _matvec(uw, h, ub, u)
            for q in range(Q):
                u[q] = math.tanh(u[q])
            # the scorer's hidden layer for every candidate: one BLAS product
            for c in range(C):
                X[c, :F] = feats[b, c]
                qid = cand_ids[b, c] if cand_mask[b, c] else 0
                for q in range(Q):
                    X[c, F + q] = qtab[qid, q] * u[q]
            np.dot(X, w1, hid)  # [C, M]
        for c in range(C):
            if not cand_mask[b, c]:
                continue
            s = np.float32(0.0)
            for f in range(F):
                s += lin[f] * feats[b, c, f]
            s += b2
            if dense:
                for m in range(M):
                    a = hid[c, m] + b1[m]
                    if a > 0.0:
                        s += w2[m] * a
            out[b, c] = s
    return out
