"""The Astec model (PECOS-style API): `Astec.train`, `.predict`, `.features`, `.save`, `Astec.load`.

One model directory holds one or more learners (an ensemble: Astec-3 = 3 learners with seeds
seed + 1000 j whose final scores are joined over the union of their candidates by their mean or
maximum, chosen on the validation split) and, with label names, the label-name match added to
the joined scores. Parameters: engine/astec/config.py. Files: docs/model-format.md.
"""

from __future__ import annotations

import ctypes
import json
import math
import resource
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import scipy.sparse as sp
import torch
from tqdm import tqdm

from engine.label_text import NAME_ONLY_S, LabelText
from engine.ranking_metrics import evaluate, inv_propensity
from engine.text import TfidfVectorizer

from . import io as mio
from .ann import AnnIndex
from .clustering import balanced_clusters, label_centroids, meta_labels
from .config import TOP_K, AstecConfig, resolve_device, resolve_threads
from .network import (
    Classifier,
    Encoder,
    SpectralResidual,
    dense_bag,
    svd_embedding_init,
)
from .predict import Sigmoids, classifier_logits, combine, ensemble_scores, mix
from .shortlist import (
    Hits,
    ShortlistIndex,
    add_random_negatives,
    hard_negatives,
    label_centres,
    recall_at,
    updated_centres,
)
from .sparse import normalize_rows, topk_dense_from_csr, topk_rows
from .sparse_ranker import LabelPairs, SparseRanker, label_pairs, ranker_features
from .trainer import train_shortlisted, train_surrogate


def _set_threads(n: int) -> None:
    """torch's and numba's thread pools (the fused classifier kernels run in numba's)."""
    torch.set_num_threads(max(1, n))
    import numba

    # numba.config sets its names when it reads the environment at import: no static attribute
    cap = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    numba.set_num_threads(max(1, min(n, cap)))


def fixed_mmap_threshold(nbytes: int = 1 << 20) -> bool:
    """Keep arrays of `nbytes` or more in their own memory mappings, returned to the system on
    free. glibc raises its mmap threshold after each large free (up to 32 MB), so training's
    large transient arrays (shortlist chunks, score blocks) moved into the heap, which
    fragmented and was not given back: the sparse ranker's refit on debian-related peaked at
    1,908 MB, 1,522 MB with a fixed threshold (docs/engine-training.md). True when set (glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, int(nbytes)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _cpu_s() -> float:
    """CPU seconds of this process, all threads: on a shared machine a steadier cost than wall
    time."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)


def _spent(t0: float, c0: float) -> dict[str, float]:
    """{seconds, cpu_seconds} since wall time t0 and CPU time c0, to the millisecond (a module
    of a small data set trains in under 0.05 s)."""
    return {"seconds": round(time.time() - t0, 3), "cpu_seconds": round(_cpu_s() - c0, 3)}


def _rss_mb() -> float:
    return round(psutil.Process().memory_info().rss / 2**20, 1)


@dataclass
class Learner:
    """One Astec learner: encoder Z (E, R), classifier W, optional re-ranker, shortlist indexes."""

    encoder: Encoder
    clf: Classifier
    index: ShortlistIndex
    reranker: Encoder | None = None
    rr_clf: Classifier | None = None
    alpha: float = 0.5
    beta: float = 1.0
    search: tuple | None = None  # (knn, kmu) chosen on validation for prediction; None: cfg's
    sparse: SparseRanker | None = None
    gamma: float = 1.0

    def search_sizes(self, cfg: AstecConfig) -> tuple[int, int]:
        """(training points, label centres) a prediction searches: the validated choice, else
        the configured sizes."""
        return self.search or (cfg.shortlist.knn_neighbours, cfg.shortlist.centroid_neighbours)

    # ---- prediction pieces (numpy in, numpy out) --------------------------------------------
    def shortlist(
        self,
        X: sp.csr_matrix,
        cfg: AstecConfig,
        exclude_self=None,
        extra: sp.csr_matrix | None = None,
        centre_hits: tuple[np.ndarray, np.ndarray] | None = None,
        point_hits: tuple[np.ndarray, np.ndarray] | None = None,
        V: np.ndarray | None = None,
    ):
        """(C, Z): top candidates with base similarity s as data, and final features z; `extra`
        (label-name candidates, data NAME_ONLY_S) joins C; centre_hits, point_hits: see
        ShortlistIndex.scores; V: X's v when the caller has it."""
        if V is None:
            V = dense_bag(self.encoder, X)
        with torch.no_grad():
            self.encoder.eval()
            Z = self.encoder.residual(torch.from_numpy(V)).numpy()
        knn, kmu = self.search_sizes(cfg)
        S = self.index.scores(
            V,
            knn,
            kmu,
            cfg.shortlist.centroid_weight,
            cfg.training.threads,
            exclude_self=exclude_self,
            knn_power=cfg.shortlist.knn_power,
            centre_hits=centre_hits,
            point_hits=point_hits,
        )
        C = topk_rows(S, cfg.search.candidates, cfg.training.threads)
        if self.index.prior.size:  # frequent labels are always scored (covers empty texts)
            n, k = X.shape[0], self.index.prior.size
            P = sp.csr_matrix(
                (
                    np.tile(self.index.prior_score, n).astype(np.float32),
                    np.tile(self.index.prior, n),
                    np.arange(0, n * k + 1, k),
                ),
                shape=C.shape,
            )
            C = sp.csr_matrix(C.maximum(P))
        if extra is not None:
            C = sp.csr_matrix(C.maximum(extra))
            C.sort_indices()
        return C, Z

    def logits(self, X, C, Z, threads: int = 1):
        W = self.clf.weight.weight.detach().numpy()
        b = self.clf.bias.weight.detach().numpy().ravel()
        base = classifier_logits(Z, W, b, C, threads)
        rr = None
        if self.reranker is not None and self.rr_clf is not None:
            Zr = dense_bag(self.reranker, X, what="z")
            rr = classifier_logits(
                Zr,
                self.rr_clf.weight.weight.detach().numpy(),
                self.rr_clf.bias.weight.detach().numpy().ravel(),
                C,
                threads,
            )
        return base, rr

    def sparse_scores(
        self, Xr: sp.csr_matrix | None, C: sp.csr_matrix, threads: int = 1
    ) -> np.ndarray | None:
        """The sparse ranker's u_l . x on C's entries (None without a ranker)."""
        if self.sparse is None:
            return None
        if Xr is None:
            raise ValueError(
                "this learner has a sparse ranker: pass its features (Astec.ranker_features)"
            )
        return self.sparse.scores(Xr, C, threads)

    def scores(
        self,
        X: sp.csr_matrix,
        cfg: AstecConfig,
        Xr: sp.csr_matrix | None = None,
        extra: sp.csr_matrix | None = None,
    ) -> sp.csr_matrix:
        C, Z = self.shortlist(X, cfg, extra=extra)
        threads = resolve_threads(cfg.training.threads)
        base, rr = self.logits(X, C, Z, threads)
        us = self.sparse_scores(Xr, C, threads)
        return combine(C, base, self.alpha, rr, self.beta, us, self.gamma)


