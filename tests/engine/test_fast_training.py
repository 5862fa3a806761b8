"""The fast training paths stay the same model: the fused CPU classifier kernels against the
torch path that a GPU runs (exercised here on the CPU so it cannot rot), thread-count
independence of the sparse ranker's fit, one home for the thread default, and the bench's
training-time ratios."""

import copy

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

from bench.engine_peers import summarize_rounds, train_ratios
from engine.astec import Astec, AstecConfig
from engine.astec.config import TrainingParams, available_cores, resolve_device, resolve_threads
from engine.astec.network import Classifier, Encoder
from engine.astec.sparse_ranker import SparseRanker, ranker_features
from engine.astec.trainer import _candidates, train_shortlisted, train_surrogate
from engine.synthetic import zipf_dataset

SUR = {"lr": 0.02, "batch_size": 64, "seed": 0}  # Module I's loop settings in these tests


def _toy(n=500, V=300, L=150, seed=0):
    X = sp.random(n, V, density=0.02, format="csr", random_state=seed + 1, dtype=np.float32)
    Y = sp.random(n, L, density=0.02, format="csr", random_state=seed + 2, dtype=np.float32)
    Y.data[:] = 1
    N = sp.random(n, L, density=0.1, format="csr", random_state=seed + 3, dtype=np.float32)
    N.data[:] = 1
    return X, Y, N


def test_fused_classifier_matches_torch_path():
    """Same loss, same lazy Adam: after 3 epochs every parameter agrees to float32 rounding."""
    X, Y, N = _toy()
    torch.manual_seed(0)
    enc, clf = Encoder(X.shape[1], 16, 1.0, 0.0), Classifier(Y.shape[1], 16)
    enc2, clf2 = copy.deepcopy(enc), copy.deepcopy(clf)
    kw = {"epochs": 3, "lr": 0.01, "batch_size": 64, "seed": 0, "finetune_embeddings": True}
    kw.update(finetune_lr=0.005, name="Module IV", progress=False)
    a = train_shortlisted(enc, clf, X, Y, N, **kw, fused=True)
    b = train_shortlisted(enc2, clf2, X, Y, N, **kw, device="cpu", fused=False)
    for ea, eb in zip(a, b, strict=True):
        assert ea["loss"] == pytest.approx(eb["loss"], rel=1e-5)
    pairs = [
        (clf.weight.weight, clf2.weight.weight),
        (clf.bias.weight, clf2.bias.weight),
        (enc.embed.weight, enc2.embed.weight),
        (enc.residual.weight, enc2.residual.weight),
    ]
    for p, q in pairs:
        assert torch.allclose(p.detach(), q.detach(), atol=1e-4), float((p - q).abs().max())


def test_module_iv_without_finetuning_keeps_e_and_learns_r_and_w():
    """finetune_embeddings=False (the paper's Module IV): E stays exactly as Module I left it
    on both paths, which is what lets training keep Module II's indexes after Module IV; R and
    W still learn."""
    X, Y, N = _toy()
    for fused in (True, False):
        torch.manual_seed(0)
        enc, clf = Encoder(X.shape[1], 16, 1.0, 0.5), Classifier(Y.shape[1], 16)
        E0, R0 = enc.embed.weight.detach().clone(), enc.residual.weight.detach().clone()
        W0 = clf.weight.weight.detach().clone()
        logs = train_shortlisted(
            enc,
            clf,
            X,
            Y,
            N,
            epochs=2,
            lr=0.01,
            batch_size=64,
            seed=0,
            finetune_embeddings=False,
            finetune_lr=0.005,
            name="Module IV",
            progress=False,
            fused=fused,
        )
        assert torch.equal(enc.embed.weight, E0), fused
        assert not torch.equal(enc.residual.weight, R0) and not torch.equal(clf.weight.weight, W0)
        assert logs[1]["loss"] < logs[0]["loss"]


def test_surrogate_device_argument_runs_on_cpu():
    """The device path of Module I (what a GPU runs), on the CPU."""
    X, Y, _ = _toy()
    enc = Encoder(X.shape[1], 16, 1.0, 0.5)
    logs = train_surrogate(
        enc, X, Y, **SUR, epochs=2, progress=False, valid=(X[:50], Y[:50]), device="cpu"
    )
    assert len(logs) == 2 and logs[1]["loss"] < logs[0]["loss"] and "valid_meta_P@1" in logs[1]
    assert enc.embed.weight.device.type == "cpu"


