"""Training loops: Module I (surrogate meta-labels) and Modules III/IV + re-ranker (shortlisted
1-vs-all).

Only the rows a batch touched cost anything: the embedding table and classifier rows are
updated by a row-wise (lazy) Adam. On the CPU the classifier runs as compiled kernels
(`fused`) and the encoder's backward is written out (`encoder_step`); elsewhere (a GPU, or
`fused=False`) the batch gathers its rows as tensors and autograd differentiates it: the same
loss and optimiser either way (tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .config import resolve_precision
from .encoder_step import EncoderStep
from .network import Classifier, Encoder, bag_inputs
from .sampled_head import SampledHead
from .surrogate_head import SurrogateHead


class RowAdam:
    """Adam applied only to the rows a batch touched (lazy Adam, like torch's SparseAdam).

    The batch works on a gathered copy of those rows (index_select), so the gradient is a small
    dense [rows, D] block: no sparse-gradient coalescing, which dominated SparseAdam on CPU.
    """

    def __init__(self, table: torch.Tensor, lr: float, betas=(0.9, 0.999), eps: float = 1e-8):
        self.table, self.lr, self.betas, self.eps = table, lr, betas, eps
        # allocated on the first step (frozen tables never pay for them)
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.t = 0

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return self.table.detach().index_select(0, rows).requires_grad_()

    def _state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.m is None or self.v is None:
            self.m, self.v = torch.zeros_like(self.table), torch.zeros_like(self.table)
        return self.m, self.v

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        """Adam's m and v tables as numpy views (CPU tables)."""
        m, v = self._state()
        return m.numpy(), v.numpy()

    def adam_terms(self):
        """Counts one step and gives the compiled kernels' float32 terms of it: (lr / (1 -
        b1^t), b1, b2, eps, 1 / sqrt(1 - b2^t))."""
        self.t += 1
        b1, b2 = self.betas
        return (
            np.float32(self.lr / (1 - b1**self.t)),
            np.float32(b1),
            np.float32(b2),
            np.float32(self.eps),
            np.float32((1 - b2**self.t) ** -0.5),
        )

    @torch.no_grad()
    def step(self, rows: torch.Tensor, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        if self.table.device.type == "cpu" and self.table.dtype == torch.float32:
            from .fused import adam_on_rows

            m_np, v_np = self.moments()
            adam_on_rows(
                rows.numpy(),
                grad.contiguous().numpy(),
                self.table.detach().numpy(),
                m_np,
                v_np,
                *self.adam_terms(),
            )
            return
        m_all, v_all = self._state()
        self.t += 1
        b1, b2 = self.betas
        m = m_all.index_select(0, rows).mul_(b1).add_(grad, alpha=1 - b1)
        v = v_all.index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m_all.index_copy_(0, rows, m)
        v_all.index_copy_(0, rows, v)
        upd = (m / (1 - b1**self.t)).div_((v / (1 - b2**self.t)).sqrt_().add_(self.eps))
        self.table.data.index_add_(0, rows, upd, alpha=-self.lr)


class DenseAdam:
    """torch.optim.Adam(fused=True)'s update for whole dense tensors (R, Module I's head), called
    as its kernel: the first torch.optim optimiser of a process imports torch's compiler stack
    (0.86 s of every training run, measured alone), and each of its steps passes hooks and
    checks (0.044 against 0.019 ms a step for R alone). The same kernel and arguments: the same
    weights (tests)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> None:
        self.params = list(params)
        self.lr, self.betas, self.eps = lr, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        # a float32 step count per tensor, on its device, as torch's fused Adam keeps it
        self.steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not live:
            return
        steps = [self.steps[i] for i in live]
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(
            [self.params[i] for i in live],
            [self.params[i].grad for i in live],
            [self.m[i] for i in live],
            [self.v[i] for i in live],
            [],
            steps,
            lr=self.lr,
            beta1=self.betas[0],
            beta2=self.betas[1],
            weight_decay=0.0,
            eps=self.eps,
            amsgrad=False,
            maximize=False,
        )


def gathered_v(opt: RowAdam, X: sp.csr_matrix, device: torch.device | None = None):
    """v = ReLU(sum_t x_t e_t) for a batch, over a gathered copy of the touched embedding rows."""
    X = sp.csr_matrix(X)
    dev = device or opt.table.device
    uniq, inv = np.unique(X.indices, return_inverse=True)
    rows = torch.from_numpy(uniq.astype(np.int64)).to(dev)
    Eu = opt.gather(rows)
    v = F.relu(
        F.embedding_bag(
            torch.from_numpy(inv.astype(np.int64).ravel()).to(dev),
            Eu,
            torch.from_numpy(X.indptr[:-1].astype(np.int64)).to(dev),
            mode="sum",
            per_sample_weights=torch.from_numpy(X.data.astype(np.float32)).to(dev),
        )
    )
    return v, rows, Eu


class SparseTargetBCE(torch.autograd.Function):
    """The mean BCE-with-logits of x [B, M] against a sparse target (its nonzeros at (rows,
    cols) with values vals): F.binary_cross_entropy_with_logits' value and gradient without a
    dense [B, M] target. At Module I's 32,768 meta-labels (L = 500k) the dense target and the
    loss's temporaries were ~20 ms of a ~100 ms step."""

    @staticmethod
    def forward(ctx, x, rows, cols, vals):
        ctx.save_for_backward(x, rows, cols, vals)
        return (F.softplus(x).sum() - (x[rows, cols] * vals).sum()) / x.numel()

    @staticmethod
    def backward(ctx, g):
        x, rows, cols, vals = ctx.saved_tensors
        gx = torch.sigmoid(x)
        gx[rows, cols] -= vals  # (rows, cols) distinct: a canonical csr's entries
        return gx.mul_(g / x.numel()), None, None, None


def sparse_target_bce(x: torch.Tensor, Y: sp.csr_matrix) -> torch.Tensor:
    """SparseTargetBCE of logits x against the rows of a canonical csr Y (same shape)."""
    return SparseTargetBCE.apply(x, *csr_coo((Y.indptr, Y.indices, Y.data), x.device))


def csr_coo(y: tuple[np.ndarray, np.ndarray, np.ndarray], device=None):
    """(rows int64, cols int64, values float32) tensors of csr rows (indptr from 0, indices,
    values): SparseTargetBCE's target."""
    ptr, idx, val = y
    rows = torch.from_numpy(np.repeat(np.arange(ptr.size - 1), np.diff(ptr)))
    cols = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    vals = torch.from_numpy(np.asarray(val, dtype=np.float32))
    return rows.to(device), cols.to(device), vals.to(device)


def _batches(n: int, size: int, rng) -> list[np.ndarray]:
    perm = rng.permutation(n)
    return [perm[s : s + size] for s in range(0, n, size)]


def _row_batches(M: sp.csr_matrix, perm: np.ndarray, size: int):
    """(indptr from 0, indices, data) of M[perm[s : s + size]] for s = 0, size, ...: one row
    gather per epoch instead of a scipy fancy index (~0.2 ms) per batch; int64 indptr and
    indices, float32 data."""
    Mp = sp.csr_matrix(M[perm], dtype=np.float32)
    ptr = Mp.indptr.astype(np.int64)
    for s in range(0, len(perm), size):
        e = min(len(perm), s + size)
        a, b = ptr[s], ptr[e]
        yield ptr[s : e + 1] - a, Mp.indices[a:b].astype(np.int64), Mp.data[a:b]


def train_surrogate(
    encoder: Encoder,
    X: sp.csr_matrix,
    Ymeta: sp.csr_matrix,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress: bool = True,
    valid=None,
    decay_epoch: int = 0,
    decay_factor: float = 0.5,
    device: str = "cpu",
    patience: int = 0,
    precision: str = "float32",
    fused: bool = True,
    sampled: int = 0,
    sampled_block: int = 1,
) -> list[dict]:
    """Module I: train E, R0 and a dense meta-label classifier with BCE; returns per-epoch logs.

    valid: optional (X_valid, Ymeta_valid) on which meta-label P@1 is logged each epoch.
    decay_epoch > 0: learning rates are multiplied by decay_factor from that epoch on (step decay).
    patience > 0 (with valid): the schedule follows the validation meta-label P@1 instead: the
    learning rates decay after `patience` epochs without a new best (or at decay_epoch, whichever
    comes first), training stops after `patience` more without one (`epochs` is the cap), and
    the weights of the best epoch are the ones kept (its log entry is marked "kept").
    device: where the batches run (the encoder comes back to the CPU). precision "bfloat16"
    (on the CPU; "auto": where the CPU has it natively): the dense head's products and the
    encoder's residual products in bfloat16 (torch.autocast's roundings; the weights, Adam and
    the loss stay float32). fused (on the CPU): the encoder's backward and the head's written
    out (`encoder_step`, `surrogate_head`); else autograd, as a GPU runs it. sampled > 0: each
    batch scores the label tree's subtrees of sampled_block meta-labels that hold its positive
    ones and this many drawn others (`sampled_head`), where that is fewer than all of them.
    """
    dev = torch.device(device)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    D = encoder.embed.embedding_dim
    Lm = Ymeta.shape[1]
    head = nn.Linear(D, Lm)
    if dev.type != "cpu":
        encoder.to(dev)
        head.to(dev)
    residual = encoder.residual
    opt_s = RowAdam(encoder.embed.weight, lr=lr)
    sampled_head = (
        SampledHead(head, sampled, sampled_block, np.random.default_rng([seed, 1]))
        if 0 < sampled < Lm
        else None
    )
    opt_d = DenseAdam(list(residual.parameters()) + list(head.parameters()), lr=lr)
    Ymeta = sp.csr_matrix(Ymeta, dtype=np.float32)
    Ymeta.sum_duplicates()  # canonical: SparseTargetBCE's entries are distinct
    low = resolve_precision(precision) == "bfloat16" and dev.type == "cpu"
    by_hand = None
    if fused and dev.type == "cpu":
        # E's row update on a second thread beside the head's Adam (`EncoderStep.backward`)
        pool = ThreadPoolExecutor(1) if torch.get_num_threads() > 1 else None
        by_hand = EncoderStep(encoder, opt_s, low=low, pool=pool)
    # the head by hand (buffers allocated once, no autograd): a fraction of autocast +
    # autograd's time per step at every head size
    by_hand_head = (
        SurrogateHead(head, batch_size, low)
        if by_hand is not None and sampled_head is None
        else None
    )
    logs = []
    nb = -(-X.shape[0] // max(batch_size, 1))
    bar = tqdm(total=epochs * nb, desc="Module I", disable=not progress, leave=False, unit="batch")
    decayed, best, since_best = False, -1.0, 0
    best_state: list[torch.Tensor] | None = None
    best_entry: dict = {}
    params = [encoder.embed.weight, *residual.parameters(), *head.parameters()]

    def head_loss(z: torch.Tensor, target) -> float:
        """Autograd through the head (a GPU's path, and the CPU's without fused kernels): leaves the
        gradients of the head and of z; the batch's loss."""
        opt_d.zero_grad()
        if sampled_head is not None:
            loss_s, dz = sampled_head.step(z.detach(), target)
            z.backward(dz)
            return loss_s
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
            logits = head(z)
        loss = SparseTargetBCE.apply(logits.float(), *target)
        loss.backward()
        return loss.item()

    def decay() -> None:
        opt_s.lr *= decay_factor
        opt_d.lr *= decay_factor

    for ep in range(epochs):
        if not decayed and decay_epoch > 0 and ep == decay_epoch:
            decay()
            decayed, since_best = True, 0
        encoder.train()
        t0 = time.time()
        tot = 0.0
        if by_hand is not None:  # the CPU: the encoder's backward (and the head's) written out
            perm = rng.permutation(X.shape[0])
            for xb, yb in zip(
                _row_batches(X, perm, batch_size),
                _row_batches(Ymeta, perm, batch_size),
                strict=True,
            ):
                bar.update(1)
                zb = torch.from_numpy(by_hand.forward(*xb))
                target = csr_coo(yb)
                head_step = by_hand_head or sampled_head
                assert head_step is not None
                loss_b, dz = head_step.step(zb, target)
                by_hand.backward(dz.numpy(), defer=True)  # R's gradient; E's rows deferred
                opt_d.step()
                tot += loss_b * (xb[0].size - 1)
            by_hand.wait()  # E current before the validation and the best epoch's copy
        else:
            for idx in _batches(X.shape[0], batch_size, rng):
                bar.update(1)
                v, rows, Eu = gathered_v(opt_s, X[idx], dev)
                Yb = Ymeta[idx]
                loss_b = head_loss(
                    encoder.z_from_v(encoder.drop(v)),
                    csr_coo((Yb.indptr, Yb.indices, Yb.data), dev),
                )
                opt_s.step(rows, Eu.grad)
                opt_d.step()
                tot += loss_b * len(idx)
        entry = {
            "epoch": ep + 1,
            "loss": tot / max(X.shape[0], 1),
            "seconds": round(time.time() - t0, 2),
        }
        if sampled_head is not None and sampled_head.steps:
            entry["scored_meta_labels"] = round(sampled_head.scored / sampled_head.steps)
            sampled_head.scored = sampled_head.steps = 0
        if valid is not None and valid[0].shape[0] > 0:
            Xv, Yv = valid
            encoder.eval()
            with torch.no_grad():
                top = (
                    head(encoder(*(t.to(dev) for t in bag_inputs(Xv))))
                    .argmax(dim=1)
                    .cpu()
                    .numpy()
                    .copy()
                )
            Yv = sp.csr_matrix(Yv)
            entry["valid_meta_P@1"] = round(
                100.0 * float(np.asarray(Yv[np.arange(Yv.shape[0]), top]).mean()), 2
            )
        logs.append(entry)
        stop = False
        if patience > 0 and "valid_meta_P@1" in entry:
            if entry["valid_meta_P@1"] > best:
                best, since_best = entry["valid_meta_P@1"], 0
                with torch.no_grad():
                    if best_state is None:
                        best_state = [p.detach().clone() for p in params]
                    else:
                        for b, p in zip(best_state, params, strict=True):
                            b.copy_(p)
                best_entry = entry
            else:
                since_best += 1
            if since_best >= patience:
                if decayed:
                    stop = True
                    entry["stopped"] = f"no better validation meta P@1 in {patience} epochs"
                else:
                    decay()
                    decayed, since_best = True, 0
                    entry["decayed"] = True
        if progress:
            tqdm.write(
                f"  Module I epoch {ep + 1}: "
                + ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in entry.items()
                    if k != "epoch"
                )
            )
        if stop:
            break
    bar.close()
    if by_hand is not None and by_hand.pool is not None:
        by_hand.pool.shutdown()
    if best_state is not None:
        with torch.no_grad():
            for b, p in zip(best_state, params, strict=True):
                p.copy_(b)
        best_entry["kept"] = True
    if dev.type != "cpu":
        encoder.to("cpu")
    encoder.eval()
    return logs


def _fused_epoch(fc, by_hand: EncoderStep, X, cand, perm, batch_size: int, bar) -> float:
    """One epoch of the CPU path over the points in `perm` order; returns the summed loss."""
    tot = 0.0
    for (xp, xt, xd), (cp, cl, cd) in zip(
        _row_batches(X, perm, batch_size), _row_batches(cand, perm, batch_size), strict=True
    ):
        bar.update(1)
        if cl.size == 0:
            continue
        z = by_hand.forward(xp, xt, xd)
        # the classifier rows' update overlaps the encoder's backward and the next forward
        loss, dz = fc.step(z, cp, cl, (cd >= 2).astype(np.float32), defer=True)
        by_hand.backward(dz)  # R's and (fine-tuned) E's rows updated
        tot += loss * (xp.size - 1)
    fc.wait()
    return tot


def _candidates(Y: sp.csr_matrix, negatives: sp.csr_matrix) -> sp.csr_matrix:
    """Each point's positives (data 2) and shortlisted negatives (data 1), positives winning."""
    pos = sp.csr_matrix(Y, dtype=np.float32, copy=True)
    pos.eliminate_zeros()
    pos.data[:] = 2.0
    cand = sp.csr_matrix(pos.maximum(sp.csr_matrix(negatives != 0, dtype=np.float32)))
    cand.sort_indices()
    return sp.csr_matrix(cand, dtype=np.float32)


def train_shortlisted(
    encoder: Encoder,
    clf: Classifier,
    X: sp.csr_matrix,
    Y: sp.csr_matrix,
    negatives: sp.csr_matrix,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    seed: int,
    finetune_embeddings: bool,
    finetune_lr: float,
    name: str,
    progress: bool = True,
    device: str = "cpu",
    fused: bool = True,
    valid: Callable[[], float] | None = None,
) -> list[dict]:
    """Modules III/IV (and the re-ranker): 1-vs-all BCE over positives + shortlisted negatives.

    Each point is scored only on its own positives and shortlisted negatives (the paper's loss).
    On CPU (fused=True) the classifier rows are scored and updated by compiled kernels
    (`fused.py`) straight in W; otherwise (a GPU, or fused=False) the batch gathers the union of
    its rows as torch tensors on `device` and autograd + RowAdam update them: the same loss and
    optimiser, so both give the same kind of model. name: the module trained, in the progress
    bar and log lines. valid: the validation objective of the live weights, logged after each
    epoch (whether more or fewer epochs would pay, per data set).
    The encoder's products stay float32: in bfloat16 (as Module I's) test PSP@5 fell in three
    seeds of debian-related (-0.19 on average) for ~1 s of the click log's ~21 s here.
    """
    dev = torch.device(device)
    if dev.type != "cpu":
        fused = False
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n = Y.shape[0]
    cand = _candidates(Y, negatives)
    if dev.type != "cpu":
        encoder.to(dev)
        clf.to(dev)
    opt_e = RowAdam(encoder.embed.weight, lr=finetune_lr)
    threads = torch.get_num_threads()
    if fused:
        from .fused import FusedClassifierAdam

        fc = FusedClassifierAdam(
            clf.weight.weight.detach().numpy(),
            clf.bias.weight.detach().numpy().reshape(-1),
            lr=lr,
            threads=threads,
        )
        by_hand = EncoderStep(
            encoder,
            opt_e if finetune_embeddings else None,
            RowAdam(encoder.residual.weight, lr=lr),
        )
        # the kernels' threads do the bulk of a batch; torch's part (the encoder on 255 rows)
        # gains little from a second thread, whose OpenMP spinning slows the kernels' threads
        torch.set_num_threads(1)
    else:
        opt_r = DenseAdam(encoder.residual.parameters(), lr=lr)
        opt_w = RowAdam(clf.weight.weight, lr=lr)
        opt_b = RowAdam(clf.bias.weight, lr=lr)
    logs = []
    nb = -(-n // max(batch_size, 1))
    bar = tqdm(total=epochs * nb, desc=name, disable=not progress, leave=False, unit="batch")
    try:
        for ep in range(epochs):
            encoder.train()
            t0 = time.time()
            if fused:  # the CPU: classifier kernels and the encoder's backward by hand
                tot = _fused_epoch(fc, by_hand, X, cand, rng.permutation(n), batch_size, bar)
            else:
                tot = 0.0
                for idx in _batches(n, batch_size, rng):
                    bar.update(1)
                    Cb = cand[idx]
                    if Cb.nnz == 0:
                        continue
                    v, rows, Eu = gathered_v(opt_e, X[idx], dev)
                    if not finetune_embeddings:
                        v = v.detach()
                    z = encoder.z_from_v(encoder.drop(v))
                    counts = np.diff(Cb.indptr)
                    B, K = len(idx), int(counts.max())
                    U, inv = np.unique(Cb.indices, return_inverse=True)
                    r = np.repeat(np.arange(B), counts)
                    p = np.arange(Cb.nnz) - Cb.indptr[r]
                    slot = np.zeros((B, K), np.int64)
                    slot[r, p] = inv.ravel()
                    target = np.zeros((B, K), np.float32)
                    target[r, p] = Cb.data >= 2
                    mask = np.zeros((B, K), np.float32)
                    mask[r, p] = 1.0
                    Ut = torch.from_numpy(U.astype(np.int64)).to(dev)
                    Wu, bu = opt_w.gather(Ut), opt_b.gather(Ut)
                    st = torch.from_numpy(slot).to(dev)
                    # each point is scored only on its own positives + shortlist:
                    # [B, K] gathered rows
                    logits = torch.bmm(Wu[st], z.unsqueeze(2)).squeeze(2) + bu[st].squeeze(2)
                    m = torch.from_numpy(mask).to(dev)
                    lossT = (
                        F.binary_cross_entropy_with_logits(
                            logits, torch.from_numpy(target).to(dev), reduction="none"
                        )
                        * m
                    ).sum() / m.sum()
                    opt_r.zero_grad()
                    lossT.backward()
                    opt_w.step(Ut, Wu.grad)
                    opt_b.step(Ut, bu.grad)
                    if finetune_embeddings:
                        opt_e.step(rows, Eu.grad)
                    opt_r.step()
                    tot += float(lossT.item()) * len(idx)
            entry = {
                "epoch": ep + 1,
                "loss": tot / max(n, 1),
                "seconds": round(time.time() - t0, 2),
            }
            if valid is not None:
                entry["valid_objective"] = round(valid(), 3)
            logs.append(entry)
            if progress:
                obj = f", valid {entry['valid_objective']}" if "valid_objective" in entry else ""
                tqdm.write(
                    f"  {name} epoch {ep + 1}: loss={entry['loss']:.4g}{obj} ({entry['seconds']} s)"
                )
    finally:
        bar.close()
        if fused:
            fc.close()
            torch.set_num_threads(threads)
    if dev.type != "cpu":
        encoder.to("cpu")
        clf.to("cpu")
    encoder.eval()
    return logs
