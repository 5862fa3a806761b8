"""The sparse ranker: per-label linear models on TF-IDF words + word pairs, trained on Astec's
own shortlists, whose scores join the paper's score combination.

Why: an averaged embedding of a ~7-word title does not memorise exact word and word-pair cues,
which is where sparse linear peers (Parabel, Bonsai) win P@1 on short texts. One squared-hinge
linear model per label, trained (liblinear's dual coordinate descent, C = 1, weights below 0.1
dropped: Parabel's defaults) on each point's positives and the labels Astec's shortlist puts
next to them (hard negatives), scores the same candidates Astec scores; the final score is
    y = gamma * y_astec + (1 - gamma) * sigmoid(w_l . x),
with gamma chosen on the validation split (gamma = 1 turns it off: the paper's Astec). This is
the sparse-plus-dense concatenation of XR-Transformer / PECOS, kept as a late fusion so the
dense modules stay exactly the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp
from numba import njit

from engine.kernels import sparse_entry_scores

from .sparse import normalize_rows, row_parts


def ranker_features(X: sp.csr_matrix) -> sp.csr_matrix:
    """Rows L2-normalised plus a constant 1 column (the per-label bias), float32 csr."""
    X = normalize_rows(sp.csr_matrix(X, dtype=np.float32))
    ones = sp.csr_matrix(np.ones((X.shape[0], 1), np.float32))
    out = sp.csr_matrix(sp.hstack([X, ones], format="csr"), dtype=np.float32)
    out.sort_indices()
    return out


@njit(cache=True, nogil=True)
def _seeded(seed):
    """A nonzero xorshift64* state from an integer seed (splitmix64's finaliser)."""
    z = np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z if z != np.uint64(0) else np.uint64(1)


@njit(cache=True, nogil=True, inline="always")
def _shuffle(order, n, state):
    """Fisher-Yates over order[:n] drawing from xorshift64* (state in, state out). Why not
    np.random.shuffle: numba's Mersenne twister and bounded draws made the shuffles ~a fifth of
    the fit."""
    for i in range(n - 1, 0, -1):
        state ^= state >> np.uint64(12)
        state ^= state << np.uint64(25)
        state ^= state >> np.uint64(27)
        r = (state * np.uint64(2685821657736338717)) >> np.uint64(32)
        j = np.int64((r * np.uint64(i + 1)) >> np.uint64(32))
        order[i], order[j] = order[j], order[i]
    return state


@njit(cache=True, nogil=True)
def _train_labels(
    pptr, pidx, py, alpha, xptr, xidx, xval, num_features, cost, max_iters, eps, threshold, seed
):
    """Dual coordinate descent for L2-regularised squared-hinge SVMs, one per label (column of
    the pair pattern pptr/pidx/py: the points and their +-1 targets), with liblinear's shrinking
    (solver 1): an example at alpha = 0 whose gradient exceeds the last sweep's largest
    projected gradient leaves the active set (most shortlisted negatives are easy: they stop
    costing anything after a sweep or two), and the solver stops when the projected gradients
    span at most eps over all examples. alpha (aligned with pidx) is the warm start and is
    updated in place. Returns the kept weights as CSR (indptr, indices, data) over labels.

    Each label's rows are first copied into one contiguous block with its features renumbered
    0..nt-1, so that the sweeps stream through memory and w is a small dense vector: reading
    the rows of scattered points and a vocabulary-sized w in every sweep was cache misses
    (the same arithmetic in the same order: the same weights)."""
    rng = _seeded(seed)
    L = pptr.size - 1
    local = np.full(num_features, -1, np.int64)  # feature -> its id within the current label
    touched = np.empty(num_features, np.int64)  # local id -> feature
    w = np.zeros(num_features, np.float64)  # the current label's weights, by local id
    # every buffer sized once from each label's row sizes (the output: a label keeps at most one
    # weight per feature of its rows, one, the bias, without any). Arrays reassigned inside the
    # label loop made numba reload every array's pointers in the loops below: the click log's
    # fit (37M pairs, one thread) spent 6.6-6.9 s copying the labels' rows against 2.4-2.6 s
    # with the output sized once, 20.8-22.1 against 16.1-17.1 s in all
    bound, n_max, size_max = 0, 0, 1
    for lab in range(L):
        size = 0  # feature entries of the label's rows
        for j in range(pptr[lab], pptr[lab + 1]):
            i = pidx[j]
            size += xptr[i + 1] - xptr[i]
        bound += min(size, num_features) if size > 0 else 1
        n_max = max(n_max, pptr[lab + 1] - pptr[lab])
        size_max = max(size_max, size)
    rptr = np.empty(n_max + 1, np.int64)
    ridx = np.empty(size_max, np.int32)
    rval = np.empty(size_max, xval.dtype)  # float32 features: the copy's values stay exact
    out_idx = np.empty(bound, np.int32)
    out_val = np.empty(bound, np.float32)
    out_ptr = np.zeros(L + 1, np.int64)
    n_out = 0
    dii = 0.5 / cost
    bias = num_features - 1
    for lab in range(L):
        s, e = pptr[lab], pptr[lab + 1]
        n = e - s
        if n > 0:
            nt = 0
            q = 0
            qd = np.empty(n)
            for j in range(n):
                i = pidx[s + j]
                rptr[j] = q
                qq = dii
                d = alpha[s + j] * py[s + j]
                for p in range(xptr[i], xptr[i + 1]):
                    x = np.float64(xval[p])
                    qq += x * x
                    f = xidx[p]
                    t = local[f]
                    if t < 0:
                        t = nt
                        local[f] = t
                        touched[t] = f
                        nt += 1
                    ridx[q] = t
                    rval[q] = xval[p]
                    q += 1
                    if d != 0.0:
                        w[t] += d * x
                qd[j] = qq
            rptr[n] = q
            order = np.arange(n)
            active = n
            pg_max_old = np.inf
            it = 0
            while it < max_iters:
                pg_max, pg_min = -np.inf, np.inf
                rng = _shuffle(order, active, rng)
                jj = 0
                while jj < active:
                    j = order[jj]
                    y = py[s + j]
                    a = alpha[s + j]
                    g = 0.0
                    for p in range(rptr[j], rptr[j + 1]):
                        g += w[ridx[p]] * rval[p]
                    grad = y * g - 1.0 + dii * a
                    pg = grad
                    if a == 0.0:
                        if grad > pg_max_old:  # shrink: swap it out of the active set
                            active -= 1
                            order[jj], order[active] = order[active], order[jj]
                            continue
                        pg = min(grad, 0.0)
                    pg_max = max(pg_max, pg)
                    pg_min = min(pg_min, pg)
                    if abs(pg) > 1e-12:
                        a_new = max(a - grad / qd[j], 0.0)
                        d = (a_new - a) * y
                        alpha[s + j] = a_new
                        for p in range(rptr[j], rptr[j + 1]):
                            w[ridx[p]] += d * rval[p]
                    jj += 1
                it += 1
                if pg_max - pg_min <= eps:
                    if active == n:
                        break
                    active = n  # converged on the active set: check every example again
                    pg_max_old = np.inf
                    continue
                pg_max_old = pg_max if pg_max > 0.0 else np.inf
            for t in range(nt):
                f = touched[t]
                if abs(w[t]) >= threshold or f == bias:
                    out_idx[n_out] = f
                    out_val[n_out] = w[t]
                    n_out += 1
                w[t] = 0.0
                local[f] = -1
        else:  # never seen: a sure negative (the hinge target), leaving the label to Astec
            out_idx[n_out] = bias
            out_val[n_out] = -1.0
            n_out += 1
        out_ptr[lab + 1] = n_out
    return out_ptr, out_idx[:n_out].copy(), out_val[:n_out].copy()


_PAIR_ROWS = 4096  # points per thread of the pair grouping at least


@njit(cache=True, nogil=True)
def _pairs_pass(yptr, yidx, cptr, cidx, a, b, fill, pos, rows, targets):
    """Rows [a, b) of the fit's (point, label) pairs, merged per row: each point's positives
    (target +1) and its candidates that are not positives (-1). fill=False counts them per
    label into pos; fill=True writes row and target at pos[label] (advancing it)."""
    for i in range(a, b):
        p, pe, q, qe = yptr[i], yptr[i + 1], cptr[i], cptr[i + 1]
        while p < pe or q < qe:
            if q >= qe or (p < pe and yidx[p] < cidx[q]):
                lb, t = yidx[p], 1.0
                p += 1
            elif p >= pe or cidx[q] < yidx[p]:
                lb, t = cidx[q], -1.0
                q += 1
            else:  # a shortlisted positive
                lb, t = yidx[p], 1.0
                p += 1
                q += 1
            if fill:
                rows[pos[lb]] = i
                targets[pos[lb]] = t
            pos[lb] += 1


def _pairs_by_label(yptr, yidx, cptr, cidx, num_labels: int, threads: int = 1):
    """The fit's pairs grouped by label as CSC (ptr, rows, targets), rows ascending within a
    label (rows of Y and C must have ascending label ids). A counting sort over contiguous row
    ranges, one per thread, each writing after the ranges before it: the same arrays for any
    number of threads, and much faster than a sparse subtraction and a CSR-to-CSC conversion
    at tens of millions of pairs."""
    n = yptr.size - 1
    counts: dict[int, np.ndarray] = {}  # per row range, by its first row
    empty_i, empty_f = np.zeros(0, np.int32), np.zeros(0, np.float32)

    def count(a: int, b: int) -> None:
        counts[a] = np.zeros(num_labels, np.int64)
        _pairs_pass(yptr, yidx, cptr, cidx, a, b, False, counts[a], empty_i, empty_f)

    row_parts(n, threads, count, min_rows=_PAIR_ROWS)
    firsts = sorted(counts)
    per_range = np.stack([counts[a] for a in firsts])
    ptr = np.zeros(num_labels + 1, np.int64)
    np.cumsum(per_range.sum(axis=0), out=ptr[1:])
    # each range writes after the ranges before it
    starts = dict(zip(firsts, ptr[:-1] + np.cumsum(per_range, axis=0) - per_range, strict=True))
    rows = np.empty(int(ptr[-1]), np.int32)
    targets = np.empty(int(ptr[-1]), np.float32)
    row_parts(
        n,
        threads,
        lambda a, b: _pairs_pass(yptr, yidx, cptr, cidx, a, b, True, starts[a], rows, targets),
        min_rows=_PAIR_ROWS,
    )
    return ptr, rows, targets


@njit(cache=True, nogil=True)
def _pair_keys(pptr, rows, ids, first_label, at):
    """Keys (label << 32 | row id) of the pairs at ascending offsets `at` of a run of labels
    (pptr from 0, its first label first_label)."""
    out = np.empty(at.size, np.int64)
    k = 0
    for q in range(at.size):
        j = at[q]
        while pptr[k + 1] <= j:
            k += 1
        out[q] = (np.int64(first_label + k) << 32) | ids[rows[j]]
    return out


@njit(cache=True, nogil=True)
def _warm_start(pptr, rows, ids, first_label, keys, values, alpha):
    """alpha[j] = the value of pair j's key in (keys ascending, values) where it is there: each
    label's keys are one contiguous run, searched per label (a search of every pair in all the
    keys was a sixth of a refit)."""
    for k in range(pptr.size - 1):
        lab = np.int64(first_label + k)
        lo = np.searchsorted(keys, lab << 32)
        hi = np.searchsorted(keys, (lab + 1) << 32)
        if lo == hi:
            continue
        run = keys[lo:hi]
        for j in range(pptr[k], pptr[k + 1]):
            key = (lab << 32) | ids[rows[j]]
            p = np.searchsorted(run, key)
            if p < run.size and run[p] == key:
                alpha[j] = values[lo + p]


def frequency_order(indices: np.ndarray, F: int) -> tuple[np.ndarray, np.ndarray]:
    """(rank, feature): features renumbered by descending frequency (ties by id), the last
    (the bias column) kept last; rank[f] = new id, feature[new id] = f."""
    counts = np.bincount(indices, minlength=F)[: F - 1]
    feature = np.empty(F, np.int64)
    feature[: F - 1] = np.argsort(-counts, kind="stable")
    feature[F - 1] = F - 1
    rank = np.empty(F, np.int32)
    rank[feature] = np.arange(F, dtype=np.int32)
    return rank, feature


_LABEL_CHUNK = 1024  # labels per task of the fit at most
_CHUNK_PAIRS = 1 << 18  # (point, label) pairs per task at most, unless one label has more


def label_chunks(pptr: np.ndarray, max_labels: int = _LABEL_CHUNK, max_pairs: int = _CHUNK_PAIRS):
    """Start labels of the fit's tasks: runs of consecutive labels with at most max_labels labels
    and max_pairs pairs (a label with more is a task alone), so that threads finish together
    (debian-related, 22M pairs: the largest task 5.9% of the work with 1,024-label runs, 1.2%
    now). The split depends on the data only, never on the thread count (each task has its own
    seed)."""
    starts, a, L = [], 0, pptr.size - 1
    while a < L:
        starts.append(a)
        # the last label b with pairs(a..b) <= max_pairs, at least one label, at most max_labels
        b = int(np.searchsorted(pptr, pptr[a] + max_pairs, side="right")) - 1
        a = min(max(b, a + 1), a + max_labels, L)
    return starts


@dataclass
class LabelPairs:
    """A fit's (point, label) pairs grouped by label: label l's pairs at ptr[l]:ptr[l + 1], their
    points (rows, ascending) and targets (+1 positive, -1 shortlisted negative)."""

    ptr: np.ndarray
    rows: np.ndarray
    targets: np.ndarray
    num_points: int


def label_pairs(Y: sp.csr_matrix, negatives: sp.csr_matrix, threads: int = 1) -> LabelPairs:
    """The pairs of a fit on labels Y and candidates `negatives` (positives among them are
    ignored), see `_pairs_by_label`."""
    Y = sp.csr_matrix(Y)
    C = sp.csr_matrix(negatives)
    if C.shape != Y.shape:
        raise ValueError(f"sparse ranker: candidates {C.shape} but labels {Y.shape}")
    for M in (Y, C):
        if not M.has_sorted_indices:
            M.sort_indices()  # in place: the same matrix
    ptr, rows, targets = _pairs_by_label(
        Y.indptr.astype(np.int64),
        Y.indices.astype(np.int64),
        C.indptr.astype(np.int64),
        C.indices.astype(np.int64),
        Y.shape[1],
        threads,
    )
    return LabelPairs(ptr, rows, targets, Y.shape[0])


@dataclass
class SparseRanker:
    """W [L, F+1]: per-label weights over the ranker features (last column: bias). `dual`: the
    fit's nonzero dual variables as (pair keys label << 32 | row id, alpha), kept in memory
    only, for a warm-started refit on more points (never saved)."""

    W: sp.csr_matrix
    dual: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        self.W = sp.csr_matrix(self.W, dtype=np.float32)
        self.W.sort_indices()  # the scoring kernel merges / bisects ascending feature ids
        self._w = (self.W.indptr.astype(np.int64), self.W.indices.astype(np.int64), self.W.data)

    @classmethod
    def fit(
        cls,
        Xr: sp.csr_matrix,
        Y: sp.csr_matrix,
        negatives: sp.csr_matrix,
        cost: float = 1.0,
        threshold: float = 0.1,
        max_iters: int = 10,
        seed: int = 0,
        threads: int = 1,
        row_ids: np.ndarray | None = None,
        warm: SparseRanker | None = None,
    ) -> SparseRanker:
        """Xr: ranker_features of the training points; negatives: candidate labels per point
        (positives among them are ignored). A label with no example at all gets bias -1 only:
        a label the ranker never saw must not outscore the ones it learnt to reject (an empty
        row would score 0, above most of them). row_ids: the points' ids in a numbering shared
        with `warm` (default 0..n-1); warm: a ranker fitted on some of the same (point, label)
        pairs, whose dual variables start this fit (a refit after a validation split joins
        converges in a sweep or two instead of starting from zero) and are taken over (warm's
        `dual` is None afterwards; its weights stay)."""
        pairs = label_pairs(Y, negatives, threads)
        return cls.fit_pairs(Xr, pairs, cost, threshold, max_iters, seed, threads, row_ids, warm)

    @classmethod
    def fit_pairs(
        cls,
        Xr: sp.csr_matrix,
        pairs: LabelPairs,
        cost: float = 1.0,
        threshold: float = 0.1,
        max_iters: int = 10,
        seed: int = 0,
        threads: int = 1,
        row_ids: np.ndarray | None = None,
        warm: SparseRanker | None = None,
    ) -> SparseRanker:
        """`fit` on pairs already grouped by label (`label_pairs`): a caller that drops its
        candidate matrix once they are built keeps the two out of memory at the same time (at
        L = 500k ~1.7 GB each in the refit)."""
        if Xr.shape[0] != pairs.num_points:
            raise ValueError(
                f"sparse ranker: {Xr.shape[0]} feature rows but pairs of {pairs.num_points} points"
            )
        pp, prow, py = pairs.ptr, pairs.rows, pairs.targets
        L = pp.size - 1
        F = Xr.shape[1]
        xptr, xval = (
            Xr.indptr.astype(np.int64),
            Xr.data if Xr.dtype in (np.float32, np.float64) else Xr.data.astype(np.float64),
        )
        # features renumbered by frequency: each label's copy of its rows maps every feature
        # to a local id through a vocabulary-sized table, whose frequent entries then share a
        # few cache lines. The arithmetic is the same: the same weights
        rank, feature = frequency_order(Xr.indices, F)
        xidx = rank[Xr.indices]
        ids = np.arange(Xr.shape[0], dtype=np.int64) if row_ids is None else np.asarray(row_ids)
        ids = ids.astype(np.int64)
        wk, wa = warm.dual if warm is not None and warm.dual is not None else (None, None)
        if warm is not None:
            warm.dual = None  # taken over: freed with this fit's locals, not kept beside its own
        starts = label_chunks(pp)
        ends = dict(zip(starts, [*starts[1:], L], strict=True))

        def chunk(a):
            """Labels [a, ends[a]): independent problems, own seed, so the weights do not
            depend on how many threads share the chunks (the kernel releases the GIL). Their
            dual variables (pair keys label << 32 | row id, ascending) start from `warm`'s and
            the nonzero ones come back with the weights."""
            b = ends[a]
            s0, s1 = pp[a], pp[b]
            alpha = np.zeros(s1 - s0, np.float64)
            local = pp[a : b + 1] - s0
            if wk is not None and wa is not None and wk.size:
                _warm_start(local, prow[s0:s1], ids, a, wk, wa, alpha)
            out = _train_labels(
                local,
                prow[s0:s1],
                py[s0:s1],
                alpha,
                xptr,
                xidx,
                xval,
                F,
                float(cost),
                int(max_iters),
                0.1,
                float(threshold),
                int(seed) + a,
            )
            kept = np.flatnonzero(alpha != 0.0)
            keys = _pair_keys(local, prow[s0:s1], ids, a, kept)
            return (*out, keys, alpha[kept].astype(np.float32))

        if threads > 1 and len(starts) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(threads) as ex:
                parts = list(ex.map(chunk, starts))
        else:
            parts = [chunk(a) for a in starts]
        wk = wa = None  # the warm start's duals freed before this fit's are joined
        ptr = np.zeros(L + 1, np.int64)
        off = 0
        for a, q in zip(starts, parts, strict=True):
            ptr[a + 1 : a + q[0].size] = q[0][1:] + off
            off += int(q[0][-1])
        idx = np.concatenate([q[1] for q in parts]) if parts else np.zeros(0, np.int32)
        val = np.concatenate([q[2] for q in parts]) if parts else np.zeros(0, np.float32)
        keys = np.concatenate([q[3] for q in parts]) if parts else np.zeros(0, np.int64)
        dual = np.concatenate([q[4] for q in parts]) if parts else np.zeros(0, np.float32)
        if keys.size > 1 and not np.all(keys[1:] > keys[:-1]):  # row ids given out of order
            order = np.argsort(keys, kind="stable")
            keys, dual = keys[order], dual[order]
        return cls(sp.csr_matrix((val, feature[idx], ptr), shape=(L, F)), (keys, dual))

    def scores(self, Xr: sp.csr_matrix, C: sp.csr_matrix, threads: int = 1) -> np.ndarray:
        """w_l . x_i on every stored entry (i, l) of C, in C's entry order (float32 [nnz]); rows
        split over `threads` (the same values)."""
        C = sp.csr_matrix(C)
        if Xr.shape[1] != self.W.shape[1]:
            raise ValueError(
                f"sparse ranker: features have {Xr.shape[1]} columns, weights {self.W.shape[1]}"
            )
        Xr = sp.csr_matrix(Xr)
        if not Xr.has_sorted_indices:
            Xr = Xr.sorted_indices()
        cptr, cidx = C.indptr.astype(np.int64), C.indices.astype(np.int64)
        xptr, xidx = Xr.indptr.astype(np.int64), Xr.indices.astype(np.int64)
        xval = Xr.data.astype(np.float32)
        out = np.empty(cidx.size, np.float32)

        def part(a: int, b: int) -> None:
            s, e = cptr[a], cptr[b]
            out[s:e] = sparse_entry_scores(
                cptr[a : b + 1] - s, cidx[s:e], xptr[a : b + 1], xidx, xval, *self._w
            )

        row_parts(C.shape[0], threads, part, min_rows=256)
        return out
