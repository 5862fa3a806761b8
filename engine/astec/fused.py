"""Fused CPU kernels for the shortlisted 1-vs-all classifier (Modules III/IV and the re-ranker).

Why: per batch the torch path gathered a [B, K, D] copy of the touched classifier rows, let
autograd scatter a gradient of the same size back, then copied m/v rows in and out of a lazy
Adam: ~40 MB moved several times for ~10 M multiply-adds (Module IV: ~110 s of debian-related's
training). Here one compiled pass scores each point's own candidates straight from W, a second
pass updates each touched row once (gradient, Adam moments and the row, in place), and only the
small [B, D] gradient of z goes back to torch for the encoder. Same loss and the same lazy-Adam
update as `trainer.RowAdam`; float32 sums are ordered differently, so results match to rounding.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _scores_and_dz(z, ptr, lab, y, W, b, scale, g, dz, loss_rows):
    """Per point: logits over its own candidates, g = (sigmoid - y) * scale, dz = sum g W[l]."""
    B, D = z.shape
    for i in prange(B):
        acc = 0.0
        for e in range(ptr[i], ptr[i + 1]):
            row = W[lab[e]]
            s = np.float32(0.0)
            for d in range(D):
                s += row[d] * z[i, d]
            x = s + b[lab[e]]
            # stable BCE with logits and its gradient
            acc += max(x, 0.0) - x * y[e] + math.log1p(math.exp(-abs(x)))
            p = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
            g[e] = np.float32((p - y[e]) * scale)
        loss_rows[i] = acc
        for d in range(D):
            dz[i, d] = 0.0
        for e in range(ptr[i], ptr[i + 1]):
            row = W[lab[e]]
            ge = g[e]
            for d in range(D):
                dz[i, d] += ge * row[d]


@njit(cache=True, nogil=True, parallel=True, fastmath=False)
def _adam_rows(z, order, seg, labels, owner, g, W, b, mW, vW, mb, vb, lr, b1, b2, eps, c1, c2):
    """Each touched label once: its gradient sum_e g_e z_owner(e), then Adam on its row and bias."""
    D = z.shape[1]
    U = labels.size
    for j in prange(U):
        l = labels[j]
        gw = np.zeros(D, np.float32)
        gb = np.float32(0.0)
        for q in range(seg[j], seg[j + 1]):
            e = order[q]
            ge = g[e]
            gb += ge
            zi = z[owner[e]]
            for d in range(D):
                gw[d] += ge * zi[d]
        for d in range(D):
            m = b1 * mW[l, d] + (1.0 - b1) * gw[d]
            v = b2 * vW[l, d] + (1.0 - b2) * gw[d] * gw[d]
            mW[l, d] = m
            vW[l, d] = v
            W[l, d] -= lr * (m / c1) / (math.sqrt(v / c2) + eps)
        m = b1 * mb[l] + (1.0 - b1) * gb
        v = b2 * vb[l] + (1.0 - b2) * gb * gb
        mb[l] = m
        vb[l] = v
        b[l] -= lr * (m / c1) / (math.sqrt(v / c2) + eps)


class FusedClassifierAdam:
    """The classifier rows W [L, D], biases b [L] and their lazy-Adam state, stepped by batch.

    W and b are numpy views of the torch parameters (CPU), so the model object is updated in
    place and saved as before.
    """

    def __init__(self, W: np.ndarray, b: np.ndarray, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.W, self.b = W, b
        self.lr, self.betas, self.eps = float(lr), betas, float(eps)
        self.mW = np.zeros_like(W)
        self.vW = np.zeros_like(W)
        self.mb = np.zeros_like(b)
        self.vb = np.zeros_like(b)
        self.t = 0

    def step(self, z: np.ndarray, ptr: np.ndarray, lab: np.ndarray, y: np.ndarray):
        """One batch: z [B, D] float32, point i's candidates lab[ptr[i]:ptr[i+1]] with 0/1
        targets y. Returns (mean BCE over the candidates, dL/dz [B, D]); W, b are updated."""
        n = lab.size
        B, D = z.shape
        g = np.empty(n, np.float32)
        dz = np.empty((B, D), np.float32)
        loss_rows = np.empty(B, np.float64)
        _scores_and_dz(z, ptr, lab, y, self.W, self.b, 1.0 / max(n, 1), g, dz, loss_rows)
        order = np.argsort(lab, kind="stable")
        sl = lab[order]
        starts = np.flatnonzero(np.r_[True, sl[1:] != sl[:-1]]) if n else np.zeros(0, np.int64)
        seg = np.r_[starts, n].astype(np.int64)
        owner = np.repeat(np.arange(B, dtype=np.int64), np.diff(ptr))
        self.t += 1
        b1, b2 = self.betas
        _adam_rows(z, order, seg, sl[starts], owner, g, self.W, self.b, self.mW, self.vW, self.mb, self.vb,
                   np.float32(self.lr), np.float32(b1), np.float32(b2), np.float32(self.eps),
                   np.float32(1 - b1 ** self.t), np.float32(1 - b2 ** self.t))
        return float(loss_rows.sum()) / max(n, 1), dz
