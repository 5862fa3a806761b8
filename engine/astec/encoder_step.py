"""The encoder's training step on the CPU with its backward pass written out: v = ReLU(E^T x),
z = d1(v) + d2(ReLU(c R d1(v))), c = min(1, lambda / sigma(R)) (one power-iteration step per
batch, as `network.SpectralResidual`), and lazy Adam on the touched rows of E.

Why: through autograd a Module IV batch (255 titles, D = 300) spent ~6 ms of its ~9 ms in ~60
small torch ops (the gather of E's rows, the power iteration, two dropouts, their backward
nodes, the row optimiser) around three 255 x 300 x 300 products; here the same arithmetic is
those products plus two compiled passes over the batch's tokens (the bag reads E's rows in
place; the update sums each token's gradient and applies Adam to its row in one pass, the
classifier's row kernel). The same function, gradient (test against autograd), dropout draws
and Adam. A GPU keeps autograd (`trainer`).

low (`training.precision` bfloat16): the three residual products take bfloat16 inputs and give
bfloat16 results, as torch.autocast rounds them (float32 E, R, Adam and the rest): about a third
of float32's time on a CPU with native bfloat16 products.

pool + backward(defer=True) (Module I): the update of E's rows runs on a second thread while the
caller steps the head's Adam; the next forward draws its dropout masks and R's power iteration
first, then waits for it (the same arithmetic: the same weights; the update overlaps the
head's Adam).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from engine.prefetch import prefetch_row

from .fused import _AHEAD, _FM, _adam_rows, _group_by_label, adam_on_rows
from .network import Encoder


@njit(cache=True, nogil=True, fastmath=_FM, error_model="numpy")
def _bag(indptr, tok, x, E, v):
    """v[i] = ReLU(sum_e x_e E[tok_e]) over row i's entries, reading E's rows in place."""
    D = v.shape[1]
    end = indptr[-1]
    for i in range(v.shape[0]):
        for d in range(D):
            v[i, d] = 0.0
        for e in range(indptr[i], indptr[i + 1]):
            if e + _AHEAD < end:
                prefetch_row(E, tok[e + _AHEAD])
            row = E[tok[e]]
            w = x[e]
            for d in range(D):
                v[i, d] += w * row[d]
        for d in range(D):
            if v[i, d] < 0.0:
                v[i, d] = 0.0


def mm_low(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bfloat16 matrices, b row-major, as float32 (C order): computed as (b^T a^T)^T,
    which oneDNN's bfloat16 kernels run faster (float32 is no faster that way)."""
    return torch.mm(b.t(), a.t()).t().float().contiguous()


@dataclass
class _Saved:
    """What the backward pass needs from the forward."""

    ptr: np.ndarray  # the batch's rows (csr: int64 indptr and token ids, float32 weights)
    tok: np.ndarray
    x: np.ndarray
    v: np.ndarray  # ReLU(E^T x)
    m1: np.ndarray | None  # scaled dropout masks (None: no dropout)
    vd: np.ndarray
    vd_t: torch.Tensor  # vd as the products read it (bfloat16 where low)
    R_t: torch.Tensor  # R as the forward read it
    pre: np.ndarray  # c R vd, before its ReLU
    m2: np.ndarray | None
    ratio: float  # lambda / sigma: R's scale is c = min(1, ratio)
    sigma: float
    u: np.ndarray
    right: np.ndarray  # the power iteration's right singular vector estimate


