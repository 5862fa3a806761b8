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

import itertools
import math
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numba import njit

from engine.prefetch import prefetch_row

# reassociation lets the dot products and row updates use SIMD; no nnan/ninf (the BCE needs them)
_FM = {"reassoc", "contract", "nsz", "arcp"}
# and error_model="numpy" on every kernel: Python's ZeroDivisionError check on each division
# kept the Adam row loops scalar (their denominators are >= eps > 0); vectorised, a Module IV
# step's row updates on the simulated click log took 5-6 ms instead of 11-12 (2 threads)
_AHEAD = 2  # entries (rows) ahead whose classifier rows are prefetched (prefetch.py); 4: slower


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy", inline="always")
def adam_row(g, mr, vr, wr, step, b1, b2, eps, rc2):
    """Adam on one row wr with gradient g and moments mr, vr, in place (step = lr / (1 - b1^t),
    rc2 = 1 / sqrt(1 - b2^t)): the one update every row kernel here applies."""
    one = np.float32(1.0)
    a1, a2 = one - b1, one - b2
    for d in range(g.size):
        m = b1 * mr[d] + a1 * g[d]
        v = b2 * vr[d] + a2 * g[d] * g[d]
        mr[d] = m
        vr[d] = v
        wr[d] -= step * m / (np.sqrt(v) * rc2 + eps)


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy")
def _scores_and_dz(lo, hi, z, ptr, lab, y, W, b, scale, g, dz, loss_rows):
    """Points [lo, hi): logits over their own candidates, g = (sigmoid - y) * scale and
    dz = sum_e g_e W[l_e], in one pass (each row is read once, while it is in cache)."""
    D = z.shape[1]
    end = ptr[hi]
    for i in range(lo, hi):
        acc = 0.0
        for d in range(D):
            dz[i, d] = 0.0
        for e in range(ptr[i], ptr[i + 1]):
            if e + _AHEAD < end:
                prefetch_row(W, lab[e + _AHEAD])
            row = W[lab[e]]
            s = np.float32(0.0)
            for d in range(D):
                s += row[d] * z[i, d]
            x = np.float64(s + b[lab[e]])
            # stable BCE with logits and its gradient
            acc += max(x, 0.0) - x * y[e] + math.log1p(math.exp(-abs(x)))
            p = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
            ge = np.float32((p - y[e]) * scale)
            g[e] = ge
            for d in range(D):
                dz[i, d] += ge * row[d]
        loss_rows[i] = acc


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy")
def _adam_rows(
    lo, hi, z, order, seg, labels, owner, g, W, b, mW, vW, mb, vb, step, b1, b2, eps, rc2
):
    """Touched labels [lo, hi) once each: gradient sum_e g_e z_owner(e), then Adam on the row
    and the bias (float32 throughout; step = lr / (1 - b1^t), rc2 = 1 / sqrt(1 - b2^t)).
    Empty b, mb, vb: rows without a bias (`encoder_step`'s token rows of E)."""
    D = z.shape[1]
    gw = np.zeros(D, np.float32)
    one = np.float32(1.0)
    a1, a2 = one - b1, one - b2
    for j in range(lo, hi):
        l = labels[j]
        if j + _AHEAD < hi:
            nxt = labels[j + _AHEAD]
            prefetch_row(W, nxt)
            prefetch_row(mW, nxt)
            prefetch_row(vW, nxt)
        gw[:] = 0.0
        gb = np.float32(0.0)
        for q in range(seg[j], seg[j + 1]):
            e = order[q]
            ge = g[e]
            gb += ge
            zi = z[owner[e]]
            for d in range(D):
                gw[d] += ge * zi[d]
        adam_row(gw, mW[l], vW[l], W[l], step, b1, b2, eps, rc2)
        if b.size == 0:
            continue
        m = b1 * mb[l] + a1 * gb
        v = b2 * vb[l] + a2 * gb * gb
        mb[l] = m
        vb[l] = v
        b[l] -= step * m / (np.sqrt(v) * rc2 + eps)