def test_sparse_target_bce_is_torchs_loss_and_gradient():
    """Module I's loss against its sparse meta-label rows: the value and gradient of
    F.binary_cross_entropy_with_logits on the dense target."""
    from engine.astec.trainer import sparse_target_bce

    rng = np.random.default_rng(0)
    Y = sp.random(40, 70, density=0.05, format="csr", random_state=1, dtype=np.float32)
    Y.data[:] = 1.0
    x = torch.from_numpy(rng.normal(0, 3, (40, 70)).astype(np.float32)).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ours = sparse_target_bce(x, Y)
    ref = F.binary_cross_entropy_with_logits(x2, torch.from_numpy(Y.toarray()))
    ours.backward()
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.allclose(x.grad, x2.grad, atol=1e-7)


def test_encoder_step_in_bfloat16_is_the_float32_step_rounded():
    """precision bfloat16: the residual's three products read bfloat16 roundings of vd, R and
    dL/dpre (as autocast's): z, R's gradient and E's first Adam step (lr x the sign of dL/dv)
    within bfloat16's rounding of the float32 step's, the weights float32."""
    from engine.astec.encoder_step import EncoderStep
    from engine.astec.trainer import RowAdam, _row_batches

    X, _, _ = _toy(n=64, V=200)
    torch.manual_seed(0)
    enc = Encoder(X.shape[1], 24, 0.2, 0.5)  # the scale binds: its gradient term is exercised
    with torch.no_grad():
        enc.residual.weight.copy_(0.3 * torch.randn(24, 24))  # not symmetric
    enc.train()
    dz = np.random.default_rng(1).standard_normal((X.shape[0], 24)).astype(np.float32)
    out = {}
    for low in (False, True):
        e = copy.deepcopy(enc)
        step = EncoderStep(e, RowAdam(e.embed.weight, 0.01), low=low)
        torch.manual_seed(3)
        z = step.forward(*next(_row_batches(X, np.arange(X.shape[0]), X.shape[0])))
        step.backward(dz)
        assert e.residual.weight.dtype == torch.float32 and z.dtype == np.float32
        dE = (e.embed.weight - enc.embed.weight).detach().numpy()
        out[low] = z, e.residual.weight.grad.numpy().copy(), dE
    (z32, g32, dE32), (z16, g16, dE16) = out[False], out[True]
    assert not np.array_equal(z16, z32)  # the products were rounded
    np.testing.assert_allclose(z16, z32, rtol=0.02, atol=0.02 * np.abs(z32).mean())
    assert np.linalg.norm(g16 - g32) < 0.02 * np.linalg.norm(g32)
    moved = np.abs(dE32) > 0.005  # rows the batch touched, entries with a clear gradient
    assert moved.sum() > 1000
    assert np.mean(np.sign(dE16[moved]) == np.sign(dE32[moved])) > 0.97


def test_surrogate_learns_with_a_bfloat16_head():
    """training.precision = bfloat16 (Module I's head and the encoder's residual products): the
    weights stay float32 and the surrogate task is learnt as in float32 (losses within a few
    percent)."""
    X, Y, _ = _toy()
    losses = {}
    for precision in ("float32", "bfloat16"):
        torch.manual_seed(0)
        enc = Encoder(X.shape[1], 16, 1.0, 0.5)
        logs = train_surrogate(enc, X, Y, **SUR, epochs=3, progress=False, precision=precision)
        assert logs[-1]["loss"] < logs[0]["loss"]
        assert enc.embed.weight.dtype == torch.float32
        losses[precision] = logs[-1]["loss"]
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.05)


def test_surrogate_schedule_follows_validation_when_given_patience():
    """Module I's epochs scale with the data: without a new best validation meta P@1 for
    `patience` epochs the lr halves, after as many more training stops (the cap is `epochs`),
    and the best epoch's weights are kept."""
    X, Y, _ = _toy()
    never = sp.csr_matrix(Y[:50].shape, dtype=np.float32)  # nothing to hit: P@1 stays 0
    NEVER = {"progress": False, "valid": (X[:50], never)}
    torch.manual_seed(0)
    enc = Encoder(X.shape[1], 16, 1.0, 0.5)
    logs = train_surrogate(enc, X, Y, **SUR, epochs=30, **NEVER, patience=2)
    assert [e["epoch"] for e in logs] == [1, 2, 3, 4, 5]  # best at 1; decay after 3; stop at 5
    assert logs[2].get("decayed") and "stopped" in logs[4]
    # the best epoch's weights are the ones kept: those of a run that stops after epoch 1
    assert logs[0].get("kept") and not any(e.get("kept") for e in logs[1:])
    torch.manual_seed(0)
    once = Encoder(X.shape[1], 16, 1.0, 0.5)
    train_surrogate(once, X, Y, **SUR, epochs=1, **NEVER, patience=0)
    assert torch.equal(enc.embed.weight, once.embed.weight)
    fixed = train_surrogate(enc, X, Y, **SUR, epochs=4, **NEVER, patience=0)
    assert len(fixed) == 4


