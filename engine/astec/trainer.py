"""Training loops: Module I (surrogate meta-labels) and Modules III/IV + re-ranker (shortlisted 1-vs-all).

Batches are vectorised: a batch's candidate labels are the union of its points' positives and
shortlists, scored as one [B, U] matrix against gathered classifier rows; the embedding table
and classifier rows get sparse gradients and SparseAdam steps touching only those rows.
"""
from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .network import Classifier, Encoder, bag_inputs


def _batches(n: int, size: int, rng) -> list[np.ndarray]:
    perm = rng.permutation(n)
    return [perm[s:s + size] for s in range(0, n, size)]


def train_surrogate(encoder: Encoder, X: sp.csr_matrix, Ymeta: sp.csr_matrix, epochs: int, lr: float,
                    batch_size: int, seed: int, progress: bool = True, valid=None) -> list[dict]:
    """Module I: train E, R0 and a dense meta-label classifier with BCE; returns per-epoch logs.

    valid: optional (X_valid, Ymeta_valid) on which meta-label P@1 is logged each epoch.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    D = encoder.embed.embedding_dim
    Lm = Ymeta.shape[1]
    head = nn.Linear(D, Lm)
    residual = encoder.residual
    opt_s = torch.optim.SparseAdam(list(encoder.embed.parameters()), lr=lr)
    opt_d = torch.optim.Adam(list(residual.parameters()) + list(head.parameters()), lr=lr)
    Ymeta = sp.csr_matrix(Ymeta, dtype=np.float32)
    logs = []
    for ep in range(epochs):
        encoder.train()
        t0 = time.time()
        tot = 0.0
        batches = _batches(X.shape[0], batch_size, rng)
        for idx in tqdm(batches, desc=f"Module I  epoch {ep + 1}/{epochs}", disable=not progress, leave=False):
            z = encoder(*bag_inputs(X[idx]))
            logits = head(z)
            target = torch.from_numpy(Ymeta[idx].toarray())
            loss = F.binary_cross_entropy_with_logits(logits, target)
            opt_s.zero_grad()
            opt_d.zero_grad()
            loss.backward()
            opt_s.step()
            opt_d.step()
            tot += loss.item() * len(idx)
        entry = {"epoch": ep + 1, "loss": tot / max(X.shape[0], 1), "seconds": round(time.time() - t0, 2)}
        if valid is not None and valid[0].shape[0] > 0:
            Xv, Yv = valid
            encoder.eval()
            with torch.no_grad():
                top = head(encoder(*bag_inputs(Xv))).argmax(dim=1).numpy().copy()
            Yv = sp.csr_matrix(Yv)
            entry["valid_meta_P@1"] = round(100.0 * float(np.asarray(Yv[np.arange(Yv.shape[0]), top]).mean()), 2)
        logs.append(entry)
        if progress:
            tqdm.write(f"  Module I epoch {ep + 1}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                                 for k, v in entry.items() if k != "epoch"))
    encoder.eval()
    return logs


def train_shortlisted(encoder: Encoder, clf: Classifier, X: sp.csr_matrix, Y: sp.csr_matrix,
                      negatives: sp.csr_matrix, epochs: int, lr: float, batch_size: int, seed: int,
                      finetune_embeddings: bool, finetune_lr: float, name: str = "Module IV",
                      progress: bool = True) -> list[dict]:
    """Modules III/IV (and the re-ranker): 1-vs-all BCE over positives + shortlisted negatives.

    Each batch is scored against the union of its points' candidates (positives + negatives);
    a label in the union is a negative for every batch point that does not have it.
    """
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n, L = Y.shape
    Y = sp.csr_matrix(Y, dtype=np.float32)
    cand = sp.csr_matrix(Y + negatives, dtype=np.float32)
    cand.data[:] = 1.0
    opt_c = torch.optim.SparseAdam(list(clf.parameters()), lr=lr)
    opt_r = torch.optim.Adam(list(encoder.residual.parameters()), lr=lr)
    opt_e = torch.optim.SparseAdam(list(encoder.embed.parameters()), lr=finetune_lr) if finetune_embeddings else None
    col = np.full(L, -1, dtype=np.int64)
    logs = []
    for ep in range(epochs):
        encoder.train()
        t0 = time.time()
        tot = 0.0
        for idx in tqdm(_batches(n, batch_size, rng), desc=f"{name} epoch {ep + 1}/{epochs}",
                        disable=not progress, leave=False):
            U = np.unique(cand[idx].indices)
            if U.size == 0:
                continue
            col[U] = np.arange(U.size)
            Yb = Y[idx]
            target = np.zeros((len(idx), U.size), np.float32)
            target[np.repeat(np.arange(len(idx)), np.diff(Yb.indptr)), col[Yb.indices]] = 1.0
            col[U] = -1
            inputs = bag_inputs(X[idx])
            if finetune_embeddings:
                v = encoder.drop(encoder.v(*inputs))
            else:
                with torch.no_grad():
                    v = encoder.v(*inputs)
                v = encoder.drop(v)
            z = encoder.z_from_v(v)
            logits = clf.scores_on(z, torch.from_numpy(U))
            loss = F.binary_cross_entropy_with_logits(logits, torch.from_numpy(target))
            opt_c.zero_grad()
            opt_r.zero_grad()
            if opt_e is not None:
                opt_e.zero_grad()
            loss.backward()
            opt_c.step()
            opt_r.step()
            if opt_e is not None:
                opt_e.step()
            tot += loss.item() * len(idx)
        entry = {"epoch": ep + 1, "loss": tot / max(n, 1), "seconds": round(time.time() - t0, 2)}
        logs.append(entry)
        if progress:
            tqdm.write(f"  {name} epoch {ep + 1}: loss={entry['loss']:.4g} ({entry['seconds']} s)")
    encoder.eval()
    return logs
