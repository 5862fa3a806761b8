"""Astec's small torch networks: v = ReLU(E^T x), z = v + ReLU(R v) with ||R||_2 <= lambda.

Inputs are EmbeddingBag-style (flat token ids, offsets, TF-IDF weights) so that the CPU predictor
can be exported without this package; `baked_residual()` gives R with the spectral norm applied.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn


def bag_inputs(X: sp.csr_matrix):
    """(ids int64, offsets int64, weights float32) torch tensors for an EmbeddingBag from csr
    rows."""
    X = sp.csr_matrix(X)
    return (
        torch.from_numpy(X.indices.astype(np.int64)),
        torch.from_numpy(X.indptr[:-1].astype(np.int64)),
        torch.from_numpy(X.data.astype(np.float32)),
    )


class MaskDropout(nn.Module):
    """Inverted dropout whose CPU mask comes from numpy's PCG64 (seeded from torch's generator,
    so torch.manual_seed still fixes it): torch's per-element Bernoulli draws took 1.3 ms of a
    Module I batch's ~28 ms for each of the two dropouts, numpy's 0.3 ms. Elsewhere (a GPU),
    torch's own dropout."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = float(p)
        self._rng: np.random.Generator | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        mask = self.mask(tuple(x.shape))
        assert mask is not None
        return x * torch.from_numpy(mask)

    def mask(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """The next CPU draw's multiplier (0 or 1 / (1 - p), float32); None when no dropout
        applies (eval mode or p = 0)."""
        if not self.training or self.p == 0.0:
            return None
        if self._rng is None:
            self._rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,)).item()))
        if self.p == 0.5:  # the default: one random bit per entry, 22 against 118 us (255 x 300)
            n = int(np.prod(shape))
            bits = np.unpackbits(np.frombuffer(self._rng.bytes((n + 7) // 8), np.uint8), count=n)
            half = bits.reshape(shape).astype(np.float32)
            half *= np.float32(2.0)
            return half
        keep = self._rng.random(shape, dtype=np.float32) >= self.p
        return keep.astype(np.float32) / np.float32(1.0 - self.p)


class SpectralResidual(nn.Module):
    """x + ReLU(R x) where R is rescaled so its spectral norm never exceeds lambda (power
    iteration)."""

    u: torch.Tensor  # the power iteration's left singular vector estimate (a buffer)

    def __init__(self, dim: int, lam: float = 1.0):
        super().__init__()
        self.lam = float(lam)
        self.weight = nn.Parameter(torch.eye(dim))
        u = torch.randn(dim)
        self.register_buffer("u", u / u.norm())
        with torch.no_grad():
            for _ in range(20):
                self._power_step()

    def _power_step(self):
        v = F.normalize(self.weight.t() @ self.u, dim=0)
        self.u.copy_(F.normalize(self.weight @ v, dim=0))

    def effective_weight(self) -> torch.Tensor:
        """R * min(1, lambda / sigma): one power-iteration step per training step (Miyato et al.),
        the exact largest singular value in eval mode so the deployed R never exceeds lambda."""
        if self.training:
            sigma, _, _ = self.training_sigma()
        else:
            sigma = torch.linalg.matrix_norm(self.weight.detach(), ord=2)
        return self.weight * torch.clamp(self.ratio(sigma), max=1.0)

    def training_sigma(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One power-iteration step, then (sigma = u^T W v, u, v), sigma differentiable in W.
        The encoder's hand-written step (`encoder_step`) computes it here too: R starts as the
        identity, where lambda / sigma sits at the clamp's edge, so the two must agree bit for
        bit on which side of it they are."""
        with torch.no_grad():
            self._power_step()
        u = self.u
        v = F.normalize(self.weight.t() @ u, dim=0).detach()
        return u @ self.weight @ v, u, v

    def ratio(self, sigma: torch.Tensor) -> torch.Tensor:
        """lambda / sigma, the scale R gets where it is below 1."""
        return self.lam / sigma.clamp_min(1e-12)

    def forward(self, x: torch.Tensor, dropout: nn.Module | None = None) -> torch.Tensor:
        h = F.relu(F.linear(x, self.effective_weight()))
        return x + (dropout(h) if dropout is not None else h)


class Encoder(nn.Module):
    """Token embeddings E (sparse gradients) + one spectral-norm residual block."""

    def __init__(self, vocab_size: int, dim: int, lam: float = 1.0, dropout: float = 0.5):
        super().__init__()
        self.embed = nn.EmbeddingBag(max(vocab_size, 1), dim, mode="sum", sparse=True)
        nn.init.normal_(self.embed.weight, std=dim**-0.5)
        self.residual = SpectralResidual(dim, lam)
        self.drop = MaskDropout(dropout)

    def v(self, ids, offsets, weights) -> torch.Tensor:
        return F.relu(self.embed(ids, offsets, per_sample_weights=weights))

    def forward(self, ids, offsets, weights) -> torch.Tensor:
        v = self.drop(self.v(ids, offsets, weights))
        return self.residual(v, self.drop)

    def z_from_v(self, v: torch.Tensor) -> torch.Tensor:
        return self.residual(v, self.drop)

    @torch.no_grad()
    def baked_residual(self) -> np.ndarray:
        was = self.training
        self.eval()
        R = self.residual.effective_weight().detach().numpy().copy()
        self.train(was)
        return R


class Classifier(nn.Module):
    """1-vs-all rows W (L x D) and biases b with sparse gradients: only touched rows are updated."""

    def __init__(self, num_labels: int, dim: int):
        super().__init__()
        self.weight = nn.Embedding(max(num_labels, 1), dim, sparse=True)
        self.bias = nn.Embedding(max(num_labels, 1), 1, sparse=True)
        nn.init.xavier_uniform_(self.weight.weight)
        nn.init.zeros_(self.bias.weight)


def svd_embedding_init(X: sp.csr_matrix, Y: sp.csr_matrix, dim: int, seed: int = 0) -> np.ndarray:
    """Token embeddings learnt from the training corpus alone: a rank-`dim` factorisation of the
    L2-normalised token-label co-occurrence matrix X^T Y (tokens that share labels start close),
    rescaled to the random init's per-row norm. Nothing is downloaded (the paper used fastText)."""
    from .sparse import normalize_rows

    M = normalize_rows(sp.csr_matrix(X.T.astype(np.float32)) @ sp.csr_matrix(Y, dtype=np.float32))
    k = int(min(dim, min(M.shape) - 1))
    V = M.shape[0]
    E = np.random.default_rng(seed).normal(0, dim**-0.5, (V, dim)).astype(np.float32)
    if k < 1 or M.nnz == 0:
        return E
    torch.manual_seed(seed)
    A = torch.sparse_csr_tensor(
        torch.from_numpy(M.indptr.astype(np.int64)),
        torch.from_numpy(M.indices.astype(np.int64)),
        torch.from_numpy(M.data),
        size=M.shape,
    ).to_sparse_coo()
    U, S, _ = torch.svd_lowrank(A, q=k, niter=3)
    F_ = (U * S.sqrt()).numpy()
    norms = np.linalg.norm(F_, axis=1, keepdims=True)
    has = norms[:, 0] > 1e-8
    E[has, :k] = F_[has] / norms[has]  # unit rows, like N(0, 1/D) rows in expectation
    if k < dim:
        E[has, k:] *= 0.1
    return E


def dense_bag(encoder: Encoder, X: sp.csr_matrix, batch: int = 4096, what: str = "v") -> np.ndarray:
    """v (or z) for every row of X, in eval mode, as float32 [n, D]."""
    was = encoder.training
    encoder.eval()
    out = np.zeros((X.shape[0], encoder.embed.embedding_dim), dtype=np.float32)
    with torch.no_grad():
        for s in range(0, X.shape[0], batch):
            v = encoder.v(*bag_inputs(X[s : s + batch]))
            if what == "z":
                v = encoder.residual(v)
            out[s : s + batch] = v.numpy()
    encoder.train(was)
    return out