def _build_index(
    encoder: Encoder,
    X: sp.csr_matrix,
    Y: sp.csr_matrix,
    cfg: AstecConfig,
    seed: int,
    V: np.ndarray | None = None,
    serving: bool = False,
    centres_owner: tuple[np.ndarray, np.ndarray] | None = None,
    same_points: ShortlistIndex | None = None,
    points: AnnIndex | None = None,
    centres: AnnIndex | None = None,
) -> ShortlistIndex:
    """Shortlist indexes over X's v. serving=True: the graphs prediction searches, of degree
    `predict_graph_m` and ef = k (hnswlib searches with max(ef, k)): fewer links per node than
    the training-time graphs, so fewer vectors pulled through the cache per query, at the small
    k of prediction. V, centres_owner: X's v and label_centres of (V, Y) when already known.
    same_points: an index over the same V built with the other `serving` setting, whose points
    graph is shared when both settings build the same graph (same degree and efC; the search's
    ef is set per query). points: ANNS^x over V already built for this setting; centres: ANNS^mu
    already built for this setting over centres_owner's centres (which must be given)."""
    if V is None:
        V = dense_bag(encoder, X)
    Mx, cx, ex = cfg.shortlist.hnsw_x
    Mm, cm, em = cfg.shortlist.hnsw_mu
    same_graph = _serving_graph_is_training_graph(cfg)
    if serving and cfg.search.graph_m > 0:
        Mx, Mm, ex, em = cfg.search.graph_m, cfg.search.graph_m, 1, 1
    if points is not None:
        points = replace(points, ef_search=ex)
    elif same_points is not None and same_graph and same_points.points.count == V.shape[0]:
        points = replace(same_points.points, ef_search=ex)
    else:
        points = AnnIndex.build(
            V, cfg.shortlist.exact_max_points, Mx, cx, ex, cfg.training.threads, seed
        )
    cents, owner = centres_owner or label_centres(
        V, Y, cfg.shortlist.head_centres, cfg.shortlist.head_min_points, seed
    )
    exact_centres = cfg.shortlist.exact_max_points
    if not serving:
        exact_centres = max(exact_centres, cfg.shortlist.exact_max_centres)
    if centres is None:
        centres = AnnIndex.build(
            cents,
            exact_centres,
            Mm,
            cm,
            em,
            cfg.training.threads,
            seed,
            precision="float32" if serving else cfg.training.precision,
        )
    elif centres.count != owner.size:
        raise ValueError(f"_build_index: {centres.count} centres indexed, {owner.size} owners")
    counts = np.diff(sp.csc_matrix(Y).indptr)
    prior = np.argsort(-counts, kind="stable")[: cfg.shortlist.prior_labels]
    prior = prior[counts[prior] > 0].astype(np.int64)
    return ShortlistIndex(
        points,
        sp.csr_matrix(Y, dtype=np.float32),
        centres,
        owner,
        Y.shape[1],
        prior,
        _prior_score(counts[prior]),
    )


def _serving_graph_is_training_graph(cfg: AstecConfig) -> bool:
    """Both settings build ANNS^x at efC `hnsw_x[1]`: the graphs are the same when the degrees
    are."""
    return cfg.search.graph_m in (0, cfg.shortlist.hnsw_x[0])


def _final_index(
    encoder: Encoder,
    X: sp.csr_matrix,
    Y: sp.csr_matrix,
    fit: np.ndarray,
    valid: np.ndarray,
    cfg: AstecConfig,
    seed: int,
    fit_index: ShortlistIndex,
    fit_serving: tuple[ShortlistIndex, np.ndarray] | None = None,
) -> ShortlistIndex:
    """The serving indexes over every training point, the fit points first, then the validation
    points (index ids: positions in concat(fit, valid)). When fit_index's ANNS^x is a graph of
    the serving degree over the fit points, the validation points are inserted into it (takes it
    over) instead of a new graph being built over all points: the simulated click log's
    68,772-point build was ~7 s. fit_serving: the serving indexes over the fit points (the
    search's choice) and their label centres' vectors; when its ANNS^mu is a graph, the
    final one is that graph over `updated_centres` (links kept, vectors rewritten, the labels
    first seen in the validation split inserted) instead of a build: at L = 500k one build of
    the 248,800 centres' graph took 168.6 s on 2 AVX2 cores, 4.2 s on the click log."""
    order = np.concatenate([fit, valid])
    Xo, Yo = X[order], Y[order]
    V = dense_bag(encoder, Xo)
    old = fit_index.points
    grow = (
        old.kind == "hnsw"
        and old.count == len(fit)
        and _serving_graph_is_training_graph(cfg)
        and len(valid) > 0
    )
    threads = cfg.training.threads
    points = old.grown(V[len(fit) :], threads) if grow else None
    centres = centres_owner = None
    if fit_serving is not None and fit_serving[0].centres.kind == "hnsw":
        served, cents = fit_serving
        owner, graph = served.centre_owner, served.centres
        vectors, new, new_owner = updated_centres(V, Yo, cents, owner)
        centres = graph.with_vectors(vectors, threads)
        if new.shape[0]:
            centres = centres.grown(new, threads)
        centres_owner = (np.concatenate([vectors, new]), np.concatenate([owner, new_owner]))
    return _build_index(
        encoder,
        Xo,
        Yo,
        cfg,
        seed,
        V,
        serving=True,
        points=points,
        centres_owner=centres_owner,
        centres=centres,
    )


def _prior_score(counts: np.ndarray) -> np.ndarray:
    """1e-3 * relative frequency: orders the always-scored labels without outweighing
    similarities."""
    return (1e-3 * counts / max(float(counts.max(initial=1)), 1.0)).astype(np.float32)


def _valid_metrics(S: sp.csr_matrix, Yv, inv_prop, metrics) -> tuple[float, dict]:
    """(the validation objective: the mean of `metrics`, every metric at k = 1, 3, 5) of the
    scores S of the validation points: what every choice made on validation compares."""
    m = evaluate(Yv, topk_dense_from_csr(S, 5), inv_prop, ks=(1, 3, 5))
    return float(np.mean([m[k] for k in metrics])), m


def _select(name, grid, make_scores, Yv, inv_prop, metrics, log):
    """Pick the grid value maximising the mean of `metrics` on the validation split."""
    best, best_val, table = grid[0], -1.0, []
    for g in grid:
        val, m = _valid_metrics(make_scores(g), Yv, inv_prop, metrics)
        table.append({name: g, "objective": round(val, 3), **{k: round(m[k], 2) for k in metrics}})
        if val > best_val:
            best, best_val = g, val
    log[f"{name}_selection"] = table
    return best


def _combination_weight(
    name, fixed, grid, make_scores, Yv, inv_prop, cfg: AstecConfig, log: dict, default: float
) -> float:
    """One weight of the score combination (alpha, beta or gamma): `fixed` when configured
    (>= 0), else the grid value best on the validation split (`default` without one). With a
    validation split, logs its metrics at the chosen weight under "valid"; logs the weight."""
    if Yv.shape[0]:
        w = (
            fixed
            if fixed >= 0
            else _select(name, grid, make_scores, Yv, inv_prop, cfg.validation.metrics, log)
        )
        _, m = _valid_metrics(make_scores(w), Yv, inv_prop, cfg.validation.metrics)
        log["valid"] = {k: round(v, 2) for k, v in m.items()}
    else:
        w = fixed if fixed >= 0 else default
    log[name] = w
    return w


def select_search(
    learner: Learner, Xv, Yv, cfg: AstecConfig, inv_prop, log: dict, Xrv=None
) -> tuple[tuple | None, sp.csr_matrix]:
    """The cheapest prediction search (knn, kmu) = the configured one scaled by each of
    `search_fractions`, whose validation objective (mean of `select_metrics`) is within
    `search_tolerance` points of the full search's. Searching fewer neighbours is the bulk of a
    single prediction's cost; whether it costs accuracy depends on the data, hence validation.
    Returns (the choice, None when the full search is needed or the cheaper ones do not differ
    from it; the validation scores with that choice, `learner.scores(Xv, cfg, Xrv)`)."""
    full = (cfg.shortlist.knn_neighbours, cfg.shortlist.centroid_neighbours)
    table, objective, scores = [], {}, {}
    for f in sorted(set(cfg.search.fractions) | {1.0}):
        cand = (max(1, math.ceil(full[0] * f)), max(1, math.ceil(full[1] * f)))
        if cand in objective:
            continue
        learner.search = cand
        scores[cand] = learner.scores(Xv, cfg, Xrv)
        objective[cand], m = _valid_metrics(scores[cand], Yv, inv_prop, cfg.validation.metrics)
        table.append(
            {
                "knn": cand[0],
                "kmu": cand[1],
                "objective": round(objective[cand], 3),
                **{k: round(m[k], 2) for k in cfg.validation.metrics},
            }
        )
    learner.search = None
    ok = [c for c in objective if objective[c] >= objective[full] - cfg.search.tolerance]
    best = min(ok, key=lambda c: (c[0] + c[1], c))
    log["search_selection"] = {"table": table, "chosen": list(best)}
    return (None if best == full else best), scores[best]