def test_device_option_validated_and_resolved():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError):
        TrainingParams(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")


def test_thread_default_has_one_home():
    assert AstecConfig().training.threads == 0
    assert resolve_threads(0) == available_cores() >= 1
    assert resolve_threads(3) == 3
    assert AstecConfig().resolve(100).training.threads == available_cores()


def _ranker_problem(texts, Y, per_point: int, rng):
    """(ranker features, Y as float32 csr, `per_point` uniform candidate labels per point)."""
    from engine.text import TfidfVectorizer

    Xr = ranker_features(TfidfVectorizer(word_ngrams=2).fit_transform(texts))
    Y = sp.csr_matrix(Y, dtype=np.float32)
    n, L = Y.shape
    k = per_point
    negs = sp.csr_matrix(
        (np.ones(n * k, np.float32), rng.integers(0, L, n * k), np.arange(0, n * k + 1, k)),
        shape=(n, L),
    )
    negs.sum_duplicates()
    return Xr, Y, negs


def test_sparse_ranker_fit_does_not_depend_on_threads():
    texts, Y = zipf_dataset(
        1200,
        2500,
        labels_per_point=2,
        words_per_point=5,
        words_per_label=2,
        vocab_size=800,
        noise=0.1,
        seed=3,
    )
    Xr, Y, negs = _ranker_problem(texts, Y, 20, np.random.default_rng(0))
    L = Y.shape[1]
    a = SparseRanker.fit(Xr, Y, negs, threads=1).W
    b = SparseRanker.fit(Xr, Y, negs, threads=2).W
    assert a.shape == b.shape == (L, Xr.shape[1]) and L > 2048  # several label chunks
    assert (a != b).nnz == 0
    # its scores too: rows split over threads give the same values
    ranker = SparseRanker(a)
    pairs = sp.csr_matrix(negs + Y)
    assert np.array_equal(ranker.scores(Xr, pairs, 2), ranker.scores(Xr, pairs, 1))


def test_sparse_ranker_weights_do_not_depend_on_feature_numbering():
    """The fit renumbers features by frequency (cache locality of its per-label copies): the
    weights must be those of the features as given, bit for bit, whatever their numbering."""
    from engine.astec.sparse_ranker import frequency_order

    texts, Y = zipf_dataset(
        900, 400, labels_per_point=2, words_per_point=5, words_per_label=2, vocab_size=500, seed=5
    )
    Xr, Y, negs = _ranker_problem(texts, Y, 15, np.random.default_rng(2))
    F = Xr.shape[1]
    rank, feature = frequency_order(Xr.indices, F)
    assert np.array_equal(feature[rank], np.arange(F)) and feature[F - 1] == F - 1  # bias last
    counts = np.bincount(Xr.indices, minlength=F)[feature[: F - 1]]
    assert np.all(counts[:-1] >= counts[1:])
    # the same problem with its (non-bias) columns shuffled, entries in the same order per row
    perm = np.concatenate([np.random.default_rng(3).permutation(F - 1), [F - 1]])
    Xp = sp.csr_matrix((Xr.data, perm[Xr.indices], Xr.indptr), shape=Xr.shape)
    a = SparseRanker.fit(Xr, Y, negs).W
    b = SparseRanker.fit(Xp, Y, negs).W
    back = sp.csr_matrix((b.data, np.argsort(perm)[b.indices], b.indptr), shape=b.shape)
    back.sort_indices()
    assert a.nnz > 0 and np.array_equal(a.indptr, back.indptr)
    assert np.array_equal(a.indices, back.indices) and np.array_equal(a.data, back.data)


def test_sparse_ranker_refit_starts_from_the_first_fits_duals():
    """The refit after the validation split joins: warm-started from a fit on part of the points
    (row ids shared), it lands where a fit from zero lands, and a warm start at the optimum
    stays there."""
    texts, Y = zipf_dataset(
        900, 300, labels_per_point=2, words_per_point=5, words_per_label=2, vocab_size=500, seed=4
    )
    rng = np.random.default_rng(1)
    Xr, Y, negs = _ranker_problem(texts, Y, 15, rng)
    n = Y.shape[0]
    cold = SparseRanker.fit(Xr, Y, negs, max_iters=200, seed=0)
    part = np.sort(rng.permutation(n)[: int(0.9 * n)])
    first = SparseRanker.fit(Xr[part], Y[part], negs[part], max_iters=200, row_ids=part)
    assert first.dual is not None and first.dual[0].size > 0
    warm = SparseRanker.fit(Xr, Y, negs, max_iters=200, warm=first)
    assert first.dual is None  # taken over by the refit (not held beside its own)
    again = SparseRanker.fit(Xr, Y, negs, max_iters=1, warm=cold)
    pairs = sp.csr_matrix(negs + Y)
    ref = cold.scores(Xr, pairs)
    for other in (warm, again):
        # the same solution up to the solver's tolerance (and weights below 0.1 dropped)
        assert np.abs(other.scores(Xr, pairs) - ref).mean() < 0.01
        assert other.W.nnz == pytest.approx(cold.W.nnz, rel=0.05)
    first_on_all = first.scores(Xr, pairs)
    assert np.abs(first_on_all - ref).mean() > 3 * np.abs(warm.scores(Xr, pairs) - ref).mean()


def test_train_ratios_to_fastest_peer():
    rows = [
        {"method": "astec", "train_s": 80.0},
        {"method": "bonsai", "train_s": 16.0},
        {"method": "parabel", "train_s": 8.0},
        {"method": "napkinxc-plt", "error": "x"},
    ]
    assert train_ratios(rows) == {"astec": 10.0, "bonsai": 2.0, "parabel": 1.0}
    assert train_ratios([{"method": "astec", "train_s": 5.0}]) == {"astec": 1.0}


def test_cpu_ratios_to_the_peer_with_fewest_cpu_seconds():
    """The CPU-seconds ratio has its own fastest peer: a peer fast by the clock because it runs
    more threads is not the cheapest in CPU time."""
    rows = [
        {"method": "astec", "train_s": 80.0, "train_cpu_s": 120.0},
        {"method": "bonsai", "train_s": 16.0, "train_cpu_s": 30.0},
        {"method": "parabel", "train_s": 20.0, "train_cpu_s": 20.0},
        {"method": "napkinxc-plt", "train_s": 9.0},  # no CPU seconds: left out of that ratio
    ]
    assert train_ratios(rows, "train_cpu_s") == {"astec": 6.0, "bonsai": 1.5, "parabel": 1.0}
    assert train_ratios(rows)["astec"] == 8.9


def _peer_row(method, train_s, ratio, p1=70.0, rss=900, modules=None, cpu=None):
    row = {"method": method, "train_s": train_s, "predict_s": 1.0, "peak_rss_mb": rss}
    row.update(dict.fromkeys(("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5"), p1))
    row["train_ratio"] = ratio
    if cpu is not None:
        row["train_cpu_s"], row["cpu_ratio"] = cpu
    if modules is not None:
        row["modules_s"] = {"0": modules}
    return row


def test_rounds_report_medians_and_each_rounds_own_ratio():
    """`bench peers --rounds 3`: a machine twice as slow in round 2 moves both methods' seconds,
    not the ratio, which is the median of the rounds' own ratios (not median over median)."""
    rounds = [
        [_peer_row("astec", 100.0, 4.0, 72.0, 2000, {"I": 30.0}), _peer_row("bonsai", 25.0, 1.0)],
        [_peer_row("astec", 210.0, 4.2, 72.2, 2100, {"I": 70.0}), _peer_row("bonsai", 50.0, 1.0)],
        [_peer_row("astec", 130.0, 5.2, 71.9, 1900, {"I": 40.0}), _peer_row("bonsai", 25.0, 1.0)],
    ]
    astec, bonsai = summarize_rounds(rounds)
    assert astec["method"] == "astec" and bonsai["method"] == "bonsai"
    assert astec["train_s"] == 130.0 and astec["train_s_rounds"] == [100.0, 210.0, 130.0]
    assert astec["train_ratio"] == 4.2  # 130 / 25 would say 5.2
    assert astec["train_ratio_rounds"] == [4.0, 4.2, 5.2]
    assert astec["P@1"] == 72.0 and astec["peak_rss_mb"] == 2100 and astec["rounds"] == 3
    assert astec["modules_s"] == {"0": {"I": 40.0}}
    assert bonsai["train_s"] == 25.0 and bonsai["train_ratio"] == 1.0
    assert "train_cpu_s" not in astec and "cpu_ratio" not in astec  # rows without CPU seconds


def test_rounds_report_the_median_cpu_seconds_and_cpu_ratio():
    rounds = [
        [_peer_row("astec", 100.0, 4.0, cpu=(170.0, 3.6)), _peer_row("bonsai", 25.0, 1.0)],
        [_peer_row("astec", 210.0, 4.2, cpu=(190.0, 3.9)), _peer_row("bonsai", 50.0, 1.0)],
        [_peer_row("astec", 130.0, 5.2, cpu=(175.0, 3.7)), _peer_row("bonsai", 25.0, 1.0)],
    ]
    astec, _ = summarize_rounds(rounds)
    assert astec["train_cpu_s"] == 175.0 and astec["train_cpu_s_rounds"] == [170.0, 190.0, 175.0]
    assert astec["cpu_ratio"] == 3.7 and astec["cpu_ratio_rounds"] == [3.6, 3.9, 3.7]


def test_rounds_keep_a_method_that_failed_in_some_of_them():
    ok = _peer_row("astec", 100.0, 4.0)
    rounds = [
        [ok, {"method": "bonsai", "error": "exit status 1"}],
        [ok, _peer_row("bonsai", 20.0, 1.0)],
    ]
    astec, bonsai = summarize_rounds(rounds)
    assert bonsai["train_s"] == 20.0 and bonsai["failed_rounds"] == 1 and bonsai["rounds"] == 1
    assert "failed_rounds" not in astec
    (only,) = summarize_rounds([[{"method": "bonsai", "error": "boom"}]] * 2)
    assert only == {"method": "bonsai", "error": "boom", "failed_rounds": 2}


def test_model_trained_by_the_torch_path_predicts_like_a_cpu_model(tmp_path):
    """fused=False (the GPU path, here on the CPU) gives a model of the same kind: it saves,
    loads and predicts with the same accuracy as the fused default."""
    texts, Y = zipf_dataset(
        900,
        40,
        labels_per_point=2,
        words_per_point=4,
        words_per_label=2,
        vocab_size=300,
        noise=0.1,
        seed=1,
    )
    cfg = {
        "network": {"embedding_dim": 16},
        "surrogate": {"epochs": 2},
        "shortlist": {"negatives": 20, "knn_neighbours": 5, "centroid_neighbours": 10},
        "extreme": {"epochs": 2},
        "rerank": {"epochs": 1},
        "sparse": {"enabled": False},
        "name_match": {"enabled": False},
        "search": {"candidates": 20},
        "training": {"batch_size": 64, "threads": 1, "fused_kernels": False},
    }
    m = Astec.train(texts[:700], Y[:700], AstecConfig.from_dict(cfg), progress=False)
    assert m.config.training.fused_kernels is False
    m.save(tmp_path / "m")
    ids, _ = Astec.load(tmp_path / "m").predict(texts[700:], k=3)
    ids2, _ = m.predict(texts[700:], k=3)
    assert np.array_equal(ids, ids2)


def test_row_adam_kernel_matches_torch_ops():
    """RowAdam on a float32 CPU table runs the compiled kernel; on float64 (like a GPU table)
    it runs the torch ops: the same lazy Adam."""
    from engine.astec.trainer import RowAdam

    torch.manual_seed(0)
    T32 = torch.randn(50, 8)
    T64 = T32.double()
    a, b = RowAdam(T32, 0.01), RowAdam(T64, 0.01)
    for it in range(6):
        rows = torch.from_numpy(np.unique(np.random.default_rng(it).integers(0, 50, 20)))
        g = torch.randn(rows.numel(), 8)
        a.step(rows, g)
        b.step(rows, g.double())
    assert torch.allclose(T32.double(), T64, atol=1e-5)
    assert not torch.equal(T32, torch.zeros_like(T32))


def test_dense_adam_is_torchs_fused_adam():
    # R and Module I's head take Adam's fused kernel called directly (no torch.optim): the same
    # weights as torch.optim.Adam(fused=True), a parameter without a gradient skipped, and the
    # learning rate decayed mid-way as Module I's schedule does
    from engine.astec.trainer import DenseAdam

    torch.manual_seed(0)
    a = [torch.randn(30, 20, requires_grad=True), torch.randn(20, requires_grad=True)]
    b = [p.detach().clone().requires_grad_() for p in a]
    ours = DenseAdam(a, lr=0.02)
    ref = torch.optim.Adam(b, lr=0.02, fused=True)
    for step in range(6):
        g = [torch.randn_like(p) for p in a]
        for p, q, gi in zip(a, b, g, strict=True):
            p.grad, q.grad = gi.clone(), gi.clone()
        if step == 2:  # the bias has no gradient in this step
            a[1].grad = b[1].grad = None
        if step == 4:
            ours.lr *= 0.5
            for grp in ref.param_groups:
                grp["lr"] *= 0.5
        ours.step()
        ref.step()
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q)
    ours.zero_grad()
    assert all(p.grad is None for p in a)


