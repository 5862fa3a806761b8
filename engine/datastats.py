"""Summary figures of a multi-label data set (the numbers XC papers report in their tables).

Label-side figures are taken over all L labels, including those with no points, so they match
what the label space actually holds (a label with 0 training points still needs a score).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

QUANTILES = (0, 25, 50, 75, 90, 99, 100)


def dataset_stats(Y, texts: list[str] | None = None, X=None) -> dict:
    """N, L and label/point/word distributions of a data set as a JSON-ready dict."""
    Y = sp.csr_matrix(Y)
    N, L = Y.shape
    B = Y.copy()
    B.data = np.ones_like(B.data)
    B.eliminate_zeros()
    per_point = np.diff(B.indptr)
    per_label = np.bincount(B.indices, minlength=L) if L else np.zeros(0, dtype=np.int64)

    def mean(a):
        return float(a.mean()) if a.size else 0.0

    def median(a):
        return float(np.median(a)) if a.size else 0.0

    out: dict = {
        "N": int(N),
        "L": int(L),
        "nnz": int(B.nnz),
        "labels_per_point_mean": mean(per_point),
        "labels_per_point_median": median(per_point),
        "labels_per_point_max": int(per_point.max()) if N else 0,
        "points_with_0_labels": int((per_point == 0).sum()),
        "points_per_label_mean": mean(per_label),
        "points_per_label_median": median(per_label),
        "label_freq_quantiles": {
            ("min" if q == 0 else "max" if q == 100 else f"p{q}"): float(
                np.percentile(per_label, q)
            )
            if L
            else 0.0
            for q in QUANTILES
        },
        "labels_with_0_points": int((per_label == 0).sum()),
        "frac_labels_le5_points": float((per_label <= 5).mean()) if L else 0.0,
    }
    if texts is not None:
        if len(texts) != N:
            raise ValueError(f"{len(texts)} texts but Y has {N} rows")
        words = np.fromiter((len(t.split()) for t in texts), dtype=np.int64, count=N)
        out["words_per_point_mean"] = mean(words)
        out["words_per_point_median"] = median(words)
    if X is not None:
        X = sp.csr_matrix(X)
        out["F"] = int(X.shape[1])
        out["features_per_point_mean"] = mean(np.diff(X.indptr))
    return out


def format_stats(stats: dict) -> str:
    """A readable two-column table of :func:`dataset_stats` output."""
    rows = []
    for key, val in stats.items():
        if isinstance(val, dict):
            rows.append((key, "  ".join(f"{k}={_fmt(v)}" for k, v in val.items())))
        else:
            rows.append((key, _fmt(val)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if v.is_integer() and abs(v) < 1e15 else f"{v:.4f}"
    return str(v)