def name_candidates(
    lt: LabelText, texts: list[str], min_match: float, L: int
) -> sp.csr_matrix | None:
    """[n, L] pattern of the labels whose name each text matches at least min_match (data
    NAME_ONLY_S), or None when min_match is 0."""
    if min_match <= 0:
        return None
    rows, labels = lt.candidates([lt.title_ids(t) for t in texts], min_match)
    return sp.csr_matrix(
        (np.full(rows.size, NAME_ONLY_S, np.float32), (rows, labels)), shape=(len(texts), L)
    )


def _raw_texts(texts) -> list[str] | None:
    """texts as a list of strings (one str: one text), or None for a feature matrix."""
    if sp.issparse(texts):
        return None
    return [texts] if isinstance(texts, str) else list(texts)


def add_label_text(
    S: sp.csr_matrix, lt: LabelText, texts: list[str], weight: float
) -> sp.csr_matrix:
    """S + weight * label-name match on S's pattern (texts: S's rows)."""
    S = sp.csr_matrix(S)
    rows = np.repeat(np.arange(S.shape[0]), np.diff(S.indptr))
    y = lt.add_to(texts, rows, S.indices, S.data.astype(np.float32), weight)
    return sp.csr_matrix((y, S.indices, S.indptr), shape=S.shape)


def _label_text_weight(
    lt: LabelText, texts_v: list[str], Sv, Yv, inv_prop, cfg: AstecConfig, log: dict, progress: bool
) -> float:
    """The label-name match's weight: configured (>= 0) or the grid value best on the validation
    split, scored on the final (joined) scores the learners gave before the validation points
    joined their indexes: Sv = (without, with the label-name candidates or None); a weight > 0
    brings the candidates. Without a validation split (tiny data) a configured weight or 0."""
    tlog: dict = {}
    if Sv is None:
        w = max(cfg.name_match.weight, 0.0)
        tlog["label_text_weight"] = w
    else:
        plain, named = Sv[0], Sv[1] if Sv[1] is not None else Sv[0]
        rows = np.repeat(np.arange(named.shape[0]), np.diff(named.indptr))
        m = lt.scores([lt.title_ids(t) for t in texts_v], rows, named.indices)

        def make(d: float) -> sp.csr_matrix:
            if d == 0:
                return plain
            data = (named.data + np.float32(d) * m).astype(np.float32)
            return sp.csr_matrix((data, named.indices, named.indptr), shape=named.shape)

        w = _combination_weight(
            "label_text_weight",
            cfg.name_match.weight,
            list(cfg.name_match.grid),
            make,
            Yv,
            inv_prop,
            cfg,
            tlog,
            0.0,
        )
    log["label_text"] = tlog
    if progress:
        tqdm.write(f"  Label names: weight={w} valid={tlog.get('valid', {})}")
    return float(w)


def _by_rows(n: int, L: int, part) -> sp.csr_matrix:
    """vstack of part(a, b) (csr [b - a, L]) over chunks of `_ROW_CHUNK` of the n rows. Training
    shortlists of every point query the indexes for hundreds of candidates per point; by chunks
    those arrays stay bounded (N = 200k: 6.4 GB in one piece). Rows are independent: the result
    is that of one call."""
    parts = [part(a, min(n, a + _ROW_CHUNK)) for a in range(0, n, _ROW_CHUNK)]
    return (
        sp.csr_matrix(sp.vstack(parts), dtype=np.float32)
        if parts
        else sp.csr_matrix((0, L), dtype=np.float32)
    )


_ROW_CHUNK = 8192


@dataclass
class FitSearches:
    """Module II's searches of the fit points, read by the shortlists after Module IV (the
    re-ranker's negatives, the sparse ranker's candidates) instead of searching again: the
    paper's premise, that Modules III/IV keep the features near Module I's so Module II's
    shortlists stay relevant; with E fixed they are the same searches. The click log: ~5 s of
    ~75, L = 500k: ~175 s (an exact label-centre search is ~0.4 ms a point there); test figures
    at a given search size as before (docs/engine-training.md). Ids held as int32 (half the
    memory)."""

    points: Hits | None = None  # ANNS^x at k = knn + 1 (each point among its own hits)
    centres: Hits | None = None  # ANNS^mu at the after-IV depth (`_after_iv_depth`)

    def rows(self, a: int, b: int) -> tuple[Hits | None, Hits | None]:
        def cut(h: Hits | None) -> Hits | None:
            return None if h is None else (h[0][a:b].astype(np.int64), h[1][a:b])

        return cut(self.points), cut(self.centres)


def _after_iv_depth(cfg: AstecConfig, rerank: bool, sparse: bool) -> int:
    """How many label centres the shortlists after Module IV read per point: the deeper of the
    re-ranker's (`centroid_neighbours`) and the sparse ranker's pool."""
    return max(
        cfg.shortlist.centroid_neighbours if rerank else 0,
        _ranker_pool(cfg).shortlist.centroid_neighbours if sparse else 0,
    )


def _module2_negatives(
    index: ShortlistIndex,
    V: np.ndarray,
    Y: sp.csr_matrix,
    cfg: AstecConfig,
    seed: int,
    keep: int = 0,
) -> tuple[sp.csr_matrix, FitSearches | None]:
    """Module II's shortlist for each indexed point (V: the index's own points, in order): its
    hard negatives from both indexes, itself excluded, plus random negatives. keep > 0: also
    the searches (FitSearches), the label centres' at depth max(centroid_neighbours, keep) (an
    exact search's first columns are its top ones; an HNSW search at a larger ef is as good or
    better)."""
    knn, kmu = cfg.shortlist.knn_neighbours, cfg.shortlist.centroid_neighbours
    threads = resolve_threads(cfg.training.threads)
    points: list[Hits] = []
    centres: list[Hits] = []

    def hard(a, b):
        point_hits, centre_hits = index.searches(V[a:b], knn, max(kmu, keep), threads, True)
        if keep > 0:
            for hits, parts in ((point_hits, points), (centre_hits, centres)):
                if hits is not None:
                    parts.append((hits[0].astype(np.int32), hits[1]))
        S = index.scores(
            V[a:b],
            knn,
            kmu,
            cfg.shortlist.centroid_weight,
            cfg.training.threads,
            exclude_self=np.arange(a, b),
            knn_power=cfg.shortlist.knn_power,
            point_hits=point_hits,
            centre_hits=centre_hits,
        )
        return hard_negatives(S, Y[a:b], cfg.shortlist.negatives, cfg.training.threads)

    negatives = add_random_negatives(
        _by_rows(V.shape[0], Y.shape[1], hard), Y, cfg.shortlist.random_negatives, seed
    )
    if keep <= 0:
        return negatives, None

    def joined(parts: list[Hits]) -> Hits | None:
        if not parts:
            return None
        return np.concatenate([i for i, _ in parts]), np.concatenate([s for _, s in parts])

    return negatives, FitSearches(joined(points), joined(centres))


def _ranker_pool(cfg: AstecConfig) -> AstecConfig:
    """The shortlist settings of the sparse ranker's training candidates: `sparse.negatives`
    labels deep, from at least as many label centres."""
    pool = cfg.copy()
    pool.search.candidates = cfg.sparse.negatives
    pool.shortlist.centroid_neighbours = max(
        cfg.shortlist.centroid_neighbours, cfg.sparse.negatives
    )
    return pool


@dataclass
class AfterIv:
    """What one shortlist pass over the fit points gives the later stages: the re-ranker's
    negatives, the sparse ranker's candidates, and each point's `sparse.negatives`-th nearest
    label-centre similarity (the bar a label first seen in the validation split must clear to
    join the point's candidates in the refit, see `_refit_candidates`)."""

    hard: sp.csr_matrix | None = None
    candidates: sp.csr_matrix | None = None
    kth_centre: np.ndarray | None = None


