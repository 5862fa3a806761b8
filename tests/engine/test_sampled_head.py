"""Module I's sampled head (`surrogate.sampled_from`): with every meta-label drawn it is the full
head; with few, its gradient is the full head's on average and lies on the scored rows only;
the positives' subtrees are always scored, cluster ids follow the label tree; Module I trains
with it on the CPU's path and on a GPU's the same way."""

import copy

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

from engine.astec.network import Encoder
from engine.astec.sampled_head import SampledHead
from engine.astec.surrogate_head import SurrogateHead
from engine.astec.trainer import DenseAdam, csr_coo, train_surrogate


def _batch(B=6, D=12, L=80, seed=0):
    Y = sp.random(B, L, density=0.05, format="csr", random_state=seed, dtype=np.float32)
    Y.data[:] = 1.0
    torch.manual_seed(seed)
    return torch.randn(B, D), csr_coo((Y.indptr, Y.indices, Y.data)), nn.Linear(D, L)


def test_every_meta_label_drawn_is_the_full_head():
    """negatives >= the meta-labels the batch lacks: the loss, dL/dz and one Adam step of the
    head are the full head's (SurrogateHead + Adam over the whole head)."""
    z, t, full = _batch()
    ours = copy.deepcopy(full)
    loss_f, dz_f = SurrogateHead(full, z.shape[0], low=False).step(z, t)
    DenseAdam(list(full.parameters()), lr=0.01).step()
    loss_s, dz_s = SampledHead(ours, 10_000, 1, np.random.default_rng(0)).step(z, t)
    DenseAdam(list(ours.parameters()), lr=0.01).step()
    assert loss_s == pytest.approx(loss_f, rel=1e-5)
    assert torch.allclose(dz_s, dz_f, atol=1e-7)
    for p, q in zip(full.parameters(), ours.parameters(), strict=True):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-6)


def test_sampled_gradient_is_the_full_one_on_average():
    """8 of ~75 meta-labels drawn a step: dL/dz averaged over 3,000 draws is the full head's
    (within 5% of its largest entry), while a single draw is not."""
    z, t, full = _batch()
    _, dz_f = SurrogateHead(copy.deepcopy(full), z.shape[0], low=False).step(z, t)
    head = SampledHead(full, 8, 1, np.random.default_rng(1))
    one = head.step(z, t)[1]
    mean = sum(head.step(z, t)[1] for _ in range(3000)) / 3000
    scale = float(dz_f.abs().max())
    assert float((mean - dz_f).abs().max()) < 0.05 * scale
    assert float((one - dz_f).abs().max()) > 0.05 * scale


def test_the_gradient_lies_on_the_scored_rows_only():
    """Two steps: after each, the head's gradient is nonzero on exactly the rows that step
    scored (the batch's meta-labels and the drawn ones; the previous step's rows cleared)."""
    z, t, head = _batch()
    sh = SampledHead(head, 5, 1, np.random.default_rng(2))
    twin = SampledHead(copy.deepcopy(head), 5, 1, np.random.default_rng(2))
    for _ in range(2):
        cols, npos, _ = twin.columns(t[1].numpy())
        sh.step(z, t)
        assert npos == np.unique(t[1].numpy()).size and cols.size == npos + 5
        assert set(np.flatnonzero(head.weight.grad.any(1).numpy())) == set(cols)
        assert set(np.flatnonzero(head.bias.grad.numpy())) == set(cols)


def test_module_i_with_a_sampled_head_learns_the_same_on_both_paths():
    """train_surrogate(sampled=64) over 1,024 meta-labels: the CPU's written-out backward and
    autograd (a GPU's path) give the same losses and encoder, and the loss falls."""
    X = sp.random(600, 300, density=0.02, format="csr", random_state=1, dtype=np.float32)
    Y = sp.random(600, 1024, density=0.004, format="csr", random_state=2, dtype=np.float32)
    Y.data[:] = 1.0
    torch.manual_seed(0)
    enc = Encoder(X.shape[1], 16, 1.0, 0.5)
    enc2 = copy.deepcopy(enc)
    kw = {"epochs": 3, "lr": 0.02, "batch_size": 64, "seed": 0, "progress": False, "sampled": 64}
    a = train_surrogate(enc, X, Y, **kw, fused=True)
    b = train_surrogate(enc2, X, Y, **kw, fused=False)
    assert a[2]["loss"] < a[0]["loss"]
    for ea, eb in zip(a, b, strict=True):
        assert ea["loss"] == pytest.approx(eb["loss"], rel=1e-4)
    for p, q in zip(enc.parameters(), enc2.parameters(), strict=True):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-4), float((p - q).abs().max())


def test_the_positives_subtrees_are_always_scored():
    """block 8: the batch's meta-labels 3 and 17 bring their subtrees 0-7 and 16-23, each
    weighted 1; the others drawn carry (64 - 16) / 4 each."""
    head = nn.Linear(4, 64)
    cols, nfix, w = SampledHead(head, 4, 8, np.random.default_rng(0)).columns(np.array([17, 3, 17]))
    assert list(cols[:nfix]) == [*range(8), *range(16, 24)]
    assert cols.size == 20 and len(set(cols)) == 20 and w == pytest.approx(12.0)


def test_cluster_ids_follow_the_label_tree():
    """Two groups of 41 labels far apart, each of four tight clusters (10, 10, 10, 11 labels):
    with 8 clusters ids 0-3 are one group's and 4-7 the other's (a subtree is a range of ids),
    although the two groups' halves differ in size (21 and 20 labels)."""
    from engine.astec.clustering import balanced_clusters

    rng = np.random.default_rng(0)
    rows, group = [], []
    for g in range(2):
        for k, n in enumerate((10, 10, 10, 11)):
            v = np.zeros((n, 12), np.float32)
            v[:, 10 + g] = 1.0
            v[:, 4 * g + k] = 1.0
            rows.append(v + rng.uniform(0, 0.05, v.shape).astype(np.float32))
            group += [g] * n
    group = np.array(group)
    assign = balanced_clusters(np.vstack(rows), 8, seed=0, progress=False)
    assert sorted(np.bincount(assign)) == [10] * 6 + [11] * 2
    first = set(group[assign < 4])
    assert len(first) == 1 and set(group[assign >= 4]) == {1 - first.pop()}