def test_openmp_waits_passively_only_on_an_oversubscribed_machine():
    """engine.astec asks OpenMP for passive waits before torch starts it when the load average
    already exceeds the cores (spinning threads then steal each other's cores); on a machine of
    its own it leaves OpenMP's spin-then-sleep default. A user's value always wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def policy(load: float, **extra: str) -> str:
        code = (
            f"import os; os.getloadavg = lambda: ({load}, 0.0, 0.0); import engine.astec; "
            "print(os.environ.get('OMP_WAIT_POLICY', 'default'))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()

    assert policy(1e6) == "PASSIVE"
    assert policy(0.0) == "default"
    assert policy(1e6, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_sparse_ranker_tasks_bound_labels_and_pairs():
    from engine.astec.sparse_ranker import label_chunks

    counts = np.array([5000, 10, 10, 300, 0, 0, *([7] * 3000)], np.int64)
    pptr = np.concatenate([[0], np.cumsum(counts)])
    starts = label_chunks(pptr, max_labels=1000, max_pairs=400)
    ends = [*starts[1:], counts.size]
    assert starts[0] == 0 and ends[0] == 1  # a label with more pairs than a task is one alone
    assert all(a < b for a, b in zip(starts, ends, strict=True))
    for a, b in zip(starts, ends, strict=True):
        assert b - a <= 1000 and (b - a == 1 or pptr[b] - pptr[a] <= 400)


def test_training_keeps_large_arrays_out_of_the_heap():
    """glibc's M_MMAP_THRESHOLD is fixed for training (see fixed_mmap_threshold): set on the
    Debian machines this project runs on."""
    from engine.astec.model import fixed_mmap_threshold

    assert fixed_mmap_threshold() is True


@pytest.mark.parametrize("p", [0.5, 0.3])
def test_dropout_masks_are_inverted_dropout_and_follow_torchs_seed(p):
    """The encoder's dropout (numpy masks on the CPU; 0.5 from random bits): in training each
    entry is zeroed with probability p and the rest scaled by 1 / (1 - p), gradients flow through
    the same mask, the same torch.manual_seed gives the same masks, and evaluation is the
    identity."""
    from engine.astec.network import MaskDropout

    x = torch.ones(401, 299, requires_grad=True)  # not a whole number of bytes of bits

    def masked(seed):
        torch.manual_seed(seed)
        d = MaskDropout(p)
        return d, d(x)

    d, y = masked(3)
    kept = y.detach() != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    assert torch.allclose(y.detach()[kept], torch.tensor(1 / (1 - p)))
    assert abs(kept[:, 0].float().mean().item() - (1 - p)) < 0.1  # no column always kept
    assert abs(kept[0].float().mean().item() - (1 - p)) < 0.1
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d(sum x * m) / dx = m
    assert torch.equal(masked(3)[1], y) and not torch.equal(masked(4)[1], y)
    d.eval()
    assert d(x) is x
    with pytest.raises(ValueError, match="dropout"):
        MaskDropout(1.0)


@pytest.mark.parametrize("lam", [1.0, 0.2])
def test_encoder_step_by_hand_is_autograds_step(lam):
    """The CPU's encoder step (forward and the backward written out, dropout on, the spectral
    norm's scale binding at lam = 0.2 and not at 1.0): the same z, the same power-iteration
    buffer, and after Adam the same E and R as autograd with RowAdam and torch's Adam."""
    from engine.astec.encoder_step import EncoderStep
    from engine.astec.trainer import RowAdam, _row_batches, gathered_v

    X, _, _ = _toy(n=64, V=200)
    torch.manual_seed(0)
    enc = Encoder(X.shape[1], 24, lam, 0.5)
    with torch.no_grad():
        enc.residual.weight.mul_(0.5).add_(0.02 * torch.randn(24, 24))  # sigma ~0.6
    enc2 = copy.deepcopy(enc)
    dz = np.random.default_rng(1).standard_normal((X.shape[0], 24)).astype(np.float32)
    opt_r = torch.optim.Adam([enc.residual.weight], lr=0.01)
    opt_e = RowAdam(enc.embed.weight, 0.01)
    step = EncoderStep(enc2, RowAdam(enc2.embed.weight, 0.01), RowAdam(enc2.residual.weight, 0.01))
    enc.train()
    enc2.train()
    for it in range(3):
        torch.manual_seed(10 + it)
        v, rows, Eu = gathered_v(opt_e, X)
        z = enc.z_from_v(enc.drop(v))
        opt_r.zero_grad()
        z.backward(torch.from_numpy(dz))
        opt_r.step()
        opt_e.step(rows, Eu.grad)
        torch.manual_seed(10 + it)
        z2 = step.forward(*next(_row_batches(X, np.arange(X.shape[0]), X.shape[0])))
        step.backward(dz)
        np.testing.assert_allclose(z2, z.detach().numpy(), atol=1e-5)
    sigma = float(torch.linalg.matrix_norm(enc.residual.weight.detach(), ord=2))
    assert (lam < sigma) == (lam < 1.0)  # the scale's own gradient was exercised at 0.2
    for p, q in [
        (enc.embed.weight, enc2.embed.weight),
        (enc.residual.weight, enc2.residual.weight),
    ]:
        assert torch.allclose(p.detach(), q.detach(), atol=1e-5), float((p - q).abs().max())
    assert torch.allclose(enc.residual.u, enc2.residual.u, atol=1e-5)