class EncoderStep:
    """Forward (`forward(ptr, tok, x) -> z`, a batch's csr rows) and backward (`backward(dz)`)
    of one batch through an Encoder in training mode on the CPU in float32. backward applies
    lazy Adam to the batch's token rows of E when `rows` (a `trainer.RowAdam` over E) is given
    (else E stays frozen), and Adam to R when `residual` (a RowAdam over R) is, else it leaves
    R's gradient in `residual.weight.grad` for the caller's torch optimiser. low: the residual's
    products in bfloat16."""

    def __init__(self, encoder: Encoder, rows=None, residual=None, low: bool = False, pool=None):
        self.encoder, self.rows, self.residual, self.low = encoder, rows, residual, low
        self.E = encoder.embed.weight.detach().numpy()
        self.R = encoder.residual.weight.detach().numpy()
        R = torch.from_numpy(self.R)
        self._R_low = R.to(torch.bfloat16) if low else R  # refreshed from R each forward
        self._all = np.arange(self.R.shape[0], dtype=np.int64)  # R's rows, for its Adam
        self._count = np.zeros(self.E.shape[0], np.int64)  # _group_by_label's scratch
        self._saved: _Saved | None = None
        self.pool = pool  # a ThreadPoolExecutor for backward(defer=True), else None
        self._pending: Future | None = None

    def forward(self, ptr: np.ndarray, tok: np.ndarray, x: np.ndarray) -> np.ndarray:
        shape = (ptr.size - 1, self.E.shape[1])
        res, drop = self.encoder.residual, self.encoder.drop
        # what needs no row of E first, while a deferred update of E's rows may still run
        m1, m2 = drop.mask(shape), drop.mask(shape)  # the draws in the same order as ever
        with torch.no_grad():
            sigma_t, u_t, right_t = res.training_sigma()
            ratio = float(res.ratio(sigma_t))
        self.wait()
        v = np.empty(shape, np.float32)
        _bag(ptr, tok, x, self.E, v)
        vd = v * m1 if m1 is not None else v
        c = min(1.0, ratio)
        vd_t = torch.from_numpy(vd)
        R_t = torch.from_numpy(self.R)
        if self.low:
            vd_t = vd_t.to(torch.bfloat16)
            R_t = self._R_low
            R_t.copy_(torch.from_numpy(self.R))
            pre = torch.mm(vd_t, R_t.t()).float().numpy()
        else:
            pre = torch.mm(vd_t, R_t.t()).numpy()
        if c != 1.0:
            pre *= np.float32(c)
        h = np.maximum(pre, 0.0)
        z = vd + (h * m2 if m2 is not None else h)
        self._saved = _Saved(
            ptr,
            tok,
            x,
            v,
            m1,
            vd,
            vd_t,
            R_t,
            pre,
            m2,
            ratio,
            float(sigma_t),
            u_t.numpy().copy(),
            right_t.numpy(),
        )
        return z

    def backward(self, dz: np.ndarray, defer: bool = False) -> None:
        """defer (with a pool): E's rows are updated on the pool's thread while the caller goes
        on (Module I: the head's Adam); the next forward, or `wait`, finishes it first."""
        s, self._saved = self._saved, None
        if s is None:
            raise RuntimeError("EncoderStep.backward without a forward")
        dz = np.ascontiguousarray(dz, dtype=np.float32)
        dpre = dz * s.m2 if s.m2 is not None else dz.copy()
        dpre *= s.pre > 0
        dzt, dpt = torch.from_numpy(dz), torch.from_numpy(dpre)
        if self.low:
            dpt = dpt.to(torch.bfloat16)
        # pre = vd (c R)^T: d(cR) = dpre^T vd, dvd = dz + dpre (c R)
        dRe = torch.mm(dpt.t(), s.vd_t).float().numpy()
        res = self.encoder.residual
        c = min(1.0, s.ratio)
        if s.ratio <= 1.0:
            # c = lambda / sigma(R) passes a gradient to R too (sigma = u^T R right; torch's
            # clamp passes it where lambda / sigma <= 1)
            k = float(np.vdot(dRe, self.R)) * res.lam / s.sigma**2
            dR = c * dRe - np.float32(k) * np.outer(s.u, s.right).astype(np.float32)
        else:
            dR = dRe
        dR = np.ascontiguousarray(dR, dtype=np.float32)
        if self.rows is not None:  # dv with R as the forward saw it, before R's update
            if self.low:
                dv = mm_low(dpt, s.R_t).mul_(c).add_(dzt).numpy()
            else:
                dv = torch.addmm(dzt, dpt, s.R_t, alpha=c).numpy()
            if s.m1 is not None:
                dv *= s.m1
            dv *= s.v > 0
            mE, vE = self.rows.moments()
            args = (s.tok, s.ptr, dv, s.x, mE, vE, self.rows.adam_terms())
            if defer and self.pool is not None:
                self._pending = self.pool.submit(self._update_rows, *args)
            else:
                self._update_rows(*args)
        if self.residual is not None:
            mR, vR = self.residual.moments()
            adam_on_rows(self._all, dR, self.R, mR, vR, *self.residual.adam_terms())
        else:
            res.weight.grad = torch.from_numpy(dR)

    def _update_rows(self, tok, ptr, dv, x, mE, vE, terms) -> None:
        """Lazy Adam on the batch's token rows of E with their gradient dv (one pass, grouped by
        token)."""
        order, seg, toks, owner = _group_by_label(tok, ptr, self._count)
        none = np.empty(0, np.float32)  # token rows have no bias
        _adam_rows(
            0, toks.size, dv, order, seg, toks, owner, x, self.E, none, mE, vE, none, none, *terms
        )

    def wait(self) -> None:
        """Finish a deferred update of E's rows (E and its moments are current after it)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()
