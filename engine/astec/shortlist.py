"""Module II: label shortlists from the two indexes (ANNS^x over points, ANNS^mu over label
centres).

The base similarity s of a candidate label l for a point with features v is
    s = w * max_c cos(v, mu_lc) + (1 - w) * sum_j c_j y_jl / sum_j c_j,   c_j = cos(v, v_j)^p
over the label's centres c and the k nearest training points j, for whole batches: the searches,
then one compiled pass per row range (`sparse.label_scores`); no per-point Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from .ann import AnnIndex
from .sparse import label_scores, normalize_rows, remove_entries, topk_rows, topk_rows_outside


def spherical_kmeans(V: np.ndarray, k: int, rng, iters: int = 10) -> np.ndarray:
    """k unit centres of the rows of V (cosine k-means, k-means++-style seeding by distance)."""
    V = normalize_rows(V)
    n = V.shape[0]
    k = min(k, n)
    centres = [V[rng.integers(n)]]
    for _ in range(1, k):
        d = 1.0 - np.max(V @ np.stack(centres).T, axis=1)
        d = np.clip(d, 0, None)
        p = d / d.sum() if d.sum() > 0 else None
        centres.append(V[rng.choice(n, p=p)])
    C = np.stack(centres)
    for _ in range(iters):
        a = np.argmax(V @ C.T, axis=1)
        # per-centre sums as a one-hot product (np.add.at took a twentieth of a training run)
        sums = np.asarray(
            sp.csr_matrix((np.ones(n, V.dtype), (a, np.arange(n))), shape=(C.shape[0], n)) @ V
        )
        empty = np.linalg.norm(sums, axis=1) == 0
        sums[empty] = C[empty]
        C = normalize_rows(sums)
    return C


def _label_means(V: np.ndarray, Y: sp.csr_matrix):
    """(unit rows of V, Y as csc, each label's point count, each label's normalised mean of
    those rows [L, D]; zero rows for labels without points)."""
    Vn = normalize_rows(V)
    Yc = sp.csc_matrix(Y, dtype=np.float32)
    mu = normalize_rows(np.asarray(sp.csr_matrix(Yc.T) @ Vn))
    return Vn, Yc, np.diff(Yc.indptr), mu


def label_centres(
    V: np.ndarray, Y: sp.csr_matrix, head_centres: int, head_min_points: int, seed: int = 0
):
    """Centres in v-space: one per label (normalised mean), several k-means centres per head label.

    Returns (centres float32 [C, D], owner int64 [C]) for labels with at least one point: the
    labels' means first (ascending labels), then each head label's k-means centres (the layout
    `updated_centres` reads).
    """
    Vn, Yc, counts, mu = _label_means(V, Y)
    has = np.flatnonzero(counts > 0)
    centres, owner = [mu[has]], [has]
    if head_centres > 1:
        rng = np.random.default_rng(seed)
        for l in np.flatnonzero(counts >= head_min_points):
            pts = Yc.indices[Yc.indptr[l] : Yc.indptr[l + 1]]
            C = spherical_kmeans(Vn[pts], head_centres, rng)
            centres.append(C)
            owner.append(np.full(C.shape[0], l))
    return np.concatenate(centres).astype(np.float32), np.concatenate(owner).astype(np.int64)


def updated_centres(
    V: np.ndarray, Y: sp.csr_matrix, centres: np.ndarray, owner: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`label_centres` of (V, Y) in the layout of centres / owner, its answer for some of these
    points: each label's first centre (its mean there) becomes its normalised mean over V's
    points, a head label's further centres (k-means of its points) are kept, and each label
    with points but no centre gets one. Returns (vectors [len(owner), D], new centres [m, D],
    their labels [m]): the final indexes keep the fit points' centre graph in this layout,
    grown by the new centres, instead of building it again (L = 500k: 168.6 s a build on 2
    AVX2 cores)."""
    _, _, counts, mu = _label_means(V, Y)
    labels, first = np.unique(owner, return_index=True)
    vectors = np.array(centres, dtype=np.float32)
    vectors[first] = mu[labels]
    has = np.zeros(Y.shape[1], bool)
    has[labels] = True
    new = np.flatnonzero((counts > 0) & ~has).astype(np.int64)
    return vectors, mu[new].astype(np.float32), new


Hits = tuple[np.ndarray, np.ndarray]  # an index's answers: ids [n, k], similarities [n, k]