def _after_iv_shortlists(
    learner: Learner,
    X,
    Y,
    cfg: AstecConfig,
    rerank: bool,
    sparse: bool,
    kept: FitSearches | None = None,
) -> AfterIv:
    """One pass over the indexed points (X: the index's own points, in order; each excludes
    itself) after Module IV: the re-ranker's negatives (the base model's top mispredictions,
    `rerank.negatives` deep, 0/1) and the sparse ranker's candidates, whichever are asked. The
    label-centre search runs once, at the deeper of the two k (an exact search's first kmu
    columns are its top kmu; an HNSW search's nearly): it is most of a shortlist's cost.
    kept: Module II's searches of these points (`_module2_negatives`), read instead of
    searching (ids: the same points and the same centres' owners as the learner's indexes)."""
    pool = _ranker_pool(cfg) if sparse else None
    threads = resolve_threads(cfg.training.threads)
    k_centres = _after_iv_depth(cfg, rerank, sparse)

    def chunk(a: int, b: int):
        kth = np.full(b - a, -np.inf, np.float32)
        V = dense_bag(learner.encoder, X[a:b])
        # both shortlists read the same searches (+ 1 point: each point finds itself)
        if kept is not None:
            points, hits = kept.rows(a, b)
        else:
            points, hits = learner.index.searches(
                V, cfg.shortlist.knn_neighbours, k_centres, threads, with_self=True
            )
        k_pool = pool.shortlist.centroid_neighbours if pool is not None else 0
        if hits is not None and k_pool > 0 and hits[1].shape[1] >= k_pool:
            kth = hits[1][:, k_pool - 1].copy()
        own = np.arange(a, b)
        hard = cand = None
        if rerank:
            C, Z = learner.shortlist(
                X[a:b], cfg, exclude_self=own, centre_hits=hits, point_hits=points, V=V
            )
            base, _ = learner.logits(X[a:b], C, Z, threads)
            scores = combine(C, base, learner.alpha)
            hard = hard_negatives(scores, Y[a:b], cfg.rerank.negatives, threads)
        if pool is not None:
            cand = learner.shortlist(
                X[a:b], pool, exclude_self=own, centre_hits=hits, point_hits=points, V=V
            )[0]
        return hard, cand, kth

    search, learner.search = learner.search, None  # training shortlists: the full search
    try:
        parts = [
            chunk(a, min(X.shape[0], a + _ROW_CHUNK)) for a in range(0, X.shape[0], _ROW_CHUNK)
        ]
    finally:
        learner.search = search
    hard_parts = [h for h, _, _ in parts if h is not None]
    cand_parts = [c for _, c, _ in parts if c is not None]
    return AfterIv(
        sp.csr_matrix(sp.vstack(hard_parts), dtype=np.float32) if hard_parts else None,
        sp.csr_matrix(sp.vstack(cand_parts), dtype=np.float32) if cand_parts else None,
        np.concatenate([k for _, _, k in parts]) if pool is not None and parts else None,
    )


def _ranker_shortlists(
    learner: Learner, X, rows: np.ndarray, cfg: AstecConfig, ids: np.ndarray | None = None
) -> sp.csr_matrix:
    """The sparse ranker's candidates for X[rows] from the learner's indexes (full search,
    label centres searched exactly up to `exact_max_centres`), each point excluding itself
    (ids: the points' ids in the indexes, default rows)."""
    own = rows if ids is None else ids
    pool = _ranker_pool(cfg)
    search, learner.search = learner.search, None
    index = learner.index
    if index.centres.count <= cfg.shortlist.exact_max_centres:  # see ShortlistParams
        centres = index.centres.as_exact(cfg.training.precision)
        learner.index = replace(index, centres=centres)
    try:
        return _by_rows(
            len(rows),
            learner.index.num_labels,
            lambda a, b: learner.shortlist(X[rows[a:b]], pool, exclude_self=own[a:b])[0],
        )
    finally:
        learner.search, learner.index = search, index


def _refit_candidates(
    learner: Learner,
    X,
    Y,
    fit: np.ndarray,
    valid: np.ndarray,
    first: AfterIv,
    cfg: AstecConfig,
) -> tuple[sp.csr_matrix, np.ndarray]:
    """The refit's candidates for every training point, as (C, rows): C's rows are the fit
    points' then the validation points' (rows: their ids in X; no reordering copy), learner.index
    being the final indexes over all points. The fit points keep the first fit's candidates
    (recomputing them from the final indexes cost ~35 s on debian-related and changed only
    what the validation points add) plus each label with no fit point whose centre is at least
    as near as the point's `sparse.negatives`-th nearest centre was: a label first seen in the
    validation split needs negatives too. The validation points get fresh shortlists (learner's
    indexes hold the fit points first, as `_final_index` builds them). Takes over
    `first.candidates`."""
    Cf, first.candidates = first.candidates, None
    if Cf is None or first.kth_centre is None:
        raise ValueError("_refit_candidates: the first fit's candidates were not kept")
    L = Y.shape[1]
    fit_counts = np.diff(sp.csc_matrix(Y[fit]).indptr)
    index = learner.index
    new_centres = np.flatnonzero(fit_counts[index.centre_owner] == 0)
    if new_centres.size:
        Vn = normalize_rows(dense_bag(learner.encoder, X[fit]))
        Cn = normalize_rows(index.centres.vectors_of(new_centres))
        owner = index.centre_owner[new_centres]
        kth = first.kth_centre

        def near(a: int, b: int) -> sp.csr_matrix:
            rs, cs = [], []
            for s in range(a, b, 512):  # [512, new centres] blocks bound the memory
                S = Vn[s : min(b, s + 512)] @ Cn.T
                r, c = np.nonzero(S >= kth[s : s + S.shape[0], None])
                rs.append(r + (s - a))
                cs.append(owner[c])
            r, c = np.concatenate(rs), np.concatenate(cs)
            M = sp.csr_matrix((np.ones(r.size, np.float32), (r, c)), shape=(b - a, L))
            M.sum_duplicates()
            M.data[:] = 1.0
            return M

        Cf = sp.csr_matrix(Cf.maximum(_by_rows(len(fit), L, near)))
        del near, Vn, Cn  # v of every fit point: not held through the shortlists below
    Cv = _ranker_shortlists(learner, X, valid, cfg, ids=len(fit) + np.arange(len(valid)))
    return sp.csr_matrix(sp.vstack([Cf, Cv]), dtype=np.float32), np.concatenate([fit, valid])


def _fit_ranker(
    Xr, pairs: LabelPairs, cfg: AstecConfig, seed: int, rows=None, warm=None
) -> SparseRanker:
    """The sparse ranker on Xr and its (point, label) pairs (`label_pairs` of the labels and
    candidates; see SparseRanker.fit); rows: the points' ids among all training points; warm:
    an earlier fit on some of them whose dual variables start this one (`sparse.refit_iters`
    sweeps instead of `sparse.iters`) and are taken over."""
    return SparseRanker.fit_pairs(
        Xr,
        pairs,
        cfg.sparse.cost,
        cfg.sparse.threshold,
        cfg.sparse.iters if warm is None else cfg.sparse.refit_iters,
        seed,
        threads=resolve_threads(cfg.training.threads),
        row_ids=rows,
        warm=warm,
    )


def _epoch_objective(
    encoder: Encoder, clf: Classifier, Xv, Cv: sp.csr_matrix, Yv, inv_prop, cfg: AstecConfig
):
    """The validation objective of a classifier alone on fixed validation shortlists Cv, read
    from the live (training) weights: what a training loop checks after each epoch."""
    threads = resolve_threads(cfg.training.threads)

    def objective() -> float:
        Z = dense_bag(encoder, Xv, what="z")
        W = clf.weight.weight.detach().numpy()
        b = clf.bias.weight.detach().numpy().ravel()
        S = sp.csr_matrix(
            (classifier_logits(Z, W, b, Cv, threads), Cv.indices, Cv.indptr), shape=Cv.shape
        )
        return _valid_metrics(S, Yv, inv_prop, cfg.validation.metrics)[0]

    return objective


