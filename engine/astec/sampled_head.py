"""Module I's head over a sample of the meta-labels: each batch scores every meta-label in the
label tree's subtrees of `block` leaves that hold its rows' meta-labels (the positives and
their nearest clusters, the hardest negatives) and `negatives` others drawn uniformly without
replacement, whose loss terms are weighted by the inverse of their chance of being drawn: the
expected gradient of E, R and each row of the head is the full head's.

Why: the full head costs B x L_hat x D x 3 multiply-adds a batch, whatever the batch holds; at
L = 500k (32,768 meta-labels) that is ~95% of Module I in float32 (a 2-core AVX2 CPU: ~200 of
~205 ms a batch). Sampling makes the cost follow the batch. The whole head still steps by
dense Adam on that estimate: lazy Adam (only the scored rows) left the rows seldom scored
behind, as Adam moves a row by about lr whatever its gradient's size (L = 100k, 4,096
meta-labels, 3 epochs: validation meta P@1 73.56 lazy, 75.06 dense, 75.26 the full head).

Off by default (`surrogate.sampled_from`): at the sizes where it saves time it cost final
accuracy (config.py gives the figures). Plain torch ops: the same code on a CPU and a GPU.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class SampledHead:
    """`step(z, target) -> (loss, dz)` for Module I's head `head` [L_hat, D] over meta-labels
    numbered in the tree's order (`clustering.balanced_clusters`): the loss is the estimate of
    the mean BCE over the batch's [B, L_hat] logits; head.weight.grad and head.bias.grad are
    set to the gradient's estimate (zero outside the scored rows), for the caller's dense Adam.
    dz: dL/dz, to back-propagate through the encoder."""

    def __init__(self, head: nn.Linear, negatives: int, block: int, rng: np.random.Generator):
        self.head, self.negatives, self.block, self.rng = head, int(negatives), int(block), rng
        self.dW = torch.zeros_like(head.weight)
        self.db = torch.zeros_like(head.bias)
        self.last: torch.Tensor | None = None  # the rows dW holds
        self.scored = 0  # meta-labels scored, summed over steps (the log's mean width)
        self.steps = 0

    def columns(self, cols: np.ndarray) -> tuple[np.ndarray, int, float]:
        """(scored meta-labels: those always scored, sorted, then the drawn ones; how many are
        always scored; the drawn ones' weight)."""
        Lh = self.head.weight.shape[0]
        S = max(self.block, 1)
        starts = np.unique(np.asarray(cols) // S) * S
        fixed = (starts[:, None] + np.arange(S)).ravel()
        fixed = fixed[fixed < Lh]
        rest = Lh - fixed.size
        if rest <= self.negatives:
            others = np.setdiff1d(np.arange(Lh), fixed, assume_unique=True)
            return np.concatenate([fixed, others]), fixed.size, 1.0
        mask = np.ones(Lh, dtype=bool)
        mask[fixed] = False
        drawn = np.flatnonzero(mask)[self.rng.choice(rest, self.negatives, replace=False)]
        return np.concatenate([fixed, drawn]), fixed.size, rest / self.negatives

    def step(
        self, z: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[float, torch.Tensor]:
        """target: the batch's meta-labels as (rows, cols, values), distinct entries
        (`trainer.csr_coo`)."""
        rows, cols, vals = target
        cols_np = cols.cpu().numpy()
        C, nfix, w = self.columns(cols_np)
        dev = z.device
        Ct = torch.from_numpy(C).to(dev)
        pos_of = torch.from_numpy(np.searchsorted(C[:nfix], cols_np)).to(dev)
        W, b = self.head.weight.detach(), self.head.bias.detach()
        Wc, bc = W.index_select(0, Ct), b.index_select(0, Ct)
        x = torch.addmm(bc, z, Wc.t())
        weight = torch.ones(C.size, dtype=x.dtype, device=dev)
        weight[nfix:] = w
        n = float(x.shape[0] * W.shape[0])
        loss = (F.softplus(x).sum(0) @ weight - (x[rows, pos_of] * vals).sum()) / n
        g = torch.sigmoid(x).mul_(weight)
        g[rows, pos_of] -= vals  # (rows, cols) distinct
        g.mul_(1.0 / n)
        if self.last is not None:  # clear only the rows the previous step wrote
            self.dW.index_fill_(0, self.last, 0.0)
            self.db.index_fill_(0, self.last, 0.0)
        self.dW.index_copy_(0, Ct, g.t() @ z)
        self.db.index_copy_(0, Ct, g.sum(0))
        self.last = Ct
        self.head.weight.grad, self.head.bias.grad = self.dW, self.db
        self.scored += C.size
        self.steps += 1
        return float(loss), g @ Wc