@njit(cache=True, nogil=True)
def _group_by_label(lab, ptr, count):
    """The batch's entries grouped by label, as a stable argsort would (without the sort of
    every entry: a fifth of the step's time): (order, seg, labels, owner), entries order[q] for
    q in seg[j]:seg[j+1] being those of labels[j] (ascending), each group in entry order;
    owner[e] the point of entry e. count: an all-zero int64 [L] scratch, left all zero."""
    n = lab.size
    seen = np.empty(n, np.int64)
    nu = 0
    for e in range(n):
        lb = lab[e]
        if count[lb] == 0:
            seen[nu] = lb
            nu += 1
        count[lb] += 1
    if count.size <= 16 * nu:  # a scan of the counts in label order beats sorting the seen
        labels = np.empty(nu, np.int64)
        j = 0
        for lb in range(count.size):
            if count[lb] != 0:
                labels[j] = lb
                j += 1
    else:
        labels = np.sort(seen[:nu])
    seg = np.empty(nu + 1, np.int64)
    s = 0
    for j in range(nu):
        lb = labels[j]
        seg[j] = s
        c = count[lb]
        count[lb] = s  # from here on: the label's next slot in order
        s += c
    seg[nu] = s
    order = np.empty(n, np.int64)
    for e in range(n):
        lb = lab[e]
        order[count[lb]] = e
        count[lb] += 1
    for j in range(nu):
        count[labels[j]] = 0
    owner = np.empty(n, np.int64)
    for i in range(ptr.size - 1):
        for e in range(ptr[i], ptr[i + 1]):
            owner[e] = i
    return order, seg, labels, owner


def _ranges(n: int, parts: int) -> list[tuple[int, int]]:
    cuts = np.linspace(0, n, max(1, parts) + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in itertools.pairwise(cuts) if b > a]


class FusedClassifierAdam:
    """The classifier rows W [L, D], biases b [L] and their lazy-Adam state, stepped by batch.

    W and b are numpy views of the torch parameters (CPU), so the model object is updated in
    place and saved as before.
    """

    def __init__(
        self,
        W: np.ndarray,
        b: np.ndarray,
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        threads: int = 1,
    ):
        self.W, self.b = W, b
        # plain threads over GIL-free kernels: no second OpenMP pool spinning beside torch's
        self.threads = max(1, int(threads))
        self.pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self.lr, self.betas, self.eps = float(lr), betas, float(eps)
        self.mW = np.zeros_like(W)
        self.vW = np.zeros_like(W)
        self.mb = np.zeros_like(b)
        self.vb = np.zeros_like(b)
        self._count = np.zeros(W.shape[0], np.int64)  # scratch of _group_by_label
        self.t = 0
        self._pending: Future | None = None  # a deferred row update (step(defer=True))

    def step(
        self, z: np.ndarray, ptr: np.ndarray, lab: np.ndarray, y: np.ndarray, defer: bool = False
    ):
        """One batch: z [B, D] float32, point i's candidates lab[ptr[i]:ptr[i+1]] with 0/1
        targets y. Returns (mean BCE over the candidates, dL/dz [B, D]); W, b are updated.
        defer: the rows' update runs on one of the kernels' threads while the caller goes on
        (the encoder's backward and the next batch's forward touch no classifier row; z must
        stay as it is); the next step, `wait` or `close` finishes it first."""
        self.wait()
        n = lab.size
        B, D = z.shape
        g = np.empty(n, np.float32)
        dz = np.empty((B, D), np.float32)
        loss_rows = np.empty(B, np.float64)
        scale = np.float64(1.0 / max(n, 1))
        self._run(_scores_and_dz, B, z, ptr, lab, y, self.W, self.b, scale, g, dz, loss_rows)
        order, seg, labels, owner = _group_by_label(lab, ptr, self._count)
        self.t += 1
        b1, b2 = self.betas
        args = (
            z,
            order,
            seg,
            labels,
            owner,
            g,
            self.W,
            self.b,
            self.mW,
            self.vW,
            self.mb,
            self.vb,
            np.float32(self.lr / (1 - b1**self.t)),
            np.float32(b1),
            np.float32(b2),
            np.float32(self.eps),
            np.float32(1 / math.sqrt(1 - b2**self.t)),
        )
        if defer and self.pool is not None:
            self._pending = self.pool.submit(_adam_rows, 0, labels.size, *args)
        else:
            self._run(_adam_rows, labels.size, *args)
        return float(loss_rows.sum()) / max(n, 1), dz

    def wait(self) -> None:
        """Finish a deferred update (W, b and the moments are current after it)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _run(self, kernel, n, *args):
        """kernel(lo, hi, *args) over [0, n), split between the threads (disjoint outputs)."""
        if self.pool is None or n < 64:
            kernel(0, n, *args)
            return
        for f in [self.pool.submit(kernel, lo, hi, *args) for lo, hi in _ranges(n, self.threads)]:
            f.result()

    def close(self):
        self.wait()
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy")
def adam_on_rows(rows, grad, W, mW, vW, step, b1, b2, eps, rc2):
    """Lazy Adam on W[rows] (distinct rows) with their gradient rows grad [len(rows), D], in
    place: what `trainer.RowAdam` does with six gathers and copies, in one pass."""
    for j in range(rows.size):
        l = rows[j]
        adam_row(grad[j], mW[l], vW[l], W[l], step, b1, b2, eps, rc2)
