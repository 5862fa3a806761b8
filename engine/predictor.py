"""The torch-free CPU predictor: title -> top-k labels in O(D^2 + D log L), for stream consumers.

Loads an exported predictor directory (see docs/predictor-format.md, written by `astec export`)
with numpy, numba and, optionally, onnxruntime only: importing this module never imports torch
(nor hnswlib: its graph files are read and searched by engine.hnsw_graph).
Loading verifies the manifest (size + sha256 of every file) before any file is used and builds
the object only once everything is loaded, so a predictor is either complete or refused.

Per learner, for a text with TF-IDF vector x (and x' its words + word pairs, unit length, plus a
bias feature, for the sparse ranker):
    v = ReLU(E^T x)              shortlist features (ANNS^x over points, ANNS^mu over centres)
    s = w max_c cos(v, mu_c) + (1 - w) sum_j cos(v, v_j)^p y_j / sum_j cos(v, v_j)^p
    C = the top `shortlist_size` labels by s, + the prior (most frequent) labels, always scored,
        + the labels whose name the text matches at least `label_text_min_match` (s ~ 0)
    z = v + ReLU(R v)
    y = alpha sigma(w_l^T z + b_l) + (1 - alpha) sigma(s_l)
    y = beta y + (1 - beta) sigma(w~_l^T z~ + b~_l)          (re-ranker)
    y = gamma y + (1 - gamma) sigma(u_l^T x')                 (sparse ranker)
An ensemble joins y over the union of its learners' candidates by `ensemble`: "mean" (a label a
learner did not shortlist counts 0 there) or "max". Then every candidate gets
    y += label_text_weight * (idf share of the label's name found in the text)   (label-name match)
and the top k by y are returned, ties to the lower label id.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import scipy.sparse as sp

from engine import kernels
from engine.astec.config import TOP_K
from engine.hnsw_graph import GraphFileError, HnswGraph, read_graph
from engine.hugepages import huge_pages_for
from engine.label_text import NAME_ONLY_S, LabelText
from engine.manifest import Manifest, ManifestError, verify_manifest
from engine.text import TfidfVectorizer
from engine.title_words import TitleWords, VocabTable

__all__ = ["ManifestError", "Predictor", "PredictorError"]

log = logging.getLogger(__name__)
CONFIG_NAME = "predictor.json"


class PredictorError(ManifestError):
    """A predictor directory is inconsistent (shapes, fields) or cannot be loaded."""


SMALL_BATCH = 16  # batches below this size take the single-text kernels text by text
_NO_IDS = np.zeros((1, 0), np.int64)  # an absent index's (ids, sims) for one query
_NO_SIMS = np.zeros((1, 0), np.float32)
_NO_MEMBERS = np.zeros(1, np.int64)  # members_indptr of an index without duplicate vectors


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # same clipping and dtype as engine.astec.predict.sigmoid, so scores match to float32 rounding
    return (1.0 / (1.0 + np.exp(-np.clip(x, -30, 30)))).astype(np.float32)


@dataclass
class ServingEncoder:
    """z = v + ReLU(R v) with v = ReLU(E^T x); the learner holds E fused with the re-ranker's."""

    emb: np.ndarray  # [V, D] float32
    residual: np.ndarray  # [D, D] float32, spectral norm already applied
    onnx_path: Path | None = None
    _session: object | None = None

    def z_from_v(self, v: np.ndarray) -> np.ndarray:
        h = v @ self.residual.T
        np.maximum(h, 0, out=h)
        h += v
        return h

    # ---- ONNX backend ----------------------------------------------------------------------
    def session(self, threads: int):
        if self._session is None:
            import onnxruntime as ort  # imported lazily: the numpy backend does not need it

            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            self._session = ort.InferenceSession(
                str(self.onnx_path), opts, providers=["CPUExecutionProvider"]
            )
        return self._session

    def vz_onnx(self, ids: np.ndarray, weights: np.ndarray, threads: int):
        """(v, z) from padded [n, T] token ids / TF-IDF weights (weight 0 pads)."""
        v, z = self.session(threads).run(["v", "z"], {"ids": ids, "weights": weights})
        return v, z


@dataclass
class AnnSearch:
    """k nearest training points / label centres by cosine, as the model's engine.astec.ann does.

    Either an HNSW graph (hnswlib's, searched by engine.hnsw_graph) or an exact search over a
    small float32 table. Exported indexes hold each distinct vector once (duplicate vectors,
    common among label centres of rare labels, cut HNSW graphs into islands and wreck recall);
    `members` maps a distinct vector back to the original ids, and ties between duplicates go
    to the lower original id.
    """

    count: int  # original items
    graph: HnswGraph | None = None
    vectors: np.ndarray | None = None  # exact search: distinct unit vectors [U, D]
    members_indptr: np.ndarray | None = None  # distinct vector -> original ids (None: identity)
    members: np.ndarray | None = None

    @property
    def unique(self) -> int:
        return self.count if self.members_indptr is None else self.members_indptr.size - 1

    def query_one(self, q: np.ndarray, k: int, threads: int = 1):
        """query for one query q [1, D] as flat (ids [k'], sims [k']): the single-text path,
        the graph search and the expansion of duplicates in one compiled call; an exact table
        goes through query."""
        k = min(int(k), self.count)
        g = self.graph
        if g is None or k <= 0:
            ids, sims = self.query(q, k, threads)
            return ids[0], sims[0]
        return kernels.graph_hits(q[0], k, g.ef, *_graph_args(g, self))

    def query(self, Q: np.ndarray, k: int, threads: int = 1):
        """(ids int64 [n, k'], sims float32 [n, k']) best first, k' = min(k, count)."""
        n = Q.shape[0]
        k = min(int(k), self.count)
        kq = min(k, self.unique)
        if k <= 0:
            return np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
        if self.graph is not None:
            ids, sims = self.graph.search(Q, kq)
        else:
            if self.vectors is None:
                raise PredictorError(f"an index of {self.count} items has neither graph nor table")
            S = Q @ self.vectors.T
            if kq < S.shape[1]:
                part = np.argpartition(-S, kq - 1, axis=1)[:, :kq]
            else:
                part = np.broadcast_to(np.arange(S.shape[1]), S.shape)
            ps = np.take_along_axis(S, part, axis=1)
            order = np.lexsort((part, -ps), axis=1) if n else part
            ids = np.take_along_axis(part, order, axis=1).astype(np.int64)
            sims = np.take_along_axis(ps, order, axis=1).astype(np.float32)
        if self.members_indptr is None or self.members is None:
            return ids, sims
        # expand distinct vectors to their original ids; keep the best k per row
        flat = ids.ravel()
        start = self.members_indptr[flat]
        lens = self.members_indptr[flat + 1] - start
        total = int(lens.sum())
        if total == flat.size:  # no duplicates among the hits: ids map one to one
            return self.members[start].reshape(n, kq)[:, :k], sims[:, :k]
        pos = np.repeat(start - np.cumsum(lens) + lens, lens) + np.arange(total)
        orig = self.members[pos]
        sv = np.repeat(sims.ravel(), lens)
        # already best first per row: distinct hits come best first and a group's members
        # ascending, so the first k of each row are its best k (no sort)
        per_row = np.add.reduceat(lens, np.arange(0, flat.size, kq)) if n else lens
        rank = np.arange(total) - np.repeat(np.cumsum(per_row) - per_row, per_row)
        keep = rank < k
        return orig[keep].reshape(n, k), sv[keep].reshape(n, k)


