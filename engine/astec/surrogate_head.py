"""Module I's dense head on the CPU without autograd: logits x = z W^T + b over every meta-label,
the SparseTargetBCE loss and its gradient written out as whole-tensor torch ops into buffers
allocated once, the loss's sum as one compiled pass (`softplus_sum`).

Why: at L = 500k the head has 32,768 meta-labels; its three products are most of a batch, but
autograd's path around them (autocast's casts of W, x, the gradient and dW, softplus for the
loss, zeroing the gradients) cost nearly as much again, and each of its [B, L_hat] temporaries
was a fresh mapping whose pages the kernel faulted in and zeroed (large arrays are mapped and
unmapped on every allocation: `model.fixed_mmap_threshold`). In bfloat16 the products and
their roundings are autocast's (z, W, b and the gradient of x rounded to bfloat16, float32
outputs); the bias gradient is summed in float32 before rounding.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit
from torch import nn

from .encoder_step import mm_low
from .sparse import row_parts

_CHUNK = 512  # factors per product of the loss's sum of logs (each >= 0.5: >= 1e-154)
_SPLIT_FROM = 1 << 21  # logits per thread of the loss's sum at least


class SurrogateHead:
    """`step(z, y) -> (loss, dz)` for batches of at most `batch` rows through `head`: sets
    head.weight.grad and head.bias.grad (the same tensors every step, for the caller's
    optimiser) and returns the mean BCE-with-logits over the batch's [B, L_hat] logits and
    dL/dz (float32). low: bfloat16 products."""

    def __init__(self, head: nn.Linear, batch: int, low: bool):
        self.head, self.low = head, low
        W = head.weight.detach()
        L, D = W.shape
        f32, lo = torch.float32, torch.bfloat16 if low else torch.float32
        self.Wc = torch.empty((L, D), dtype=lo) if low else W
        self.bc = torch.empty(L, dtype=lo) if low else head.bias.detach()
        self.x = torch.empty((batch, L), dtype=lo)
        self.xf = torch.empty((batch, L), dtype=f32) if low else self.x
        self.g = torch.empty((batch, L), dtype=f32)
        self.gc = torch.empty((batch, L), dtype=lo) if low else self.g
        self.dWc = torch.empty((L, D), dtype=lo)
        head.weight.grad = self.dW = torch.empty((L, D), dtype=f32) if low else self.dWc
        head.bias.grad = self.db = torch.empty(L, dtype=f32)

    def step(
        self, z: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[float, torch.Tensor]:
        """target: the batch's meta-labels as (rows, cols, values), distinct entries
        (`trainer.csr_coo`)."""
        B = z.shape[0]
        W, b = self.head.weight.detach(), self.head.bias.detach()
        if self.low:
            self.Wc.copy_(W)
            self.bc.copy_(b)
            zc = z.to(torch.bfloat16)
        else:
            zc = z
        x, xf, g, gc = (a[:B] for a in (self.x, self.xf, self.g, self.gc))
        torch.addmm(self.bc, zc, self.Wc.t(), out=x)
        if self.low:
            xf.copy_(x)
        rows, cols, vals = target
        n = xf.numel()
        torch.sigmoid(xf, out=g)
        loss = (softplus_sum(xf.numpy(), g.numpy()) - float((xf[rows, cols] * vals).sum())) / n
        g[rows, cols] -= vals  # (rows, cols) distinct
        g.mul_(1.0 / n)
        torch.sum(g, 0, out=self.db)
        if self.low:
            gc.copy_(g)
        torch.mm(gc.t(), zc, out=self.dWc)
        if self.low:
            self.dW.copy_(self.dWc)
        self.head.weight.grad, self.head.bias.grad = self.dW, self.db
        return loss, mm_low(gc, self.Wc) if self.low else torch.mm(gc, self.Wc)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy")
def _softplus_rows(x, s, a, b):
    tot = 0.0
    m = x.shape[1]
    for r in range(a, b):
        for j in range(0, m, _CHUNK):
            p, relu = 1.0, 0.0
            for q in range(j, min(m, j + _CHUNK)):
                v = s[r, q]
                p *= max(v, np.float32(1.0) - v)
                relu += max(x[r, q], np.float32(0.0))
            tot += relu - np.log(p)
    return tot


def softplus_sum(x: np.ndarray, s: np.ndarray) -> float:
    """sum log(1 + e^x) over float32 [B, L] logits x from s = sigmoid(x), in one pass without
    a transcendental per element: softplus(x) = max(x, 0) - log(max(s, 1 - s)), the logs taken
    of float64 products of 512 factors (each in [0.5, 1], so none underflows). Rows are split
    over torch's threads from 2^21 logits per thread (below, a thread pool started beside
    torch's spinning threads cost more than the split saved: 1.8 against 0.2 ms per 1,024-
    meta-label batch). torch's softplus was ~12 ms of a 32,768-meta-label batch; four torch
    passes computing the same ~10 ms. 1 - s is exact to float32's spacing near 1 (relative
    error below 1e-3 where s > 6e-5, where nearly all of a sum lies)."""
    parts: list[float] = []
    row_parts(
        x.shape[0],
        torch.get_num_threads(),
        lambda a, b: parts.append(_softplus_rows(x, s, a, b)),
        min_rows=max(1, _SPLIT_FROM // max(x.shape[1], 1)),
    )
    return float(sum(parts))
