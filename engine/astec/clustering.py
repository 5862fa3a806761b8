"""Module I's surrogate labels: balanced 2-means over label centroids, applied recursively."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from tqdm import tqdm

from .sparse import normalize_rows


def label_centroids(X: sp.csr_matrix, Y: sp.csr_matrix) -> sp.csr_matrix:
    """mu_l = normalised sum of the features of label l's positive points (zero row if none)."""
    return normalize_rows(
        sp.csr_matrix(Y.T.astype(np.float32)) @ sp.csr_matrix(X, dtype=np.float32)
    )


_GRAM_MAX = 512  # nodes up to this many labels split on their Gram matrix


def _split_gram(G: np.ndarray, rng, iters: int = 10) -> np.ndarray:
    """`_split` on the Gram matrix G = C C^T of the node's (unit or zero) rows: a centre is a
    normalised sum of rows, so every similarity to it is G @ indicator / its norm. The same
    steps and random draws as `_split`, with nothing of the vocabulary's size per step: most of
    the ~L_hat splits are of small nodes, where `_split`'s dense vocabulary-wide centres and
    sparse products were the cost (L = 500k: 32,767 splits at ~70 per second)."""
    n = G.shape[0]
    first = rng.integers(n)
    second = int(np.argmin(G[:, first]))
    if second == first:
        second = (first + 1) % n
    S = G[:, [first, second]].copy()
    half = n // 2
    left = np.zeros(n, dtype=bool)
    prev = None
    for _ in range(iters):
        order = np.argsort(-(S[:, 0] - S[:, 1]), kind="stable")
        left[:] = False
        left[order[: half + (n % 2) * (rng.random() < 0.5)]] = True
        if prev is not None and np.array_equal(prev, left):
            break
        prev = left.copy()
        ind = np.stack([left, ~left], axis=1).astype(G.dtype)
        GS = G @ ind
        nrm = np.sqrt(np.maximum((ind * GS).sum(axis=0), 0.0))
        S = GS / np.where(nrm > 0, nrm, 1.0)
    return left


def _split(C, rng, iters: int = 10):
    """One balanced 2-means++ split of the rows of C (cosine); returns a boolean 'left' mask."""
    n = C.shape[0]
    if n <= _GRAM_MAX:
        G = C @ C.T
        return _split_gram(
            np.asarray(G.toarray() if sp.issparse(G) else G, dtype=np.float32), rng, iters
        )
    first = rng.integers(n)
    sims = np.asarray(C @ C[first].T.toarray() if sp.issparse(C) else C @ C[first]).ravel()
    second = int(np.argmin(sims))
    if second == first:
        second = (first + 1) % n
    centres = C[[first, second]]
    centres = centres.toarray() if sp.issparse(centres) else np.asarray(centres)
    half = n // 2
    left = np.zeros(n, dtype=bool)
    prev = None
    for _ in range(iters):
        S = np.asarray(C @ centres.T)
        diff = S[:, 0] - S[:, 1]
        order = np.argsort(-diff, kind="stable")
        left[:] = False
        left[order[: half + (n % 2) * (rng.random() < 0.5)]] = True
        if prev is not None and np.array_equal(prev, left):
            break
        prev = left.copy()
        # both sides' sums as one product with a 2 x n indicator (row masks of a sparse C
        # copied it twice per iteration)
        side = sp.csr_matrix(
            (np.ones(n, np.float32), ((~left).astype(np.int64), np.arange(n))), shape=(2, n)
        )
        sums = np.asarray((side @ C).toarray() if sp.issparse(C) else side @ C)
        for j in range(2):
            nrm = np.linalg.norm(sums[j])
            centres[j] = sums[j] / nrm if nrm > 0 else sums[j]
    return left


def balanced_clusters(
    centroids, num_clusters: int, seed: int = 0, progress: bool = True
) -> np.ndarray:
    """Cluster id in [0, num_clusters) for each label: recursive balanced 2-means (Parabel/Astec).

    Splits continue until there are num_clusters leaves (a power of two need not be asked for:
    the largest leaves are split first). Zero centroids (labels without training points) are
    spread over the clusters by the balance constraint. Ids follow the tree: with a power of two
    clusters, ids [k * 2^j, (k + 1) * 2^j) are one subtree.
    """
    L = centroids.shape[0]
    num_clusters = max(1, min(num_clusters, L))
    rng = np.random.default_rng(seed)
    C = (
        sp.csr_matrix(centroids, dtype=np.float32)
        if sp.issparse(centroids)
        else np.asarray(centroids, np.float32)
    )
    leaves = [np.arange(L)]
    bar = tqdm(
        total=num_clusters - 1,
        desc="Module I: clustering labels",
        disable=not progress,
        leave=False,
    )
    while len(leaves) < num_clusters:
        # split the largest leaves of the current level (keeps sizes balanced), each in its place:
        # the leaves stay in the tree's order, so a subtree is a range of cluster ids
        # (`sampled_head` draws a positive's siblings as its hard negatives)
        n_split = min(len(leaves), num_clusters - len(leaves))
        order = np.argsort([-len(x) for x in leaves], kind="stable")[:n_split]
        chosen = np.zeros(len(leaves), dtype=bool)
        chosen[order] = True
        new, split = [], False
        for idx, c in zip(leaves, chosen, strict=True):
            if not c or len(idx) < 2:
                new.append(idx)
                continue
            left = _split(C[idx], rng)
            new.extend([idx[left], idx[~left]])
            split = True
            bar.update(1)
        leaves = new
        if not split:
            break
    bar.close()
    assign = np.empty(L, dtype=np.int64)
    for k, idx in enumerate(leaves):
        assign[idx] = k
    return assign


def meta_labels(Y: sp.csr_matrix, assign: np.ndarray, num_clusters: int) -> sp.csr_matrix:
    """Y_hat[i, k] = 1 iff point i has a label in cluster k."""
    L = Y.shape[1]
    A = sp.csr_matrix((np.ones(L, np.float32), (np.arange(L), assign)), shape=(L, num_clusters))
    M = sp.csr_matrix(Y, dtype=np.float32) @ A
    M.data[:] = 1.0
    return M