def train_learner(
    X,
    Y,
    fit,
    valid,
    cfg: AstecConfig,
    seed: int,
    inv_prop,
    progress: bool = True,
    Xr=None,
    valid_scores: bool = False,
    valid_extra: sp.csr_matrix | None = None,
):
    """Train Modules I-IV, the re-ranker and the sparse ranker (on Xr, the ranker features; None:
    no sparse ranker) for one learner; returns (Learner, log dict, validation scores). The last is
    the learner's final scores of the validation points before they join its indexes (for an
    ensemble's and the label-name match's choices) as (scores, scores with the label-name
    candidates `valid_extra` in the shortlists or None), or None when not asked or without a
    validation split."""
    log: dict = {"seed": seed, "modules": {}}
    device = resolve_device(cfg.training.device)
    torch.manual_seed(seed)
    Xf, Yf = X[fit], Y[fit]
    Xv, Yv = X[valid], Y[valid]
    L = Y.shape[1]
    D = cfg.network.embedding_dim
    threads = resolve_threads(cfg.training.threads)

    # Module I: clusters -> surrogate task
    t0, c0 = time.time(), _cpu_s()
    sur = cfg.surrogate
    cents = label_centroids(Xf, Yf)
    assign = balanced_clusters(cents, sur.num_clusters, seed, progress)
    Ym = meta_labels(Yf, assign, sur.num_clusters)
    encoder = Encoder(X.shape[1], D, cfg.network.spectral_lambda, cfg.network.dropout)
    if cfg.network.embedding_init == "svd":
        with torch.no_grad():
            encoder.embed.weight.copy_(torch.from_numpy(svd_embedding_init(Xf, Yf, D, seed)))
    epochs_log = train_surrogate(
        encoder,
        Xf,
        Ym,
        sur.epochs,
        sur.lr,
        cfg.training.batch_size,
        seed,
        progress,
        valid=(Xv, meta_labels(Yv, assign, sur.num_clusters)),
        decay_epoch=round(sur.decay * sur.epochs),
        patience=sur.patience,
        device=device,
        precision=cfg.training.precision,
        fused=cfg.training.fused_kernels,
        sampled=sur.sampled_negatives if 0 < sur.sampled_from <= sur.num_clusters else 0,
        sampled_block=sur.sampled_block,
    )
    log["modules"]["I"] = {
        **_spent(t0, c0),
        "peak_rss_mb": _peak_rss_mb(),
        "clusters": int(sur.num_clusters),
        "epochs": epochs_log,
    }

    # Module II: frozen E -> indexes -> hard-negative shortlists
    t0, c0 = time.time(), _cpu_s()
    if progress:  # no bar inside the index builds and searches: say what runs (minutes at L=500k)
        tqdm.write(f"  Module II: indexes and hard negatives for {Xf.shape[0]} points ...")
    Vf = dense_bag(encoder, Xf)
    fit_centres = label_centres(
        Vf, Yf, cfg.shortlist.head_centres, cfg.shortlist.head_min_points, seed
    )
    index = _build_index(encoder, Xf, Yf, cfg, seed, Vf, centres_owner=fit_centres)
    # the searches of the fit points are kept for the shortlists after Module IV (FitSearches)
    rerank_on = cfg.rerank.enabled and cfg.rerank.epochs > 0
    sparse_on = Xr is not None and cfg.sparse.enabled
    depth = _after_iv_depth(cfg, rerank_on, sparse_on)
    negatives, kept = _module2_negatives(index, Vf, Yf, cfg, seed, keep=depth)
    m2: dict[str, Any] = {
        "seconds": None,
        "index_kind": index.points.kind,
        "centres": int(index.centres.count),
    }
    if Xv.shape[0]:
        Sv = index.scores(
            dense_bag(encoder, Xv),
            cfg.shortlist.knn_neighbours,
            cfg.shortlist.centroid_neighbours,
            cfg.shortlist.centroid_weight,
            cfg.training.threads,
            knn_power=cfg.shortlist.knn_power,
        )
        m2[f"valid_recall@{cfg.search.candidates}"] = round(
            recall_at(Sv, Yv, cfg.search.candidates), 2
        )
        ids, sc = topk_dense_from_csr(Sv, 5)
        m2["valid_shortlist_only"] = {
            k: round(v, 2) for k, v in evaluate(Yv, (ids, sc), inv_prop, ks=(1, 3, 5)).items()
        }
        # Module II's validation shortlists: fixed candidates for the per-epoch objective
        Cv_ii = topk_rows(Sv, cfg.search.candidates, cfg.training.threads)
        del Sv
    m2.update(_spent(t0, c0))
    m2["peak_rss_mb"] = _peak_rss_mb()
    log["modules"]["II"] = m2
    if progress:
        tqdm.write(
            "  Module II: "
            + json.dumps({k: v for k, v in m2.items() if k != "valid_shortlist_only"})
        )

    # Modules III/IV: new residual R (identity), classifier on positives + shortlist
    t0, c0 = time.time(), _cpu_s()
    encoder.residual = SpectralResidual(D, cfg.network.spectral_lambda)
    clf = Classifier(L, D)
    ep = train_shortlisted(
        encoder,
        clf,
        Xf,
        Yf,
        negatives,
        cfg.extreme.epochs,
        cfg.extreme.lr,
        cfg.training.batch_size,
        seed,
        cfg.extreme.finetune_embeddings,
        cfg.extreme.finetune_lr,
        "Module IV",
        progress,
        device,
        cfg.training.fused_kernels,
        valid=_epoch_objective(encoder, clf, Xv, Cv_ii, Yv, inv_prop, cfg) if Xv.shape[0] else None,
    )
    del negatives
    if cfg.extreme.finetune_embeddings:  # v moved: the indexes again, on the final v (the
        # serving graphs over the fit points, for the search's choice below, share v and the
        # label centres); E fixed (the paper's Module IV): Module II's indexes still hold
        Vf = dense_bag(encoder, Xf)
        fit_centres = label_centres(
            Vf, Yf, cfg.shortlist.head_centres, cfg.shortlist.head_min_points, seed
        )
        moved = index.points.with_vectors(Vf, cfg.training.threads)  # Module II's links
        index = _build_index(
            encoder, Xf, Yf, cfg, seed, Vf, centres_owner=fit_centres, points=moved
        )
    learner = Learner(encoder, clf, index)
    m4: dict[str, Any] = {"epochs": ep}
    if Xv.shape[0]:
        C, Z = learner.shortlist(Xv, cfg)
        base, _ = learner.logits(Xv, C, Z, threads)
        sig = Sigmoids.of(C, base)
    learner.alpha = _combination_weight(
        "alpha",
        cfg.combination.alpha,
        cfg.combination.alpha_grid,
        lambda a: mix(C, sig, a),
        Yv,
        inv_prop,
        cfg,
        m4,
        learner.alpha,
    )
    m4.update(_spent(t0, c0))
    m4["peak_rss_mb"] = _peak_rss_mb()
    log["modules"]["IV"] = m4
    if progress and "valid" in m4:
        tqdm.write(f"  Module IV: alpha={learner.alpha} valid={m4['valid']}")

    # Re-ranker: independent Z~, W~ on positives + the base model's top mispredictions
    after: AfterIv | None = None  # the sparse ranker's candidates come from the same pass
    if rerank_on:
        t0, c0 = time.time(), _cpu_s()
        after = _after_iv_shortlists(learner, Xf, Yf, cfg, rerank=True, sparse=sparse_on, kept=kept)
        kept = None
        hard, after.hard = after.hard, None
        rr = Encoder(X.shape[1], D, cfg.network.spectral_lambda, cfg.network.dropout)
        with torch.no_grad():
            rr.embed.weight.copy_(encoder.embed.weight)
        rr_clf = Classifier(L, D)
        with torch.no_grad():
            rr_clf.weight.weight.copy_(clf.weight.weight)
            rr_clf.bias.weight.copy_(clf.bias.weight)
        ep = train_shortlisted(
            rr,
            rr_clf,
            Xf,
            Yf,
            hard,
            cfg.rerank.epochs,
            cfg.extreme.lr,
            cfg.training.batch_size,
            seed + 1,
            True,
            cfg.extreme.finetune_lr,
            "Re-ranker",
            progress,
            device,
            cfg.training.fused_kernels,
            valid=_epoch_objective(rr, rr_clf, Xv, C, Yv, inv_prop, cfg) if Xv.shape[0] else None,
        )
        del hard
        learner.reranker, learner.rr_clf = rr, rr_clf
        mr: dict[str, Any] = {"epochs": ep}
        if Xv.shape[0]:  # C, Z: the validation shortlists of Module IV's indexes, as above
            base, rrl = learner.logits(Xv, C, Z, threads)
            sig = Sigmoids.of(C, base, rrl)
        learner.beta = _combination_weight(
            "beta",
            cfg.combination.beta,
            cfg.combination.beta_grid,
            lambda b: mix(C, sig, learner.alpha, b),
            Yv,
            inv_prop,
            cfg,
            mr,
            learner.beta,
        )
        mr.update(_spent(t0, c0))
        mr["peak_rss_mb"] = _peak_rss_mb()
        log["modules"]["reranker"] = mr
        if progress and "valid" in mr:
            tqdm.write(f"  Re-ranker: beta={learner.beta} valid={mr['valid']}")

    # sparse ranker on the fit points; gamma on the validation points
    Xrv = None
    if sparse_on:
        t0, c0 = time.time(), _cpu_s()
        if progress:
            tqdm.write(f"  Sparse ranker: shortlists and fit on {Xf.shape[0]} points ...")
        Xrv = Xr[valid]
        if after is None or after.candidates is None:
            after = _after_iv_shortlists(learner, Xf, Yf, cfg, rerank=False, sparse=True, kept=kept)
            kept = None
        assert after.candidates is not None
        pairs = label_pairs(Yf, after.candidates, threads)  # the candidates stay for the refit
        learner.sparse = _fit_ranker(Xr[fit], pairs, cfg, seed, rows=fit)
        del pairs
        ms: dict[str, Any] = {"weights": int(learner.sparse.W.nnz)}
        if Xv.shape[0]:
            base, rrl = learner.logits(Xv, C, Z, threads)
            us = learner.sparse_scores(Xrv, C, threads)
            sig = Sigmoids.of(C, base, rrl, us)
        # without a validation split (tiny data): an even mix
        learner.gamma = _combination_weight(
            "gamma",
            cfg.combination.gamma,
            cfg.combination.gamma_grid,
            lambda g: mix(C, sig, learner.alpha, learner.beta, g),
            Yv,
            inv_prop,
            cfg,
            ms,
            0.5,
        )
        ms.update(_spent(t0, c0))
        ms["peak_rss_mb"] = _peak_rss_mb()
        log["modules"]["sparse"] = ms
        if progress and "valid" in ms:
            tqdm.write(f"  Sparse ranker: gamma={learner.gamma} valid={ms['valid']}")

    # prediction: serving graphs; the search size is chosen on validation with graphs like the
    # final ones (over the fit points only, so validation points do not find themselves)
    chosen_scores: sp.csr_matrix | None = None  # the validation scores with that choice
    fit_serving = None  # the serving indexes over the fit points and their centres' vectors
    if Xv.shape[0] and cfg.search.fractions:
        learner.index = _build_index(
            encoder,
            Xf,
            Yf,
            cfg,
            seed,
            Vf,
            serving=True,
            centres_owner=fit_centres,
            same_points=index,
        )
        learner.search, chosen_scores = select_search(learner, Xv, Yv, cfg, inv_prop, log, Xrv)
        fit_serving = (learner.index, fit_centres[0])
    del Vf, fit_centres

    Sv = None
    if valid_scores and Xv.shape[0]:
        Sv = (
            chosen_scores if chosen_scores is not None else learner.scores(Xv, cfg, Xrv),
            learner.scores(Xv, cfg, Xrv, extra=valid_extra) if valid_extra is not None else None,
        )
    # final indexes over all training points (the validation points' labels help prediction)
    learner.index = _final_index(encoder, X, Y, fit, valid, cfg, seed, index, fit_serving)
    del index, fit_serving  # the training and fit-serving indexes (graphs grown into the final)
    if learner.sparse is not None and Xv.shape[0]:
        # the ranker, too, learns from every training point once gamma is chosen (else labels
        # seen only in the validation split would have no model), starting from the first
        # fit's dual variables: debian-related, 49.5 -> 39.1 CPU s
        t0, c0 = time.time(), _cpu_s()
        if progress:
            tqdm.write(f"  Sparse ranker: refit on all {X.shape[0]} points ...")
        assert after is not None
        C, rows = _refit_candidates(learner, X, Y, fit, valid, after, cfg)
        del after
        # the candidates go once grouped into pairs: the two are the refit's largest arrays
        pairs = label_pairs(Y[rows], C, threads)
        del C
        learner.sparse = _fit_ranker(Xr[rows], pairs, cfg, seed, rows=rows, warm=learner.sparse)
        del pairs
        spent = _spent(t0, c0)
        log["modules"]["sparse"]["refit_seconds"] = spent["seconds"]
        log["modules"]["sparse"]["refit_cpu_seconds"] = spent["cpu_seconds"]
        log["modules"]["sparse"]["weights"] = int(learner.sparse.W.nnz)
    if learner.sparse is not None:
        learner.sparse.dual = None  # only a refit needs it: free it before the next learner
    return learner, log, Sv