@pytest.mark.parametrize("L", [150, 4096])
def test_surrogate_by_hand_is_the_torch_path(L):
    """Module I on the CPU (the encoder's backward and the head's by hand) and through autograd
    (a GPU's path), dropout on, a small and a large head: the same losses and weights after two
    epochs."""
    X, Y, _ = _toy(L=L)
    torch.manual_seed(0)
    enc = Encoder(X.shape[1], 16, 1.0, 0.5)
    enc2 = copy.deepcopy(enc)
    a = train_surrogate(enc, X, Y, **SUR, epochs=2, progress=False, fused=True)
    b = train_surrogate(enc2, X, Y, **SUR, epochs=2, progress=False, fused=False)
    for ea, eb in zip(a, b, strict=True):
        assert ea["loss"] == pytest.approx(eb["loss"], rel=1e-4)
    for p, q in zip(enc.parameters(), enc2.parameters(), strict=True):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-4), float((p - q).abs().max())


def test_deferred_embedding_update_is_the_same_update():
    """EncoderStep.backward(defer=True) (Module I: E's rows on a second thread beside the head's
    Adam) finishes before the next forward reads E: four batches give the same z, E and R, bit
    for bit, as undeferred steps."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.astec.encoder_step import EncoderStep
    from engine.astec.trainer import RowAdam, _row_batches

    X, _, _ = _toy(n=256, V=300)
    torch.manual_seed(0)
    enc = Encoder(X.shape[1], 24, 1.0, 0.5)
    enc.train()
    dz = np.random.default_rng(1).standard_normal((64, 24)).astype(np.float32)
    perm = np.random.default_rng(2).permutation(X.shape[0])
    out = {}
    with ThreadPoolExecutor(1) as pool:
        for defer in (False, True):
            e = copy.deepcopy(enc)
            step = EncoderStep(
                e, RowAdam(e.embed.weight, 0.01), RowAdam(e.residual.weight, 0.01), pool=pool
            )
            torch.manual_seed(3)
            zs = []
            for xb in _row_batches(X, perm, 64):
                zs.append(step.forward(*xb))
                step.backward(dz, defer=defer)
            step.wait()
            out[defer] = zs, e.embed.weight.detach().numpy(), e.residual.weight.detach().numpy()
    (za, Ea, Ra), (zb, Eb, Rb) = out[False], out[True]
    assert len(za) == 4 and not np.array_equal(Ea, enc.embed.weight.detach().numpy())
    assert all(np.array_equal(a, b) for a, b in zip(za, zb, strict=True))
    assert np.array_equal(Ea, Eb) and np.array_equal(Ra, Rb)


def test_deferred_classifier_update_is_the_same_update():
    """FusedClassifierAdam.step(defer=True) finishes its row update before the next step reads
    W: three batches give the same W, b and losses as undeferred steps."""
    from engine.astec.fused import FusedClassifierAdam

    rng = np.random.default_rng(0)
    W0 = rng.standard_normal((300, 16)).astype(np.float32)
    results = []
    for defer in (False, True):
        W, b = W0.copy(), np.zeros(300, np.float32)
        fc = FusedClassifierAdam(W, b, lr=0.01, threads=2)
        losses = []
        for it in range(3):
            r = np.random.default_rng(it)
            z = r.standard_normal((100, 16)).astype(np.float32)
            ptr = np.arange(0, 100 * 40 + 1, 40, dtype=np.int64)
            lab = np.concatenate([np.sort(r.choice(300, 40, replace=False)) for _ in range(100)])
            y = (r.random(lab.size) < 0.1).astype(np.float32)
            losses.append(fc.step(z, ptr, lab.astype(np.int64), y, defer=defer)[0])
        fc.close()
        results.append((W, b, losses))
    (Wa, ba, la), (Wb, bb, lb) = results
    assert la == lb and np.array_equal(Wa, Wb) and np.array_equal(ba, bb)
    assert not np.array_equal(Wa, W0)


@pytest.mark.parametrize("L", [50, 100_000])
def test_grouping_by_label_is_a_stable_sort(L):
    """The classifier's entries grouped by label (a scan of the counts when labels are few,
    a sort of the seen ones when many): the order of a stable argsort, each entry's point."""
    from engine.astec.fused import _group_by_label

    rng = np.random.default_rng(L)
    ptr = np.cumsum(np.r_[0, rng.integers(0, 30, 40)]).astype(np.int64)
    lab = rng.integers(0, L, ptr[-1]).astype(np.int64)
    count = np.zeros(L, np.int64)
    order, seg, labels, owner = _group_by_label(lab, ptr, count)
    assert np.array_equal(order, np.argsort(lab, kind="stable"))
    assert np.array_equal(labels, np.unique(lab))
    assert np.array_equal(np.diff(seg), np.bincount(lab)[labels])
    assert np.array_equal(owner, np.repeat(np.arange(40), np.diff(ptr)))
    assert not count.any()


