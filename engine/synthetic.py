"""Synthetic extreme multi-label data with the shape of the paper's short-text sets.

Zipfian label popularity (a few head labels, a long tail), ~5 labels and ~5 words per point.
Each label owns a few signature words; a point's words are drawn from its labels' signatures,
with some noise words, so the task is learnable and its difficulty grows with L as in real data.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def zipf_dataset(
    num_points: int,
    num_labels: int,
    labels_per_point: int = 5,
    words_per_point: int = 5,
    words_per_label: int = 3,
    vocab_size: int | None = None,
    exponent: float = 1.0,
    noise: float = 0.2,
    seed: int = 0,
) -> tuple[list[str], sp.csr_matrix]:
    """(texts, Y [num_points, num_labels] 0/1 csr). Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    L, n = int(num_labels), int(num_points)
    V = int(vocab_size or max(1000, L))
    p = 1.0 / np.arange(1, L + 1) ** exponent
    p /= p.sum()
    popular = rng.permutation(L)  # label ids are not sorted by popularity
    lab = popular[
        np.searchsorted(np.cumsum(p), rng.random((n, labels_per_point)), side="right").clip(
            0, L - 1
        )
    ]
    sig = rng.integers(0, V, (L, words_per_label))
    which = rng.integers(0, labels_per_point, (n, words_per_point))
    slot = rng.integers(0, words_per_label, (n, words_per_point))
    words = sig[lab[np.arange(n)[:, None], which], slot]
    noisy = rng.random((n, words_per_point)) < noise
    words[noisy] = rng.integers(0, V, int(noisy.sum()))
    Y = sp.csr_matrix(
        (np.ones(lab.size, np.float32), lab.ravel(), np.arange(0, lab.size + 1, labels_per_point)),
        shape=(n, L),
    )
    Y.sum_duplicates()
    Y.data[:] = 1.0
    tok = np.char.add("w", words.astype(str))
    texts = [" ".join(r) for r in tok.tolist()]
    return texts, Y


def label_names(num_labels: int) -> list[str]:
    return [f"label{i}" for i in range(num_labels)]