class Astec:
    """A trained Astec model: vectoriser + one or more learners + label names."""

    def __init__(
        self,
        config: AstecConfig,
        learners: list[Learner],
        num_labels: int,
        vectorizer: TfidfVectorizer | None = None,
        label_names: list[str] | None = None,
        train_log: dict | None = None,
        ranker_vectorizer: TfidfVectorizer | None = None,
        ensemble: str = "mean",
        label_text_weight: float = 0.0,
    ):
        self.config = config
        # label-name match (engine/label_text.py): rebuilt from the names, used at weight > 0
        self.label_text_weight = float(label_text_weight)
        self.label_text = (
            LabelText(label_names)
            if label_names is not None and self.label_text_weight > 0
            else None
        )
        self.ensemble = ensemble  # how learners join: "mean" or "max"
        self.ranker_vectorizer = ranker_vectorizer  # words + word pairs for the sparse ranker
        self.learners = learners
        self.num_labels = num_labels
        self.vectorizer = vectorizer
        self.label_names = label_names
        self.train_log = train_log or {}

    # ---- training --------------------------------------------------------------------------
    @classmethod
    def train(
        cls,
        texts,
        Y,
        config: AstecConfig | None = None,
        label_names: list[str] | None = None,
        valid_fraction: float | None = None,
        seed: int | None = None,
        learners: int | None = None,
        progress: bool = True,
    ) -> Astec:
        """Train on raw texts (list of str) or a ready feature matrix (csr, XC sparse format).

        A validation split (config.validation: a fraction of the points, at most max_points) is
        carved out of the training data to choose the score combination's weights, the search
        sizes and the ensemble join, and to log metrics; its points join the shortlist indexes at
        the end. valid_fraction, seed and learners override the config's (which is not changed).
        """
        cfg = config.copy() if config is not None else AstecConfig()
        if valid_fraction is not None:
            cfg.validation.fraction = valid_fraction
        if seed is not None:
            cfg.seed = seed
        if learners is not None:
            cfg.ensembles.learners = learners
        Y = sp.csr_matrix(Y, dtype=np.float32)
        Y.data[:] = 1.0
        n, L = Y.shape
        if n == 0:
            raise ValueError("Astec.train: no training points")
        cfg = cfg.resolve(L)
        _set_threads(cfg.training.threads)
        fixed_mmap_threshold()
        t_start = time.time()
        vectorizer = None
        if sp.issparse(texts):
            X = sp.csr_matrix(texts, dtype=np.float32)
        else:
            texts = list(texts)
            if len(texts) != n:
                raise ValueError(f"Astec.train: {len(texts)} texts but Y has {n} rows")
            vectorizer = TfidfVectorizer(
                min_df=cfg.features.min_df,
                word_ngrams=cfg.features.word_ngrams,
                char_ngrams=tuple(cfg.features.char_ngrams) if cfg.features.char_ngrams else None,
            )
            X = vectorizer.fit_transform(texts, progress=progress)
        ranker_vec, Xr = None, None
        if cfg.sparse.enabled:
            if vectorizer is not None:
                ranker_vec = TfidfVectorizer(
                    min_df=cfg.features.min_df, word_ngrams=cfg.sparse.word_ngrams
                )
                Xr = ranker_features(ranker_vec.fit_transform(texts))
            else:
                Xr = ranker_features(X)
        if X.shape[0] != n:
            raise ValueError(f"Astec.train: X has {X.shape[0]} rows but Y has {n}")
        rng = np.random.default_rng(cfg.seed)
        perm = rng.permutation(n)
        n_valid = min(int(cfg.validation.fraction * n), cfg.validation.max_points) if n >= 20 else 0
        valid, fit = np.sort(perm[:n_valid]), np.sort(perm[n_valid:])
        inv_prop = (
            inv_propensity(Y, A=cfg.validation.propensity_a, B=cfg.validation.propensity_b)
            if n >= 2
            else np.ones(L)
        )
        log = {
            "num_points": n,
            "num_labels": L,
            "num_features": int(X.shape[1]),
            "valid_points": int(n_valid),
            "features_seconds": round(time.time() - t_start, 1),
            "learners": [],
        }
        models, valid_scores = [], []
        # the label-name match needs titles and names; its weight is chosen on validation
        use_names = bool(
            cfg.name_match.enabled and label_names is not None and vectorizer is not None
        )
        if label_names is not None and len(label_names) != L:
            raise ValueError(f"Astec.train: {len(label_names)} label names for {L} labels")
        lt = LabelText(label_names) if use_names and label_names is not None else None
        valid_extra = (
            name_candidates(lt, [texts[i] for i in valid], cfg.name_match.min_match, L)
            if lt is not None and n_valid
            else None
        )
        for j in range(cfg.ensembles.learners):
            if progress:
                tqdm.write(f"learner {j + 1}/{cfg.ensembles.learners}")
            lr, llog, Sv = train_learner(
                X,
                Y,
                fit,
                valid,
                cfg,
                cfg.seed + 1000 * j,
                inv_prop,
                progress,
                Xr,
                valid_scores=cfg.ensembles.learners > 1 or use_names,
                valid_extra=valid_extra,
            )
            models.append(lr)
            valid_scores.append(Sv)
            log["learners"].append(llog)
        ensemble = cfg.ensembles.join if cfg.ensembles.join != "auto" else "mean"
        if cfg.ensembles.learners > 1:
            ens_log: dict = {}
            if n_valid:
                # each learner's scores from before the validation points joined its indexes
                ensemble = _select(
                    "ensemble",
                    ["mean", "max"] if cfg.ensembles.join == "auto" else [cfg.ensembles.join],
                    lambda how: ensemble_scores([v[0] for v in valid_scores], how),
                    Y[valid],
                    inv_prop,
                    cfg.validation.metrics,
                    ens_log,
                )
            ens_log["ensemble"] = ensemble
            log["ensemble"] = ens_log
            if progress:
                tqdm.write(
                    f"ensemble: {ensemble} {json.dumps(ens_log.get('ensemble_selection', []))}"
                )
        text_weight = 0.0
        if lt is not None:
            joined = None
            if n_valid:
                joined = tuple(
                    ensemble_scores(list(v), ensemble) if v[0] is not None else None
                    for v in zip(*valid_scores, strict=True)
                )
            text_weight = _label_text_weight(
                lt, [texts[i] for i in valid], joined, Y[valid], inv_prop, cfg, log, progress
            )
        valid_scores.clear()  # frees the validation scores; the lambda above is done with them
        model = cls(cfg, models, L, vectorizer, label_names, log, ranker_vec, ensemble, text_weight)
        log["train_seconds"] = round(time.time() - t_start, 1)
        log["peak_rss_mb"] = _peak_rss_mb()
        return model

    # ---- inference -------------------------------------------------------------------------
    def transform(self, texts) -> sp.csr_matrix:
        """Sparse features of texts (csr passes through); str gives one row."""
        if sp.issparse(texts):
            X = sp.csr_matrix(texts, dtype=np.float32)
            V = self.learners[0].encoder.embed.num_embeddings
            if X.shape[1] > V:
                raise ValueError(f"feature matrix has {X.shape[1]} columns, the model knows {V}")
            if X.shape[1] < V:
                X = sp.csr_matrix((X.data, X.indices, X.indptr), shape=(X.shape[0], V))
            return X
        if self.vectorizer is None:
            raise ValueError(
                "this model was trained on feature vectors (XC sparse format): pass a csr matrix"
            )
        if isinstance(texts, str):
            texts = [texts]
        return self.vectorizer.transform(list(texts))

    def ranker_features(self, texts) -> sp.csr_matrix | None:
        """The sparse ranker's features (None when no learner has one): words + word pairs of
        texts, or the given feature matrix, L2-normalised with a bias column."""
        if all(lr.sparse is None for lr in self.learners):
            return None
        if sp.issparse(texts) or self.ranker_vectorizer is None:
            return ranker_features(self.transform(texts))
        if isinstance(texts, str):
            texts = [texts]
        return ranker_features(self.ranker_vectorizer.transform(list(texts)))

    def predict_scores(self, texts, Xr: sp.csr_matrix | None = None) -> sp.csr_matrix:
        """Sparse [n, L] final scores over each point's shortlisted labels (an ensemble's joined
        by `self.ensemble`: mean or max; plus the label-name match when texts are strings)."""
        raw = _raw_texts(texts)
        X = self.transform(texts if raw is None else raw)
        if Xr is None:
            Xr = self.ranker_features(raw if raw is not None else X)
        return self._scores(X, Xr, raw)

    def _scores(self, X, Xr, raw: list[str] | None) -> sp.csr_matrix:
        """predict_scores on features (raw: the texts, for the label-name match, or None)."""
        extra = self._name_candidates(raw)
        S = ensemble_scores(
            [lr.scores(X, self.config, Xr, extra) for lr in self.learners], self.ensemble
        )
        if self.label_text is not None and raw is not None:
            S = add_label_text(S, self.label_text, raw, self.label_text_weight)
        return S

    def _name_candidates(self, raw: list[str] | None) -> sp.csr_matrix | None:
        if self.label_text is None or raw is None:
            return None
        return name_candidates(
            self.label_text, raw, self.config.name_match.min_match, self.num_labels
        )

    def predict(self, texts, k: int = TOP_K, batch: int | None = None):
        """(ids int64 [n, k], scores float32 [n, k]), best first; -1 pads when < k candidates."""
        raw = _raw_texts(texts)
        X = self.transform(texts if raw is None else raw)
        Xr = self.ranker_features(raw if raw is not None else X)
        batch = batch or self.config.search.batch
        ids = np.full((X.shape[0], k), -1, np.int64)
        scores = np.zeros((X.shape[0], k), np.float32)
        _set_threads(resolve_threads(self.config.training.threads))
        for s in range(0, X.shape[0], batch):
            i, sc = topk_dense_from_csr(
                self._scores(
                    X[s : s + batch],
                    None if Xr is None else Xr[s : s + batch],
                    None if raw is None else raw[s : s + batch],
                ),
                k,
            )
            ids[s : s + batch], scores[s : s + batch] = i, sc
        return ids, scores

    def features(self, texts) -> np.ndarray:
        """Final Astec features z = v + ReLU(R v) of the first learner (float32 [n, D])."""
        return dense_bag(self.learners[0].encoder, self.transform(texts), what="z")

    # ---- persistence -----------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write the model directory (see docs/model-format.md); the manifest is written last."""
        root = Path(path)
        if (root / mio.MANIFEST).exists():
            (root / mio.MANIFEST).unlink()
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob("learner_*"):
            shutil.rmtree(old)
        self.config.save(root / "config.json")
        if self.vectorizer is not None:
            self.vectorizer.save(root / "vectorizer")
        if self.ranker_vectorizer is not None:
            self.ranker_vectorizer.save(root / "ranker_vectorizer")
        if self.label_names is not None:
            (root / "labels.json").write_text(json.dumps(self.label_names, ensure_ascii=False))
        (root / "train_log.json").write_text(json.dumps(self.train_log, indent=1))
        learners_meta = []
        for j, lr in enumerate(self.learners):
            d = root / f"learner_{j}"
            d.mkdir()
            enc = {
                "E": lr.encoder.embed.weight.detach().numpy(),
                "R_raw": lr.encoder.residual.weight.detach().numpy(),
                "R_u": lr.encoder.residual.u.numpy(),
                "R": lr.encoder.baked_residual(),
                "W": lr.clf.weight.weight.detach().numpy(),
                "b": lr.clf.bias.weight.detach().numpy().ravel(),
            }
            mio.save_tensors(d / "model.safetensors", enc)
            if lr.reranker is not None and lr.rr_clf is not None:
                mio.save_tensors(
                    d / "reranker.safetensors",
                    {
                        "E": lr.reranker.embed.weight.detach().numpy(),
                        "R_raw": lr.reranker.residual.weight.detach().numpy(),
                        "R_u": lr.reranker.residual.u.numpy(),
                        "R": lr.reranker.baked_residual(),
                        "W": lr.rr_clf.weight.weight.detach().numpy(),
                        "b": lr.rr_clf.bias.weight.detach().numpy().ravel(),
                    },
                )
            ix = lr.index
            pfile = ix.points.save(d / "ann_points")
            cfile = ix.centres.save(d / "ann_centres")
            mio.save_csr(d / "point_labels.npz", ix.point_labels)
            np.save(d / "centre_owner.npy", ix.centre_owner, allow_pickle=False)
            np.save(d / "prior.npy", ix.prior, allow_pickle=False)
            if lr.sparse is not None:
                mio.save_csr(d / "sparse_ranker.npz", lr.sparse.W)
            meta = {
                "alpha": lr.alpha,
                "beta": lr.beta,
                "reranker": lr.reranker is not None,
                "gamma": lr.gamma,
                "sparse_ranker": lr.sparse is not None,
                "search": list(lr.search) if lr.search else None,
                "vocab_size": int(lr.encoder.embed.num_embeddings),
                "dim": int(lr.encoder.embed.embedding_dim),
                "num_labels": self.num_labels,
                "points": {
                    "file": pfile,
                    "kind": ix.points.kind,
                    "count": ix.points.count,
                    "ef_search": ix.points.ef_search,
                },
                "centres": {
                    "file": cfile,
                    "kind": ix.centres.kind,
                    "count": ix.centres.count,
                    "ef_search": ix.centres.ef_search,
                },
            }
            (d / "learner.json").write_text(json.dumps(meta, indent=1))
            learners_meta.append(f"learner_{j}")
        mio.write_model_manifest(
            root,
            {
                "num_labels": self.num_labels,
                "learners": learners_meta,
                "ensemble": self.ensemble,
                "label_text_weight": self.label_text_weight,
                "has_vectorizer": self.vectorizer is not None,
                "has_ranker_vectorizer": self.ranker_vectorizer is not None,
            },
        )
        return root

    @classmethod
    def load(cls, path, check_hashes: bool = True) -> Astec:
        """Load a model directory after verifying sizes, sha256 and shapes of every file."""
        root = Path(path)
        man = mio.verify_model_dir(root, check_hashes)
        cfg = AstecConfig.load(root / "config.json")
        L = int(man["num_labels"])
        vec = TfidfVectorizer.load(root / "vectorizer") if man.get("has_vectorizer") else None
        rvec = (
            TfidfVectorizer.load(root / "ranker_vectorizer")
            if man.get("has_ranker_vectorizer")
            else None
        )
        names = (
            json.loads((root / "labels.json").read_text())
            if (root / "labels.json").exists()
            else None
        )
        if names is not None and len(names) != L:
            raise mio.ModelDirError(f"{root / 'labels.json'}: {len(names)} names for {L} labels")
        log = (
            json.loads((root / "train_log.json").read_text())
            if (root / "train_log.json").exists()
            else {}
        )
        learners = []
        for name in man["learners"]:
            d = root / name
            meta = json.loads((d / "learner.json").read_text())
            V, D = meta["vocab_size"], meta["dim"]
            if vec is not None and vec.num_features > V:
                raise mio.ModelDirError(
                    f"{d / 'model.safetensors'}: vocabulary {vec.num_features} > E rows {V}"
                )
            shapes = {
                "E": [V, D],
                "R_raw": [D, D],
                "R_u": [D],
                "R": [D, D],
                "W": [max(L, 1), D],
                "b": [max(L, 1)],
            }
            t = mio.load_tensors(d / "model.safetensors", shapes)
            enc, clf = _encoder_from(t, V, D, cfg), _clf_from(t, L, D)
            rr = rr_clf = None
            if meta["reranker"]:
                t = mio.load_tensors(d / "reranker.safetensors", shapes)
                rr, rr_clf = _encoder_from(t, V, D, cfg), _clf_from(t, L, D)
            try:
                points = AnnIndex.load(
                    d / meta["points"]["file"],
                    meta["points"]["kind"],
                    D,
                    meta["points"]["count"],
                    meta["points"]["ef_search"],
                )
                centres = AnnIndex.load(
                    d / meta["centres"]["file"],
                    meta["centres"]["kind"],
                    D,
                    meta["centres"]["count"],
                    meta["centres"]["ef_search"],
                )
                plab = mio.load_csr(d / "point_labels.npz")
                owner = np.load(d / "centre_owner.npy", allow_pickle=False)
                prior = np.load(d / "prior.npy", allow_pickle=False)
                ranker = None
                if meta.get("sparse_ranker"):
                    ranker = SparseRanker(mio.load_csr(d / "sparse_ranker.npz"))
                    F = (rvec.num_features if rvec is not None else V) + 1
                    if ranker.W.shape != (L, F):
                        raise ValueError(
                            f"sparse_ranker.npz has shape {ranker.W.shape}, expected {(L, F)}"
                        )
            except (ValueError, RuntimeError, OSError) as e:
                raise mio.ModelDirError(f"{d}: {e}") from None
            if plab.shape != (points.count, L) or owner.shape != (centres.count,):
                raise mio.ModelDirError(f"{d}: index label arrays do not match the indexes")
            counts = np.diff(sp.csc_matrix(plab).indptr)
            index = ShortlistIndex(
                points,
                plab,
                centres,
                owner.astype(np.int64),
                L,
                prior.astype(np.int64),
                _prior_score(counts[prior.astype(np.int64)]),
            )
            search = meta.get("search")
            learners.append(
                Learner(
                    enc,
                    clf,
                    index,
                    rr,
                    rr_clf,
                    float(meta["alpha"]),
                    float(meta["beta"]),
                    (int(search[0]), int(search[1])) if search else None,
                    ranker,
                    float(meta.get("gamma", 1.0)),
                )
            )
        ensemble = man.get("ensemble", "mean")  # models saved before the choice: the average
        if ensemble not in ("mean", "max"):
            raise mio.ModelDirError(
                f"{root / mio.MANIFEST}: field 'ensemble' is {ensemble!r}, expected 'mean' or 'max'"
            )
        text_weight = man.get("label_text_weight", 0.0)  # models saved before it: none
        if (
            isinstance(text_weight, bool)
            or not isinstance(text_weight, (int, float))
            or not 0 <= text_weight <= 1e3
        ):
            raise mio.ModelDirError(
                f"{root / mio.MANIFEST}: field 'label_text_weight' is "
                f"{text_weight!r}, expected a number >= 0"
            )
        if text_weight > 0 and names is None:
            raise mio.ModelDirError(f"{root}: label_text_weight > 0 but labels.json is missing")
        return cls(cfg, learners, L, vec, names, log, rvec, ensemble, float(text_weight))


def _encoder_from(t, V, D, cfg) -> Encoder:
    enc = Encoder(V, D, cfg.network.spectral_lambda, cfg.network.dropout)
    with torch.no_grad():
        enc.embed.weight.copy_(torch.from_numpy(t["E"]))
        enc.residual.weight.copy_(torch.from_numpy(t["R_raw"]))
        enc.residual.u.copy_(torch.from_numpy(t["R_u"]))
    enc.eval()
    return enc


def _clf_from(t, L, D) -> Classifier:
    clf = Classifier(L, D)
    with torch.no_grad():
        clf.weight.weight.copy_(torch.from_numpy(t["W"]))
        clf.bias.weight.copy_(torch.from_numpy(t["b"]).reshape(-1, 1))
    return clf