@pytest.mark.parametrize("low", [False, True])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_surrogate_head_by_hand_is_autocasts_step(low, scale):
    """Module I's head without autograd (the CPU path): the loss, dL/dz and the head's gradients
    of autocast's bfloat16 step (or float32's), for a batch smaller than the buffers and with
    logits large enough (scale 40) that sigmoid rounds to 1."""
    from engine.astec.surrogate_head import SurrogateHead
    from engine.astec.trainer import csr_coo, sparse_target_bce

    torch.manual_seed(0)
    B, D, L = 37, 24, 1000  # L not a multiple of the loss's 512-factor products
    head = nn.Linear(D, L)
    Y = sp.random(B, L, density=0.003, format="csr", random_state=3, dtype=np.float32)
    Y.data[:] = 1.0
    Y.sum_duplicates()
    z = torch.randn(B, D) * scale
    step = SurrogateHead(head, 64, low)
    for _ in range(2):  # the buffers are reused
        loss, dz = step.step(z, csr_coo((Y.indptr, Y.indices, Y.data)))
    dW, db = head.weight.grad.clone(), head.bias.grad.clone()
    head.weight.grad = head.bias.grad = None
    zr = z.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
        logits = head(zr)
    ref = sparse_target_bce(logits.float(), Y)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-5)
    tol = 1e-2 if low else 1e-5  # bfloat16: the bias gradient is summed before its rounding
    assert torch.allclose(dz, zr.grad, rtol=tol, atol=1e-6 * scale)
    assert torch.allclose(dW, head.weight.grad, rtol=tol, atol=1e-6 * scale)
    assert torch.allclose(db, head.bias.grad, rtol=tol, atol=1e-5)