@dataclass
class ShortlistIndex:
    """The two ANNS structures plus what is needed to turn neighbours into label scores."""

    points: AnnIndex  # ANNS^x over training points' v
    point_labels: sp.csr_matrix  # labels of the indexed points [N_index, L]
    centres: AnnIndex  # ANNS^mu over label centres
    centre_owner: np.ndarray  # label of each centre
    num_labels: int
    prior: np.ndarray  # most frequent labels, always candidates
    prior_score: np.ndarray  # their tiny base score (ordered by frequency, < any real similarity)

    def searches(
        self, V: np.ndarray, knn: int, kmu: int, num_threads: int = 2, with_self: bool = False
    ) -> tuple[Hits | None, Hits | None]:
        """The two searches a shortlist reads, (point hits, centre hits), each None where not
        asked (k = 0) or the index is empty: ANNS^x at k = knn (+ 1 with_self: rows that are
        indexed points find themselves) and ANNS^mu at k = kmu."""
        points = centres = None
        if knn > 0 and self.points.count > 0:
            points = self.points.query(V, knn + (1 if with_self else 0), num_threads)
        if kmu > 0 and self.centres.count > 0:
            centres = self.centres.query(V, kmu, num_threads)
        return points, centres

    def scores(
        self,
        V: np.ndarray,
        knn: int,
        kmu: int,
        centroid_weight: float,
        num_threads: int = 2,
        exclude_self: np.ndarray | None = None,
        knn_power: float = 1.0,
        centre_hits: Hits | None = None,
        point_hits: Hits | None = None,
    ) -> sp.csr_matrix:
        """Base similarity s for every candidate label of every row of V (sparse [n, L]).

        exclude_self: for training rows, the row's own id in the point index (so a point is
        not its own neighbour). centre_hits: this V's label-centre search, done once at a k >=
        kmu for several shortlists (its first kmu columns are the top kmu). point_hits: this
        V's search of the points at k = knn (+ 1 with exclude_self), done once likewise.
        """
        n = V.shape[0]
        no_hits: Hits = (np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32))
        pids, pw = no_hits
        searched = self.searches(
            V,
            knn if point_hits is None else 0,
            kmu if centre_hits is None else 0,
            num_threads,
            with_self=exclude_self is not None,
        )
        point_hits = point_hits if point_hits is not None else searched[0]
        centre_hits = centre_hits if centre_hits is not None else searched[1]
        if knn > 0 and self.points.count > 0 and point_hits is not None:
            extra = 1 if exclude_self is not None else 0
            pids, sims = point_hits[0][:, : knn + extra], point_hits[1][:, : knn + extra]
            if exclude_self is not None:
                keep = pids != exclude_self[:, None]
                # drop self (or the last column when self was not found) to keep knn columns
                drop_last = keep.all(axis=1)
                keep[drop_last, -1] = False
                pids = pids[keep].reshape(n, -1)
                sims = sims[keep].reshape(n, -1)
            pw = np.clip(sims, 0, None) ** knn_power  # > 1 sharpens towards the closest points
        cids, csims = no_hits
        if kmu > 0 and self.centres.count > 0 and centre_hits is not None:
            cids, csims = centre_hits[0][:, :kmu], centre_hits[1][:, :kmu]
        # the prior's tiny positive score makes its labels stored entries (the classifier
        # scores them)
        return label_scores(
            pids,
            pw,
            self.point_labels,
            cids,
            csims,
            self.centre_owner,
            self.prior,
            self.prior_score,
            centroid_weight,
            self.num_labels,
            num_threads,
        )


def candidates(S: sp.csr_matrix, size: int, extra: sp.csr_matrix | None = None) -> sp.csr_matrix:
    """Top `size` labels of S per row, with prior labels in `extra` kept too (scores from S)."""
    T = topk_rows(S, size)
    return sp.csr_matrix(T)


def hard_negatives(
    S: sp.csr_matrix, Y: sp.csr_matrix, size: int, threads: int = 1
) -> sp.csr_matrix:
    """The top `size` labels of S that are not positives, as a 0/1 csr."""
    H = topk_rows_outside(S, Y, size, threads)
    H.data[:] = 1.0
    return sp.csr_matrix(H, dtype=np.float32)


def add_random_negatives(
    H: sp.csr_matrix, Y: sp.csr_matrix, random_negatives: int, seed: int
) -> sp.csr_matrix:
    """H plus `random_negatives` uniformly drawn non-positive labels per row, as a 0/1 csr."""
    n, L = Y.shape
    if random_negatives > 0 and L > 0:
        rng = np.random.default_rng(seed)
        R = sp.csr_matrix(
            (
                np.ones(n * random_negatives, np.float32),
                rng.integers(0, L, n * random_negatives),
                np.arange(0, n * random_negatives + 1, random_negatives),
            ),
            shape=(n, L),
        )
        R.sum_duplicates()
        R = remove_entries(R, Y)
        R.data[:] = 1.0
        H = H + R
        H.data[:] = 1.0
    return sp.csr_matrix(H, dtype=np.float32)


def recall_at(S: sp.csr_matrix, Y: sp.csr_matrix, size: int) -> float:
    """Fraction of all positive (point, label) pairs found in the top `size` of S (percent)."""
    T = topk_rows(
        S, size
    ).copy()  # topk_rows may return S itself: never overwrite the caller's scores
    T.data[:] = 1.0
    hit = T.multiply(sp.csr_matrix(Y) != 0).sum()
    total = sp.csr_matrix(Y).nnz
    return float(100.0 * hit / max(total, 1))