@dataclass
class ServingLearner:
    """One Astec learner's arrays: shortlist structures, classifier, optional re-ranker.

    The hot paths read fused tables built once at load (`fuse`): E = [E | E~] so one gather of
    embedding rows serves both encoders, and Wc = [W | W~], bc = [b, b~] so one gather of
    classifier rows scores a candidate for the classifier and the re-ranker. enc.emb, W, rr_W,
    b and rr_b stay available as views of them.
    """

    enc: ServingEncoder  # v for the indexes, z for the classifier
    W: np.ndarray  # [L, D] float32 or float16
    b: np.ndarray  # [L] float32
    points: AnnSearch | None  # ANNS^x over training points' normalised v
    point_indptr: np.ndarray
    point_labels: np.ndarray
    point_values: np.ndarray
    centres: AnnSearch | None  # ANNS^mu over label centres
    centre_owner: np.ndarray
    prior: np.ndarray  # labels always scored (covers empty texts)
    prior_score: np.ndarray  # their tiny base score (< any real similarity)
    knn: int
    kmu: int
    centroid_weight: float
    shortlist_size: int
    alpha: float
    beta: float
    rr_enc: ServingEncoder | None = None
    rr_W: np.ndarray | None = None
    rr_b: np.ndarray | None = None
    knn_power: float = 1.0
    sparse: RankerArrays | None = None  # sparse ranker weights
    gamma: float = 1.0  # weight of the Astec score against the sparse ranker's
    # built by fuse(), which the loader calls before the learner serves
    E: np.ndarray = field(init=False)  # [V, D] or [V, 2D] fused embeddings
    Wc: np.ndarray = field(init=False)  # [L, D] or [L, 2D] fused classifier rows
    bc: np.ndarray = field(init=False)  # [L, 1] or [L, 2] fused biases
    _RT: np.ndarray = field(init=False)  # residual transposes (contiguous) for the kernels
    _RrT: np.ndarray = field(init=False)
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def fuse(self) -> ServingLearner:
        """Build the fused tables; the separate (memory-mapped) arrays are then dropped.

        Also sorts the prior labels (with their scores) so lookups can bisect.
        """
        order = np.argsort(self.prior, kind="stable")
        self.prior, self.prior_score = self.prior[order], self.prior_score[order]
        self._RT = np.ascontiguousarray(self.enc.residual.T, np.float32)
        self._RrT = (
            np.ascontiguousarray(self.rr_enc.residual.T, np.float32)
            if self.rr_enc is not None
            else np.zeros((1, 1), np.float32)
        )
        if self.rr_enc is None or self.rr_W is None or self.rr_b is None:
            self.E, self.Wc, self.bc = self.enc.emb, self.W, self.b[:, None]
            return self
        D = self.W.shape[1]
        self.E = np.hstack(
            [np.asarray(self.enc.emb, np.float32), np.asarray(self.rr_enc.emb, np.float32)]
        )
        self.Wc = np.hstack([self.W, self.rr_W.astype(self.W.dtype, copy=False)])
        self.bc = np.ascontiguousarray(np.stack([self.b, self.rr_b], axis=1), np.float32)
        self.enc.emb, self.rr_enc.emb = self.E[:, :D], self.E[:, D:]
        self.W, self.rr_W = self.Wc[:, :D], self.Wc[:, D:]
        self.b, self.rr_b = self.bc[:, 0], self.bc[:, 1]
        return self

    @property
    def dim(self) -> int:
        return self.W.shape[1]

    # ---- features ---------------------------------------------------------------------------
    def encode(
        self, rows: np.ndarray, idx: np.ndarray, val: np.ndarray, n: int, reranker: bool = True
    ):
        """(v, z, z~ or None) for n texts given flat (row, token, weight) triples: one sparse
        product with the fused table for both encoders (its contiguous rows are what the sparse
        product reads fast); reranker=False skips z~'s residual block."""
        D = self.dim
        if idx.size == 0:
            vv = np.zeros((n, self.E.shape[1]), np.float32)
        else:
            indptr = np.searchsorted(rows, np.arange(n + 1))
            X = sp.csr_matrix((val, idx, indptr), shape=(n, self.E.shape[0]))
            vv = np.asarray(X @ self.E, dtype=np.float32)
            np.maximum(vv, 0, out=vv)
        v = np.ascontiguousarray(vv[:, :D])
        z = self.enc.z_from_v(v)
        zr = self.rr_enc.z_from_v(vv[:, D:]) if reranker and self.rr_enc is not None else None
        return v, z, zr

    # ---- shortlist ------------------------------------------------------------------------
    def base_scores(self, V: np.ndarray, threads: int):
        """Flat (row, label, s) candidates for a batch of shortlist features V [n, D].

        Vectorised over the batch: keys row*L+label are reduced with bincount (neighbour sum)
        and maximum.at (centre max); no Python loop per point or label.
        """
        n, L = V.shape[0], self.W.shape[0]
        norms = np.linalg.norm(V, axis=1, keepdims=True)
        norms[norms == 0] = 1.0
        Q = np.ascontiguousarray(V / norms, dtype=np.float32)
        key_parts, kind_parts, val_parts = [], [], []
        if self.knn > 0 and self.points is not None:
            ids, sims = self.points.query(Q, self.knn, threads)
            np.maximum(sims, 0, out=sims)
            if self.knn_power != 1.0:
                sims = sims ** np.float32(self.knn_power)
            k_eff = ids.shape[1]
            denom = sims.sum(axis=1, dtype=np.float32)
            denom[denom == 0] = 1.0
            ids = ids.astype(np.int64).ravel()
            start = self.point_indptr[ids]
            lens = self.point_indptr[ids + 1] - start
            total = int(lens.sum())
            pos = np.repeat(start - np.cumsum(lens) + lens, lens) + np.arange(total)
            rows = np.repeat(np.repeat(np.arange(n), k_eff), lens)
            w = np.repeat((sims / denom[:, None]).ravel(), lens) * self.point_values[pos]
            key_parts.append(rows * L + self.point_labels[pos])
            kind_parts.append(np.zeros(total, np.int8))
            val_parts.append(w.astype(np.float32))
        if self.kmu > 0 and self.centres is not None:
            ids, sims = self.centres.query(Q, self.kmu, threads)
            sims = np.maximum(sims, 0).ravel()
            rows = np.repeat(np.arange(n), ids.shape[1])
            key_parts.append(rows * L + self.centre_owner[ids.ravel()])
            kind_parts.append(np.ones(sims.size, np.int8))
            val_parts.append(sims)
        if self.prior.size:
            rows = np.repeat(np.arange(n), self.prior.size)
            key_parts.append(rows * L + np.tile(self.prior, n))
            kind_parts.append(np.full(rows.size, 2, np.int8))
            val_parts.append(np.tile(self.prior_score, n))
        if not key_parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        keys = np.concatenate(key_parts)
        kind = np.concatenate(kind_parts)
        vals = np.concatenate(val_parts)
        uniq, inv = np.unique(keys, return_inverse=True)
        u = uniq.size
        knn_sum = np.bincount(inv[kind == 0], weights=vals[kind == 0], minlength=u)
        # centre part: hits come best first within a row, so a key's first occurrence is its max
        mu_max = np.zeros(u, np.float32)
        mk = kind == 1
        if mk.any():
            ukeys, firsts = np.unique(keys[mk], return_index=True)
            mu_max[np.searchsorted(uniq, ukeys)] = vals[mk][firsts]
        prior = np.bincount(inv[kind == 2], weights=vals[kind == 2], minlength=u)
        s = (
            (1.0 - self.centroid_weight) * knn_sum.astype(np.float32)
            + self.centroid_weight * mu_max
            + prior.astype(np.float32)
        ).astype(np.float32)
        keep = s != 0
        uniq, s = uniq[keep], s[keep]
        rows, labels = np.divmod(uniq, L)
        if np.bincount(rows, minlength=n).max(initial=0) <= self.shortlist_size:
            return rows, labels, s  # nothing to cut (the usual case at small k)
        # top `shortlist_size` per row by s (ties: lower label id), like sparse.topk_rows
        order = np.lexsort((labels, -s, rows))
        rows, labels, s = rows[order], labels[order], s[order]
        first = np.searchsorted(rows, np.arange(n))
        rank = np.arange(rows.size) - first[rows]
        sel = rank < self.shortlist_size
        if self.prior.size and not sel.all():
            # prior labels are always scored; one cut from the top gets s = its prior score
            cut = ~sel & np.isin(labels, self.prior)
            s = s.copy()
            s[cut] = self.prior_score[np.searchsorted(self.prior, labels[cut])]
            sel |= cut
        rows, labels, s = rows[sel], labels[sel], s[sel]
        back = np.argsort(rows * L + labels)  # candidates grouped by row, ascending labels
        return rows[back], labels[back], s[back]

    # ---- the single-text latency path ----------------------------------------------------------
    def _scratch(self):
        """Two zeroed float32 [L] accumulators for this thread (the kernels reset what they
        touch, so they stay zero between texts)."""
        loc = self._local
        if not hasattr(loc, "acc"):
            L = self.W.shape[0]
            loc.acc, loc.mu = np.zeros(L, np.float32), np.zeros(L, np.float32)
        return loc.acc, loc.mu

    def ranker_scratch(self) -> np.ndarray:
        """A zeroed float32 [F] for this thread: one text's sparse ranker features scattered
        densely (kernels.sparse_mix_dense resets what it sets)."""
        loc = self._local
        if not hasattr(loc, "xd"):
            if self.sparse is None:
                raise PredictorError("this learner has no sparse ranker")
            loc.xd = np.zeros(self.sparse.bias_feature + 1, np.float32)
        return loc.xd

    def score_one(
        self, idx: np.ndarray, val: np.ndarray, threads: int, extra: np.ndarray | None = None
    ):
        """(labels ascending, y, z) for one text's TF-IDF (idx, val): the batch path's
        arithmetic for one row in four compiled kernels (engine.kernels) around the two graph
        searches; z [D] is the text's final feature vector. extra: ascending labels that join
        the shortlist (label-name candidates).
        """
        D = self.dim
        has_rr = self.rr_enc is not None
        vv, q = kernels.bag_features(idx, val, self.E, D)
        z, zr = kernels.residual_features(vv, self._RT, self._RrT, D, has_rr)
        acc, mu = self._scratch()
        none = (_NO_IDS[0], _NO_SIMS[0])
        pid, psim = (
            self.points.query_one(q, self.knn, threads)
            if self.knn > 0 and self.points is not None
            else none
        )
        cid, csim = (
            self.centres.query_one(q, self.kmu, threads)
            if self.kmu > 0 and self.centres is not None
            else none
        )
        try:
            c, s = kernels.shortlist(
                pid,
                psim,
                self.point_indptr,
                self.point_labels,
                self.point_values,
                cid,
                csim,
                self.centre_owner,
                self.prior,
                self.prior_score,
                acc,
                mu,
                float(self.centroid_weight),
                float(self.knn_power),
                int(self.shortlist_size),
            )
        except BaseException:  # never leave a dirty scratch behind for the next text
            acc[:] = 0
            mu[:] = 0
            raise
        if extra is not None and extra.size:
            c, s = kernels.merge_candidates(c, s, extra, NAME_ONLY_S)
        if self.Wc.dtype == np.float32:
            W, rows = self.Wc, c
        else:  # float16 rows: the kernels read float32, gather and widen here
            W, rows = self.Wc[c].astype(np.float32), np.arange(c.size)
        y, _ = kernels.combine_scores(
            W, rows, self.bc, c, s, z, zr, float(self.alpha), float(self.beta), D, has_rr
        )
        return c, y, z

    # ---- scores -----------------------------------------------------------------------------
    def final_scores(self, rows, labels, s, Z, Zr, chunk_bytes: int = 8 << 20) -> np.ndarray:
        """alpha/beta combination for (row, label) candidates grouped by row (candidate order).

        Candidates are laid out as a padded [rows, max per row] table so each chunk of rows is
        one gather of fused classifier rows and one or two batched mat-vecs (no [pairs, D] copy
        of z).
        """
        n, D = Z.shape[0], self.dim
        out = np.empty(labels.size, np.float32)
        if labels.size == 0:
            return out
        col, width = _row_slots(rows, n)
        pad = np.zeros((n, width), np.int64)
        pad[rows, col] = labels
        step = max(1, chunk_bytes // (width * self.Wc.shape[1] * 4))
        logit = np.empty((n, width), np.float32)
        rr_b = self.rr_b if self.rr_enc is not None else None
        rlogit = np.empty((n, width), np.float32) if rr_b is not None else None
        for a in range(0, n, step):
            G = np.take(self.Wc, pad[a : a + step], axis=0).astype(np.float32, copy=False)
            logit[a : a + step] = np.matmul(G[..., :D], Z[a : a + step, :, None])[..., 0]
            if rlogit is not None:
                rlogit[a : a + step] = np.matmul(G[..., D:], Zr[a : a + step, :, None])[..., 0]
        lg = logit[rows, col] + self.b[labels]
        y = self.alpha * _sigmoid(lg) + (1.0 - self.alpha) * _sigmoid(s)
        if rlogit is not None and rr_b is not None:
            rl = rlogit[rows, col] + rr_b[labels]
            y = self.beta * y + (1.0 - self.beta) * _sigmoid(rl)
        out[:] = y
        return out


HEAVY_RANKER_ROW = 128  # sparse ranker rows longer than this are scored through their transpose


class RankerArrays(NamedTuple):
    """The sparse ranker's weights in the order kernels.sparse_scores_split and sparse_mix_dense
    take them (star-unpacked after the text's features)."""

    indptr: np.ndarray  # [L + 1] int64: label rows
    indices: np.ndarray  # int32 feature ids, ascending within a row
    values: np.ndarray  # float32
    heavy_indptr: np.ndarray  # [F + 1] int64: the long rows' transpose (feature -> slots)
    heavy_slots: np.ndarray  # int32
    heavy_values: np.ndarray  # float32
    slot: np.ndarray  # [L] int32: a label's column in the transpose, -1 for a short row
    heavy_bias: np.ndarray  # float32 bias weight of each long row
    bias_feature: int  # F - 1


_NO_RANKER = RankerArrays(  # the sparse ranker's arguments of a learner without one (unread)
    np.zeros(1, np.int64),
    np.zeros(0, np.int32),
    np.zeros(0, np.float32),
    np.zeros(1, np.int64),
    np.zeros(0, np.int32),
    np.zeros(0, np.float32),
    np.zeros(0, np.int32),
    np.zeros(1, np.float32),
    0,
)


def _split_ranker(sptr, sidx, sval, L: int, F: int) -> RankerArrays:
    """The sparse ranker's weights as kernels.sparse_scores_split reads them: rows with
    ascending feature ids, plus the transpose of the long rows (frequent labels) without the
    bias feature, their slots and their bias weights."""
    U = sp.csr_matrix((sval, sidx, sptr), shape=(L, F))
    U.sort_indices()
    # int32 ids: half the bytes the scoring streams through (cache pressure is part of its cost)
    ptr, idx, val = U.indptr.astype(np.int64), U.indices.astype(np.int32), U.data.astype(np.float32)
    nnz = np.diff(ptr)
    heavy = np.flatnonzero(nnz > HEAVY_RANKER_ROW)
    slot = np.full(L, -1, np.int32)
    slot[heavy] = np.arange(heavy.size)
    rows = np.repeat(np.arange(L), nnz)
    in_heavy = slot[rows] >= 0
    body = in_heavy & (idx != F - 1)
    T = sp.csr_matrix(
        (val[body], (idx[body], slot[rows[body]])), shape=(F, max(heavy.size, 1)), dtype=np.float32
    )
    hbias = np.zeros(max(heavy.size, 1), np.float32)
    tail = in_heavy & (idx == F - 1)
    hbias[slot[rows[tail]]] = val[tail]
    return RankerArrays(
        ptr,
        idx,
        val,
        T.indptr.astype(np.int64),
        T.indices.astype(np.int32),
        T.data.astype(np.float32),
        slot,
        hbias,
        F - 1,
    )


def _with_candidates(rows, labels, s, rows_e, labels_e, L: int):
    """Candidates (grouped by row, ascending labels) joined by (rows_e, labels_e) that are not
    among them yet, with base similarity NAME_ONLY_S; same grouping."""
    keys = rows * L + labels
    ekeys = rows_e * L + labels_e
    new = ekeys[~np.isin(ekeys, keys, assume_unique=True)]
    if not new.size:
        return rows, labels, s
    keys = np.concatenate([keys, new])
    s = np.concatenate([s, np.full(new.size, NAME_ONLY_S, np.float32)])
    order = np.argsort(keys, kind="stable")
    rows, labels = np.divmod(keys[order], L)
    return rows, labels, s[order]


def _row_slots(rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """(column of each candidate in its row, widest row) for candidates grouped by row: the
    padded [n, width] layout the batch scoring and top-k work on."""
    counts = np.bincount(rows, minlength=n)
    col = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return col, int(counts.max(initial=0))


def _topk(rows: np.ndarray, labels: np.ndarray, y: np.ndarray, n: int, k: int):
    """(ids int64 [n,k], scores float32 [n,k]) best first, ties by lower label, pads -1 / 0.

    Candidates come grouped by row with ascending labels, so a stable sort of each row's padded
    scores breaks ties by the lower label without a global lexsort.
    """
    ids = np.full((n, k), -1, np.int64)
    scores = np.zeros((n, k), np.float32)
    if labels.size == 0 or k == 0:
        return ids, scores
    col, width = _row_slots(rows, n)
    Y = np.full((n, width), -np.inf, np.float32)
    Lab = np.full((n, width), -1, np.int64)
    Y[rows, col], Lab[rows, col] = y, labels
    order = np.argsort(-Y, axis=1, kind="stable")[:, :k]
    top_y = np.take_along_axis(Y, order, axis=1)
    top_l = np.take_along_axis(Lab, order, axis=1)
    m = min(k, width)
    real = np.isfinite(top_y)
    ids[:, :m] = np.where(real, top_l, -1)
    scores[:, :m] = np.where(real, top_y, 0)
    return ids, scores


class Predictor:
    """Exported Astec model for CPU serving. Build with `Predictor.load(dir, threads=1)`."""

    def __init__(
        self,
        *,
        root: Path,
        manifest: Manifest,
        config: dict,
        vectorizer: TfidfVectorizer,
        learners: list[ServingLearner],
        label_names: list[str],
        threads: int,
        backend: str,
        ranker_vectorizer: TfidfVectorizer | None = None,
    ):
        self.root = root
        self.ranker_vectorizer = ranker_vectorizer
        self.manifest = manifest
        self.config = config
        self.vectorizer = vectorizer
        self.learners = learners
        self.label_names = label_names
        self.threads = threads
        self.backend = backend
        self._local = threading.local()  # per-thread fixed arguments of the single-title calls
        self.version: str = str(manifest.data.get("version", ""))
        self.num_labels = int(config["num_labels"])
        self.dim = int(config["dim"])
        self.ensemble = str(config.get("ensemble", "mean"))  # how learners join: mean or max
        # label-name match (engine/label_text.py), rebuilt from the names; none at weight 0
        self.label_text_weight = float(config.get("label_text_weight", 0.0))
        self.label_text_min_match = float(config.get("label_text_min_match", 0.0))
        self.label_text = LabelText(self.label_names) if self.label_text_weight > 0 else None
        # the single-title path splits a title once for both vectorizers and the name match
        self.title_words = (
            TitleWords.build(vectorizer, ranker_vectorizer, self.label_text)
            if all(TitleWords.covers(v) for v in (vectorizer, ranker_vectorizer) if v)
            else None
        )
        self._fused = self._fused_constants()

    # ---- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        threads: int = 1,
        backend: str | None = None,
        check_hashes: bool = True,
    ) -> Predictor:
        """Verify every file against manifest.json, then load; raise ManifestError/PredictorError.

        threads: onnxruntime threads per call (1 by default: consumers scale by processes;
        the graph searches run on the calling thread). backend: "numpy" (default, fastest per
        `astec bench predict`) or "onnx" for the feature networks.
        """
        root = Path(path)
        m = verify_manifest(root, check_hashes=check_hashes)  # nothing is read before this passes
        cfg = m.load_json(CONFIG_NAME)
        src = root / CONFIG_NAME
        for key in ("num_labels", "dim", "learners", "vectorizer", "label_names"):
            if key not in cfg:
                raise PredictorError(f"{src}: missing field {key!r}")
        if cfg.get("ensemble", "mean") not in ("mean", "max"):
            raise PredictorError(
                f"{src}: field 'ensemble' is {cfg['ensemble']!r}, expected 'mean' or 'max'"
            )
        for key, hi, want in (
            ("label_text_weight", 1e3, "a number >= 0"),
            ("label_text_min_match", 1.0, "a number in [0, 1]"),
        ):
            x = cfg.get(key, 0.0)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= hi:
                raise PredictorError(f"{src}: field {key!r} is {x!r}, expected {want}")
        backend = backend or cfg.get("backend", "numpy")
        if backend not in ("numpy", "onnx"):
            raise PredictorError(f"backend must be 'numpy' or 'onnx', got {backend!r}")
        L, D = int(cfg["num_labels"]), int(cfg["dim"])
        vectorizer = _load_vectorizer(m, cfg["vectorizer"])
        rvec = (
            _load_vectorizer(m, cfg["ranker_vectorizer"]) if cfg.get("ranker_vectorizer") else None
        )
        names = m.load_json(cfg["label_names"])
        if not isinstance(names, list) or len(names) != L:
            raise PredictorError(
                f"{root / cfg['label_names']}: expected a list of {L} label "
                f"names, got {type(names).__name__} of {len(names)}"
            )
        learners = [
            cls._load_learner(
                m,
                lc,
                L,
                D,
                vectorizer.num_features,
                threads,
                f"{src}: learners[{i}]",
                (rvec or vectorizer).num_features + 1,
            )
            for i, lc in enumerate(cfg["learners"])
        ]
        if any(lr.sparse is not None for lr in learners) and rvec is None:
            raise PredictorError(
                f"{src}: a learner has a sparse ranker but field 'ranker_vectorizer' is missing"
            )
        if not learners:
            raise PredictorError(f"{src}: field 'learners' is empty")
        pred = cls(
            root=root,
            manifest=m,
            config=cfg,
            vectorizer=vectorizer,
            learners=learners,
            label_names=[str(x) for x in names],
            threads=int(threads),
            backend=backend,
            ranker_vectorizer=rvec,
        )
        pred.warm()
        return pred

    def warm(self) -> None:
        """Compile (or load from numba's cache) every kernel both paths use, before the first
        real text: on a fresh checkout a kernel compiled on first use stalls the stream for
        seconds. Label names are texts the model knows (shortlists, name
        candidates); a batch of SMALL_BATCH takes the batch path."""
        names = [n for n in self.label_names[: 4 * SMALL_BATCH] if n.strip()] or ["a"]
        texts = (names * SMALL_BATCH)[:SMALL_BATCH]
        self.predict_one("", 1)
        self.predict_one(texts[0], 1)
        self._run(texts, 1, want_z=True)

    @staticmethod
    def _load_encoder(m: Manifest, ec: dict, V: int, D: int, where: str) -> ServingEncoder:
        emb = m.load_npy(ec["embeddings"])
        R = np.ascontiguousarray(m.load_npy(ec["residual"], mmap=False))
        if emb.shape[1] != D or emb.shape[0] < V or R.shape != (D, D):
            raise PredictorError(
                f"{where}: encoder shapes E{list(emb.shape)} R{list(R.shape)} "
                f"do not fit vocabulary {V} x dim {D}"
            )
        onnx = m.path(ec["onnx"]) if ec.get("onnx") else None
        return ServingEncoder(emb=emb, residual=R, onnx_path=onnx)

    @classmethod
    def _load_learner(
        cls,
        m: Manifest,
        lc: dict,
        L: int,
        D: int,
        V: int,
        threads: int,
        where: str,
        ranker_features: int = 0,
    ) -> ServingLearner:
        try:
            enc = cls._load_encoder(m, lc["encoder"], V, D, where + ".encoder")
            W = m.load_npy(lc["classifier"]["weight"])
            b = np.ascontiguousarray(
                m.load_npy(lc["classifier"]["bias"], mmap=False), dtype=np.float32
            )
            if W.shape != (L, D) or b.shape != (L,):
                raise PredictorError(
                    f"{where}.classifier: W{list(W.shape)} b{list(b.shape)}, "
                    f"expected [{L}, {D}] and [{L}]"
                )
            sc = lc["shortlist"]
            indptr = np.ascontiguousarray(m.load_npy(sc["point_indptr"], mmap=False), np.int64)
            plabels = np.ascontiguousarray(m.load_npy(sc["point_labels"], mmap=False), np.int64)
            pvals = np.ascontiguousarray(m.load_npy(sc["point_values"], mmap=False), np.float32)
            owner = np.ascontiguousarray(m.load_npy(sc["centre_owner"], mmap=False), np.int64)
            prior = np.ascontiguousarray(m.load_npy(sc["prior"], mmap=False), np.int64)
            prior_score = np.ascontiguousarray(
                m.load_npy(sc["prior_score"], mmap=False), np.float32
            )
            if prior_score.shape != prior.shape:
                raise PredictorError(
                    f"{where}.shortlist: prior_score{list(prior_score.shape)} "
                    f"does not match prior{list(prior.shape)}"
                )
            n_points, n_centres = int(sc["num_points"]), int(sc["num_centres"])
            if (
                indptr.shape != (n_points + 1,)
                or plabels.shape != pvals.shape
                or int(indptr[-1]) != plabels.size
                or owner.shape != (n_centres,)
            ):
                raise PredictorError(
                    f"{where}.shortlist: point label arrays do not match "
                    f"num_points={n_points} / num_centres={n_centres}"
                )
            for arr, what in ((plabels, "point_labels"), (owner, "centre_owner"), (prior, "prior")):
                if arr.size and (arr.min() < 0 or arr.max() >= L):
                    raise PredictorError(f"{where}.shortlist.{what}: label id out of [0, {L})")
            points = (
                _load_ann(
                    m, sc["points_index"], D, n_points, n_points, where + ".shortlist.points_index"
                )
                if n_points
                else None
            )
            centres = (
                _load_ann(
                    m,
                    sc["centres_index"],
                    D,
                    n_centres,
                    n_centres,
                    where + ".shortlist.centres_index",
                )
                if n_centres
                else None
            )
            rr_enc = rr_W = rr_b = None
            if lc.get("reranker"):
                rc = lc["reranker"]
                rr_enc = cls._load_encoder(m, rc, V, D, where + ".reranker")
                rr_W = m.load_npy(rc["weight"])
                rr_b = np.ascontiguousarray(m.load_npy(rc["bias"], mmap=False), np.float32)
                if rr_W.shape != (L, D) or rr_b.shape != (L,):
                    raise PredictorError(
                        f"{where}.reranker: W{list(rr_W.shape)} "
                        f"b{list(rr_b.shape)}, expected [{L}, {D}] and [{L}]"
                    )
            sparse, gamma = None, 1.0
            if lc.get("sparse_ranker"):
                sc_ = lc["sparse_ranker"]
                sptr = np.ascontiguousarray(m.load_npy(sc_["indptr"], mmap=False), np.int64)
                sidx = np.ascontiguousarray(m.load_npy(sc_["indices"], mmap=False), np.int64)
                sval = np.ascontiguousarray(m.load_npy(sc_["values"], mmap=False), np.float32)
                F = int(sc_["num_features"])
                if (
                    ranker_features != F
                    or sptr.shape != (L + 1,)
                    or sidx.shape != sval.shape
                    or int(sptr[-1]) != sidx.size
                    or (sidx.size and (sidx.min() < 0 or sidx.max() >= F))
                ):
                    raise PredictorError(
                        f"{where}.sparse_ranker: weights do not fit {L} labels x "
                        f"{ranker_features} ranker features"
                    )
                sparse = _split_ranker(sptr, sidx, sval, L, F)
                gamma = float(sc_["gamma"])
            return ServingLearner(
                enc=enc,
                W=W,
                b=b,
                sparse=sparse,
                gamma=gamma,
                points=points,
                point_indptr=indptr,
                point_labels=plabels,
                point_values=pvals,
                centres=centres,
                centre_owner=owner,
                prior=prior,
                prior_score=prior_score,
                knn=min(int(sc["knn"]), n_points),
                kmu=min(int(sc["kmu"]), n_centres),
                centroid_weight=float(sc["centroid_weight"]),
                shortlist_size=int(sc["shortlist_size"]),
                alpha=float(lc["alpha"]),
                beta=float(lc.get("beta", 1.0)),
                rr_enc=rr_enc,
                rr_W=rr_W,
                rr_b=rr_b,
                knn_power=float(sc.get("knn_power", 1.0)),
            ).fuse()
        except KeyError as e:
            raise PredictorError(f"{where}: missing field {e.args[0]!r}") from None

    # ---- features ---------------------------------------------------------------------------
    def _bags(self, texts: list[str]):
        """Flat (row, token, weight) triples of the texts' TF-IDF vectors."""
        parts = [self.vectorizer.transform_one(t) for t in texts]
        lens = np.fromiter((p[0].size for p in parts), np.int64, len(parts))
        rows = np.repeat(np.arange(len(texts)), lens)
        if lens.sum():
            idx = np.concatenate([p[0] for p in parts]).astype(np.int64)
            val = np.concatenate([p[1] for p in parts])
        else:
            idx, val = np.zeros(0, np.int64), np.zeros(0, np.float32)
        return rows, idx, val, lens

    def _ranker_one(self, text: str):
        """The sparse ranker's (indices, values) of one text: its TF-IDF words + word pairs
        (unit length) and the bias feature, the model's ranker_features."""
        vec = self.ranker_vectorizer
        if vec is None:
            raise PredictorError(f"{self.root}: this predictor has no sparse ranker")
        idx, val = vec.transform_one(text)
        n = idx.size  # filled in place: two np.append calls cost a third of this function
        ridx, rval = np.empty(n + 1, np.int64), np.empty(n + 1, np.float32)
        ridx[:n], rval[:n] = idx, val
        ridx[n], rval[n] = vec.num_features, 1.0
        return ridx, rval

    def _ranker_rows(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR (indptr, indices, values) of the ranker features of texts."""
        parts = [self._ranker_one(t) for t in texts]
        ptr = np.zeros(len(parts) + 1, np.int64)
        ptr[1:] = np.cumsum([p[0].size for p in parts])
        return ptr, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    @staticmethod
    def _mix_sparse(
        lr: ServingLearner,
        sparse: RankerArrays,
        y,
        cptr,
        labels,
        xrows: tuple[np.ndarray, np.ndarray, np.ndarray],
    ):
        """gamma * y + (1 - gamma) * sigmoid(u_l . x) on the candidates (the model's combine)."""
        u = kernels.sparse_scores_split(cptr, labels, *xrows, *sparse)
        return lr.gamma * y + (1.0 - lr.gamma) * _sigmoid(u)

    def _padded(self, idx, val, lens):
        n, T = lens.size, max(int(lens.max(initial=0)), 1)
        ids = np.zeros((n, T), np.int64)
        w = np.zeros((n, T), np.float32)
        col = np.arange(idx.size) - np.repeat(np.cumsum(lens) - lens, lens)
        r = np.repeat(np.arange(n), lens)
        ids[r, col], w[r, col] = idx, val
        return ids, w

    def _encode(self, lr: ServingLearner, bags, n: int, reranker: bool = True):
        """(v, z, z~ or None) of one learner for n texts, by the chosen backend."""
        rows, idx, val, lens = bags
        if self.backend == "onnx" and lr.enc.onnx_path is not None:
            ids, w = self._padded(idx, val, lens)
            v, z = lr.enc.vz_onnx(ids, w, self.threads)
            zr = (
                lr.rr_enc.vz_onnx(ids, w, self.threads)[1]
                if reranker and lr.rr_enc is not None
                else None
            )
            return v, z, zr
        return lr.encode(rows, idx, val, n, reranker)

    def _run(self, texts: list[str], k: int, want_z: bool = False):
        if isinstance(texts, str):
            raise TypeError("predict takes a list of texts; use predict_one(text) for one")
        n = len(texts)
        if 0 < n < SMALL_BATCH and self.backend == "numpy":
            # a consumer below saturation polls batches of a few events: the latency path gives
            # the same answers without the batch path's fixed cost (from SMALL_BATCH on the
            # batch path is as cheap)
            outs = [self._one(t, k) for t in texts]
            ids = np.stack([o[0] for o in outs])
            scores = np.stack([o[1] for o in outs])
            return (ids, scores, np.stack([o[2] for o in outs])) if want_z else (ids, scores)
        bags = self._bags(texts)
        xrows = self._ranker_rows(texts) if self.ranker_vectorizer is not None else None
        titles = self._title_rows(texts)
        named = self._name_candidates(titles)
        all_rows, all_labels, all_y = [], [], []
        z0 = None
        for li, lr in enumerate(self.learners):
            v, z, zr = self._encode(lr, bags, n)
            rows, labels, s = lr.base_scores(v, self.threads)
            if named is not None:
                rows, labels, s = _with_candidates(rows, labels, s, *named, self.num_labels)
            y = lr.final_scores(rows, labels, s, z, zr)
            if lr.sparse is not None and xrows is not None:
                cptr = np.searchsorted(rows, np.arange(n + 1))
                y = self._mix_sparse(lr, lr.sparse, y, cptr, labels, xrows)
            all_rows.append(rows)
            all_labels.append(labels)
            all_y.append(y)
            if li == 0:
                z0 = z
        rows, labels, y = self._join_learners(all_rows, all_labels, all_y)
        lt = self.label_text
        if titles is not None and lt is not None:
            y = np.array(y, np.float32)
            kernels.add_name_match_rows(
                rows, labels, y, *titles, lt.piece, lt.weight, self.label_text_weight
            )
        ids, scores = _topk(rows, labels, y, n, k)
        return (ids, scores, z0) if want_z else (ids, scores)

    def _title_rows(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """CSR (indptr, ids) of the texts' label-name vocabulary ids, or None without a
        label-name match."""
        if self.label_text is None:
            return None
        parts = [self.label_text.title_ids(t) for t in texts]
        ptr = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([p.size for p in parts], out=ptr[1:])
        return ptr, (np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def _name_candidates(
        self, titles: tuple[np.ndarray, np.ndarray] | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(rows, labels) of the labels whose names the texts (`_title_rows`) match at least
        label_text_min_match (they join every learner's shortlist), or None."""
        lt = self.label_text
        if titles is None or lt is None or self.label_text_min_match <= 0:
            return None
        return kernels.name_candidates_rows(
            *titles,
            *lt._index(self.label_text_min_match),
            lt.piece,
            lt.weight,
            self.label_text_min_match,
        )

    def _join_learners(self, rows_l, labels_l, y_l):
        """An ensemble's scores over the union of its learners' candidates (self.ensemble)."""
        if len(rows_l) == 1:
            return rows_l[0], labels_l[0], y_l[0]
        L = self.num_labels
        keys = np.concatenate([r * L + c for r, c in zip(rows_l, labels_l, strict=True)])
        uniq, inv = np.unique(keys, return_inverse=True)
        if self.ensemble == "max":  # a label missing from a learner's candidates counts 0 there
            y = np.zeros(uniq.size, np.float32)
            np.maximum.at(y, inv, np.concatenate(y_l).astype(np.float32))
        else:
            y = (
                np.bincount(inv, weights=np.concatenate(y_l), minlength=uniq.size) / len(rows_l)
            ).astype(np.float32)
        rows, labels = np.divmod(uniq, L)
        return rows, labels, y

    # ---- public API ---------------------------------------------------------------------------
    def predict(self, texts: list[str], k: int = TOP_K):
        """Top-k labels of each text: (ids int64 [n, k], scores float32 [n, k]), best first."""
        return self._run(list(texts), int(k))

    def predict_one(self, text: str, k: int = TOP_K):
        """One text -> (ids int64 [k], scores float32 [k]): the latency path (no batching work).

        Same results as predict([text], k)[0] (scores to float32 rounding); runs the compiled
        kernels whatever `backend` says (onnxruntime's per-call overhead alone exceeds their
        whole feature cost for one row).
        """
        return self._one(text, int(k))[:2]

    def _one(self, text: str, k: int):
        """(ids [k], scores [k], z [D] of the first learner) of one text."""
        if self._fused is not None:
            return self._one_fused(text, k, *self._fused)
        idx, val, ridx, rval, tids = self._title_features(text)
        lt, extra = self.label_text, None
        if lt is not None and self.label_text_min_match > 0:
            extra = kernels.name_candidates(
                tids,
                *lt._index(self.label_text_min_match),
                lt.piece,
                lt.weight,
                self.label_text_min_match,
            )
        parts = [lr.score_one(idx, val, self.threads, extra) for lr in self.learners]
        if ridx is not None:
            for lr, (c, y, _) in zip(self.learners, parts, strict=True):
                if lr.sparse is not None:
                    sa = lr.sparse
                    kernels.sparse_mix_dense(
                        c, y, ridx, rval, lr.ranker_scratch(), *sa, float(lr.gamma)
                    )
        if len(parts) == 1:
            c, y = parts[0][0], parts[0][1]
        else:  # the batch path's ensemble join, every candidate in row 0 (labels ascending)
            _, c, y = self._join_learners(
                [np.zeros(p[0].size, np.int64) for p in parts],
                [p[0] for p in parts],
                [p[1] for p in parts],
            )
        if lt is not None:
            kernels.add_name_match(c, y, tids, lt.piece, lt.weight, self.label_text_weight)
        ids, scores = kernels.top_k(c, y, k)
        return ids, scores, parts[0][2]

    def _fused_constants(self):
        """(the word splitter, the model's arrays among the arguments of kernels.title_front
        and of title_back), or None where the single-title path goes stage by stage: an
        ensemble, float16 classifier rows, or vectorizers with character n-grams. Scalars
        (search sizes, weights) are read at each call, so changing them after load counts."""
        tw, lt = self.title_words, self.label_text
        if tw is None or len(self.learners) != 1 or self.learners[0].Wc.dtype != np.float32:
            return None
        lr = self.learners[0]
        has_rr = lr.rr_enc is not None
        rt = tw.ranker if lr.sparse is not None and tw.ranker is not None else None
        rbias = self.ranker_vectorizer.num_features if rt and self.ranker_vectorizer else -1
        rt = rt or tw.vec  # unread when rbias < 0
        piece = lt.piece if lt is not None else np.full((1, 1, 2), -1, np.int64)
        weight = lt.weight if lt is not None else np.zeros((1, 1, 2), np.float32)
        front = (
            *(tw.vec.unigram, tw.vec.pair_keys, tw.vec.pair_ids, tw.vec.idf, tw.vec.sublinear),
            *(lr.E, lr.dim, lr._RT, lr._RrT, has_rr),
            *(rt.unigram, rt.pair_keys, rt.pair_ids, rt.idf, rt.sublinear, rbias),
            tw.name_ids if tw.name_ids is not None and lt is not None else _NO_IDS[0],
            *(piece, weight),
        )
        sa = lr.sparse if lr.sparse is not None else _NO_RANKER
        back = (
            *(lr.point_indptr, lr.point_labels, lr.point_values, lr.centre_owner),
            *(lr.prior, lr.prior_score, NAME_ONLY_S, lr.Wc, lr.bc, lr.dim, has_rr, *sa),
            *(piece, weight),
        )
        return tw.word_ids, front, back

    def _plan(self) -> tuple:
        """This thread's fixed arguments of the single-title calls, built on its first title:
        each graph's arrays, scratch and duplicates' map (None: no graph), and the scoring
        scratch. Python work between the compiled calls runs on caches the kernels just
        evicted, so each attribute walk and tuple saved per title counts (keeping these saved
        ~3% of a title's CPU time)."""
        plan = getattr(self._local, "plan", None)
        if plan is None:
            lr = self.learners[0]
            acc, mu = lr._scratch()
            xd = lr.ranker_scratch() if lr.sparse is not None else _NO_SIMS[0]
            plan = (*_plan_graph(lr.points), *_plan_graph(lr.centres), acc, mu, xd)
            self._local.plan = plan
        return plan

    def _one_fused(self, text: str, k: int, word_ids, front: tuple, back: tuple):
        """_one for one learner with float32 rows: two compiled calls around the two graph
        searches (same arithmetic as the stage-by-stage path)."""
        lr, lt = self.learners[0], self.label_text
        gpts, gp, gcen, gc, acc, mu, xd = self._plan()
        theta = self.label_text_min_match if lt is not None else 0.0
        nptr, nlab = lt._index(theta) if lt is not None and theta > 0 else (_NO_MEMBERS, _NO_IDS[0])
        q, z, zr, ridx, rval, tids, extra = kernels.title_front(
            word_ids(text), float(theta), nptr, nlab, *front
        )
        none = (_NO_IDS[0], _NO_SIMS[0])
        pts, cen = lr.points, lr.centres
        if lr.knn <= 0 or pts is None:
            pid, psim = none
        elif gpts is not None:  # pts.query_one without its per-call argument building
            pid, psim = kernels.graph_hits(q[0], min(lr.knn, pts.count), gpts.ef, *gp)
        else:
            pid, psim = pts.query_one(q, lr.knn, self.threads)
        if lr.kmu <= 0 or cen is None:
            cid, csim = none
        elif gcen is not None:
            cid, csim = kernels.graph_hits(q[0], min(lr.kmu, cen.count), gcen.ef, *gc)
        else:
            cid, csim = cen.query_one(q, lr.kmu, self.threads)
        if not ridx.size:
            xd = _NO_SIMS[0]
        scalars = (
            *(float(lr.centroid_weight), float(lr.knn_power), int(lr.shortlist_size)),
            *(float(lr.alpha), float(lr.beta), float(lr.gamma)),
            self.label_text_weight if lt is not None else 0.0,
        )
        loc = self._local
        if getattr(loc, "scalars", None) != scalars:  # the tail of title_back's arguments
            loc.scalars, loc.tail = scalars, (*scalars, *back)
        try:
            ids, scores, _ = kernels.title_back(
                pid, psim, cid, csim, acc, mu, xd, z, zr, ridx, rval, tids, extra, k, *loc.tail
            )
        except BaseException:  # never leave a dirty scratch behind for the next text
            acc[:] = 0
            mu[:] = 0
            xd[:] = 0
            raise
        return ids, scores, z

    def _title_features(self, text: str):
        """(idx, val) of the vectorizer, (idx, val) of the ranker's (None, None without one) and
        the label-name ids (None without the match) of one text, from one split of the text
        where the vectorizers allow it (engine/title_words.py)."""
        tw, lt = self.title_words, self.label_text
        if tw is None:
            idx, val = self.vectorizer.transform_one(text)
            rvec = self.ranker_vectorizer
            ridx, rval = self._ranker_one(text) if rvec is not None else (None, None)
            return idx, val, ridx, rval, lt.title_ids(text) if lt is not None else None
        wids = tw.word_ids(text)
        idx, val = _tfidf(wids, tw.vec, -1)
        ridx = rval = tids = None
        if tw.ranker is not None and self.ranker_vectorizer is not None:
            ridx, rval = _tfidf(wids, tw.ranker, self.ranker_vectorizer.num_features)
        if tw.name_ids is not None:
            tids = kernels.title_name_ids(wids, tw.name_ids)
        return idx, val, ridx, rval, tids

    def predict_with_features(self, texts: list[str], k: int = TOP_K):
        """(ids, scores, z) with z the first learner's final features float32 [n, D]."""
        return self._run(list(texts), int(k), want_z=True)

    def has_evidence(self, texts: list[str]) -> np.ndarray:
        """Whether each text holds anything the model knows: a word or n-gram of either
        vectorizer, or a word of a label name. A text without any gets the learners' prior,
        the same queries for every such text, which says nothing about the page: serving
        code shows no ad for it (or names a fallback) rather than that guess."""
        return known_texts(texts, self.vectorizer, self.ranker_vectorizer, self.label_text)

    def features(self, texts: list[str]) -> np.ndarray:
        """Final Astec features z (first learner) float32 [n, D], the GRU's input."""
        texts = list(texts)
        return self._encode(self.learners[0], self._bags(texts), len(texts), reranker=False)[1]

    def classifier_rows(self, ids) -> np.ndarray:
        """Classifier rows w_l (first learner, z's space) as float32 [len(ids), D]."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_labels):
            raise IndexError(f"label ids must be in [0, {self.num_labels})")
        return np.asarray(self.learners[0].W[ids], dtype=np.float32)

    def __repr__(self) -> str:
        return (
            f"Predictor({str(self.root)!r}, version={self.version!r}, L={self.num_labels}, "
            f"D={self.dim}, learners={len(self.learners)}, backend={self.backend!r})"
        )


def _tfidf(wids: np.ndarray, t: VocabTable, bias: int):
    return kernels.title_tfidf(wids, t.unigram, t.pair_keys, t.pair_ids, t.idf, t.sublinear, bias)


def _load_vectorizer(m: Manifest, rel: str) -> TfidfVectorizer:
    """A TF-IDF vectorizer whose .json and .npz the manifest lists (and verified)."""
    m.path(rel), m.path(Path(rel).with_suffix(".npz").as_posix())
    try:
        return TfidfVectorizer.load(m.root / rel)
    except (ValueError, FileNotFoundError) as e:
        raise PredictorError(str(e)) from e


def _plan_graph(ann: AnnSearch | None) -> tuple[HnswGraph | None, tuple]:
    """(the graph, _graph_args) of an index searched by graph, (None, ()) otherwise."""
    if ann is None or ann.graph is None:
        return None, ()
    return ann.graph, _graph_args(ann.graph, ann)


def _graph_args(g: HnswGraph, ann: AnnSearch) -> tuple:
    """kernels.graph_hits' arguments after (q, k, ef) for this thread: the graph's arrays, its
    scratch and the duplicates' map."""
    mi = ann.members_indptr if ann.members_indptr is not None else _NO_MEMBERS
    me = ann.members if ann.members is not None else _NO_MEMBERS
    return (*g.arrays(), *g.scratch(), mi, me)


def _load_ann(m: Manifest, ic: dict, dim: int, count: int, max_id: int, where: str) -> AnnSearch:
    """An AnnSearch from its predictor.json entry {kind, file, ef, unique, members_*}."""
    kind = ic.get("kind")
    unique = int(ic.get("unique", count))
    ann = AnnSearch(count=count)
    if ic.get("members_indptr"):
        ann.members_indptr = np.ascontiguousarray(
            m.load_npy(ic["members_indptr"], mmap=False), np.int64
        )
        ann.members = np.ascontiguousarray(m.load_npy(ic["members"], mmap=False), np.int64)
        if (
            ann.members_indptr.shape != (unique + 1,)
            or ann.members.shape != (count,)
            or int(ann.members_indptr[-1]) != count
            or (count and (ann.members.min() < 0 or ann.members.max() >= max_id))
        ):
            raise PredictorError(
                f"{where}: members arrays do not describe {unique} distinct "
                f"vectors of {count} items"
            )
    elif unique != count:
        raise PredictorError(
            f"{where}: {unique} distinct vectors of {count} items but no members arrays"
        )
    if kind == "hnsw":
        path = m.path(ic["file"])
        try:
            with huge_pages_for(str(path)):  # graph walks: far fewer TLB misses
                graph = read_graph(path, dim)
        except GraphFileError as e:
            raise PredictorError(str(e)) from None
        if graph.count != unique:
            raise PredictorError(
                f"{path}: index holds {graph.count} items, predictor.json says {unique}"
            )
        if graph.labels.max() >= unique:  # read_graph's labels are never negative
            raise PredictorError(f"{path}: item ids outside 0..{unique - 1}")
        graph.ef = max(int(ic.get("ef", 100)), 1)
        ann.graph = graph
    elif kind == "exact":
        ann.vectors = np.ascontiguousarray(m.load_npy(ic["file"], mmap=False), np.float32)
        if ann.vectors.shape != (unique, dim):
            raise PredictorError(
                f"{m.path(ic['file'])}: shape {list(ann.vectors.shape)}, expected [{unique}, {dim}]"
            )
    else:
        raise PredictorError(f"{where}: field 'kind' must be 'hnsw' or 'exact', got {kind!r}")
    return ann


def known_texts(
    texts: list[str], vectorizer, ranker_vectorizer=None, label_text=None
) -> np.ndarray:
    """Per text, whether the model knows any of it (see Predictor.has_evidence); shared by the
    exported predictor and the trained model."""
    vecs = [v for v in (vectorizer, ranker_vectorizer) if v is not None]
    return np.fromiter(
        (
            any(v.transform_one(t)[0].size for v in vecs)
            or (label_text is not None and label_text.title_ids(t).size > 0)
            for t in texts
        ),
        bool,
        len(texts),
    )