def test_a_shortlisted_positive_is_trained_as_a_positive():
    # Modules IV / the re-ranker read target 1 where a candidate's data is 2: a positive that a
    # shortlist also holds (and a weighted label) must stay 2, a negative 1, nothing else stored
    Y = sp.csr_matrix(np.array([[1, 0, 0.5, 0], [0, 0, 0, 0], [0, 3, 0, 0]], np.float32))
    N = sp.csr_matrix(np.array([[1, 1, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]], np.float32))
    C = _candidates(Y, N)
    assert C.dtype == np.float32 and C.has_sorted_indices
    np.testing.assert_array_equal(C.toarray(), [[2, 1, 2, 0], [0, 0, 0, 1], [0, 2, 0, 0]])
    assert C.nnz == 5


def test_bfloat16_product_by_the_transposed_problem_is_the_product():
    """`mm_low` (the bfloat16 a @ b as (b^T a^T)^T, faster in oneDNN): the float32 product of
    the same bfloat16 operands within the rounding of its bfloat16 result, C-ordered float32."""
    from engine.astec.encoder_step import mm_low

    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 300, generator=g).to(torch.bfloat16)
    b = torch.randn(300, 24, generator=g).to(torch.bfloat16)
    out = mm_low(a, b)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.shape == (37, 24)
    ref = a.float() @ b.float()
    assert torch.allclose(out, ref, rtol=1e-2, atol=1e-2)
    assert not torch.allclose(out, a.float() @ b.float().flip(0), rtol=1e-2, atol=1e-2)
