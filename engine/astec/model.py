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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
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
from .config import (
    TOP_K,
    AstecConfig,
    ExtremeParams,
    RerankParams,
    ShortlistParams,
    SparseRankerParams,
    SurrogateParams,
    resolve_device,
    resolve_threads,
)
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
    fragmented and was not given back, which raised the sparse ranker's refit's peak memory.
    True when set (glibc)."""
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
    """One weight of the score combination (alpha, beta, gamma or the label-name match's):
    `fixed` when configured (>= 0), else the grid value whose validation scores
    (`make_scores(weight)`) are best; without a validation split (make_scores None) `fixed` or
    `default`. With one, logs its metrics at the chosen weight under "valid"; logs the weight."""
    if make_scores is not None:
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
    shortlists stay relevant; with E fixed they are the same searches. Searching once saves
    the second pass's searches, the largest at large L, at the same test figures. Ids held as
    int32 (half the memory)."""

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
        point_hits, centre_hits = index.searches(
            V[a:b], knn, max(kmu, keep), threads, with_self=True
        )
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


@dataclass
class Problem:
    """One learner's training problem (PECOS's MLProblem): the features X and 0/1 labels Y of
    every training point, the fit / validation split (row ids), the labels' inverse
    propensities, and the sparse ranker's features Xr (None: no sparse ranker). The splits'
    rows are cut once, here."""

    X: sp.csr_matrix
    Y: sp.csr_matrix
    fit: np.ndarray
    valid: np.ndarray
    inv_prop: np.ndarray
    Xr: sp.csr_matrix | None = None
    Xf: sp.csr_matrix = field(init=False)
    Yf: sp.csr_matrix = field(init=False)
    Xv: sp.csr_matrix = field(init=False)
    Yv: sp.csr_matrix = field(init=False)
    Xrv: sp.csr_matrix | None = field(init=False)

    def __post_init__(self) -> None:
        self.Xf, self.Yf = self.X[self.fit], self.Y[self.fit]
        self.Xv, self.Yv = self.X[self.valid], self.Y[self.valid]
        self.Xrv = None if self.Xr is None else self.Xr[self.valid]

    @property
    def has_valid(self) -> bool:
        """Whether there is a validation split (tiny data sets have none)."""
        return self.valid.size > 0


@dataclass
class Run:
    """How one learner trains: the resolved config, its seed, where its batches run (the
    resolved device) and whether progress is printed."""

    cfg: AstecConfig
    seed: int
    device: str
    progress: bool

    @property
    def threads(self) -> int:
        return resolve_threads(self.cfg.training.threads)

    def say(self, line: str) -> None:
        if self.progress:
            tqdm.write(line)


@contextmanager
def _timed(log: dict) -> Iterator[dict]:
    """Adds the block's wall and CPU seconds and the peak RSS so far to `log`."""
    t0, c0 = time.time(), _cpu_s()
    yield log
    log.update(_spent(t0, c0))
    log["peak_rss_mb"] = _peak_rss_mb()


@dataclass
class Shortlists:
    """What Module II gives the later modules: the training-time indexes over the fit points,
    the fit points' v and label centres (Module IV refreshes all three when it fine-tunes E),
    each fit point's negatives (Module IV's training set, taken over by it), the searches kept
    for the shortlists after Module IV (`FitSearches`, taken over by the first reader) and the
    validation points' candidates (Module IV's per-epoch objective; None without a split)."""

    index: ShortlistIndex
    Vf: np.ndarray | None
    centres: tuple[np.ndarray, np.ndarray] | None
    negatives: sp.csr_matrix | None
    kept: FitSearches | None
    valid_candidates: sp.csr_matrix | None


@dataclass
class ValidShortlists:
    """Module IV's shortlists of the validation points (C, with the base similarity s as data)
    and their final features Z: the score combination's weights are chosen on them, and the
    re-ranker's per-epoch objective reads them."""

    C: sp.csr_matrix
    Z: np.ndarray


def _epoch_objective(
    encoder: Encoder, clf: Classifier, prob: Problem, Cv: sp.csr_matrix | None, cfg: AstecConfig
) -> Callable[[], float] | None:
    """The validation objective of a classifier alone on fixed validation shortlists Cv, read
    from the live (training) weights: what a training loop checks after each epoch (None
    without validation shortlists)."""
    if Cv is None:
        return None
    candidates = Cv
    threads = resolve_threads(cfg.training.threads)

    def objective() -> float:
        Z = dense_bag(encoder, prob.Xv, what="z")
        W = clf.weight.weight.detach().numpy()
        b = clf.bias.weight.detach().numpy().ravel()
        S = sp.csr_matrix(
            (
                classifier_logits(Z, W, b, candidates, threads),
                candidates.indices,
                candidates.indptr,
            ),
            shape=candidates.shape,
        )
        return _valid_metrics(S, prob.Yv, prob.inv_prop, cfg.validation.metrics)[0]

    return objective


def _choose_weight(
    name: str,
    fixed: float,
    grid,
    default: float,
    learner: Learner,
    vs: ValidShortlists | None,
    prob: Problem,
    run: Run,
    log: dict,
) -> float:
    """The learner's combination weight `name` ("alpha", "beta" or "gamma"; the others as set
    so far): `fixed` when configured (>= 0), else the grid value best on the validation
    shortlists vs; without them `fixed` or `default` (see `_combination_weight`)."""
    make = None
    if vs is not None:
        base, rr = learner.logits(prob.Xv, vs.C, vs.Z, run.threads)
        sig = Sigmoids.of(vs.C, base, rr, learner.sparse_scores(prob.Xrv, vs.C, run.threads))
        weights = {"alpha": learner.alpha, "beta": learner.beta, "gamma": learner.gamma}

        def make(w: float) -> sp.csr_matrix:
            return mix(vs.C, sig, **{**weights, name: w})

    return _combination_weight(
        name, fixed, grid, make, prob.Yv, prob.inv_prop, run.cfg, log, default
    )


def train_surrogate_module(prob: Problem, sur: SurrogateParams, run: Run) -> tuple[Encoder, dict]:
    """Module I: E (and R0) learnt on the surrogate task, whose labels are balanced clusters of
    the labels (`sur.num_clusters` of them, as `AstecConfig.resolve` fixed). Returns the
    encoder and the module's log."""
    cfg = run.cfg
    net, training = cfg.network, cfg.training
    log: dict[str, Any] = {}
    with _timed(log):
        assign = balanced_clusters(
            label_centroids(prob.Xf, prob.Yf), sur.num_clusters, run.seed, run.progress
        )
        encoder = Encoder(prob.X.shape[1], net.embedding_dim, net.spectral_lambda, net.dropout)
        if net.embedding_init == "svd":
            E0 = svd_embedding_init(prob.Xf, prob.Yf, net.embedding_dim, run.seed)
            with torch.no_grad():
                encoder.embed.weight.copy_(torch.from_numpy(E0))
        epochs = train_surrogate(
            encoder,
            prob.Xf,
            meta_labels(prob.Yf, assign, sur.num_clusters),
            epochs=sur.epochs,
            lr=sur.lr,
            batch_size=training.batch_size,
            seed=run.seed,
            progress=run.progress,
            valid=(prob.Xv, meta_labels(prob.Yv, assign, sur.num_clusters)),
            decay_epoch=round(sur.decay * sur.epochs),
            patience=sur.patience,
            device=run.device,
            precision=training.precision,
            fused=training.fused_kernels,
            sampled=sur.sampled_negatives if 0 < sur.sampled_from <= sur.num_clusters else 0,
            sampled_block=sur.sampled_block,
        )
    log.update(clusters=int(sur.num_clusters), epochs=epochs)
    return encoder, log


def train_shortlist_module(
    prob: Problem, sl: ShortlistParams, encoder: Encoder, run: Run, keep: int
) -> tuple[Shortlists, dict]:
    """Module II: with E frozen, ANNS^x over the fit points' v and ANNS^mu over the label
    centres, and each fit point's hard negatives from both plus random ones; keep > 0: the
    searches are kept that deep for the shortlists after Module IV (`FitSearches`). Logs the
    validation shortlists' recall and metrics."""
    cfg = run.cfg
    log: dict[str, Any] = {}
    with _timed(log):
        # no bar inside the index builds and searches: say what runs (minutes at L = 500k)
        run.say(f"  Module II: indexes and hard negatives for {prob.Xf.shape[0]} points ...")
        Vf = dense_bag(encoder, prob.Xf)
        centres = label_centres(Vf, prob.Yf, sl.head_centres, sl.head_min_points, run.seed)
        index = _build_index(encoder, prob.Xf, prob.Yf, cfg, run.seed, Vf, centres_owner=centres)
        negatives, kept = _module2_negatives(index, Vf, prob.Yf, cfg, run.seed, keep=keep)
        log.update(index_kind=index.points.kind, centres=int(index.centres.count))
        Cv = None
        if prob.has_valid:
            Sv = index.scores(
                dense_bag(encoder, prob.Xv),
                sl.knn_neighbours,
                sl.centroid_neighbours,
                sl.centroid_weight,
                cfg.training.threads,
                knn_power=sl.knn_power,
            )
            k = cfg.search.candidates
            log[f"valid_recall@{k}"] = round(recall_at(Sv, prob.Yv, k), 2)
            m = evaluate(prob.Yv, topk_dense_from_csr(Sv, 5), prob.inv_prop, ks=(1, 3, 5))
            log["valid_shortlist_only"] = {name: round(v, 2) for name, v in m.items()}
            Cv = topk_rows(Sv, k, cfg.training.threads)  # fixed candidates for Module IV's epochs
            del Sv
    run.say(
        "  Module II: " + json.dumps({k: v for k, v in log.items() if k != "valid_shortlist_only"})
    )
    return Shortlists(index, Vf, centres, negatives, kept, Cv), log


def train_extreme_module(
    prob: Problem, ext: ExtremeParams, encoder: Encoder, short: Shortlists, run: Run
) -> tuple[Learner, ValidShortlists | None, dict]:
    """Modules III/IV: a new residual R (identity) and the 1-vs-all classifier W trained on each
    fit point's positives and Module II's negatives (E fine-tuned when `ext.finetune_embeddings`:
    then the indexes in `short` are rebuilt on the final v, Module II's links kept); alpha
    chosen on the validation shortlists, which are returned for the later weights."""
    cfg = run.cfg
    D, L = cfg.network.embedding_dim, prob.Y.shape[1]
    log: dict[str, Any] = {}
    with _timed(log):
        encoder.residual = SpectralResidual(D, cfg.network.spectral_lambda)
        clf = Classifier(L, D)
        negatives, short.negatives = short.negatives, None
        assert negatives is not None, "Module II's negatives were taken already"
        log["epochs"] = train_shortlisted(
            encoder,
            clf,
            prob.Xf,
            prob.Yf,
            negatives,
            epochs=ext.epochs,
            lr=ext.lr,
            batch_size=cfg.training.batch_size,
            seed=run.seed,
            finetune_embeddings=ext.finetune_embeddings,
            finetune_lr=ext.finetune_lr,
            name="Module IV",
            progress=run.progress,
            device=run.device,
            fused=cfg.training.fused_kernels,
            valid=_epoch_objective(encoder, clf, prob, short.valid_candidates, cfg),
        )
        del negatives
        if ext.finetune_embeddings:  # v moved: the indexes again, on the final v (the serving
            # graphs over the fit points, for the search's choice, share v and the label
            # centres); E fixed (the paper's Module IV): Module II's indexes still hold
            sl = cfg.shortlist
            Vf = short.Vf = dense_bag(encoder, prob.Xf)
            centres = label_centres(Vf, prob.Yf, sl.head_centres, sl.head_min_points, run.seed)
            moved = short.index.points.with_vectors(Vf, cfg.training.threads)  # Module II's links
            short.centres = centres
            short.index = _build_index(
                encoder, prob.Xf, prob.Yf, cfg, run.seed, Vf, centres_owner=centres, points=moved
            )
        learner = Learner(encoder, clf, short.index)
        vs = None
        if prob.has_valid:
            vs = ValidShortlists(*learner.shortlist(prob.Xv, cfg))
        comb = cfg.combination
        learner.alpha = _choose_weight(
            "alpha", comb.alpha, comb.alpha_grid, learner.alpha, learner, vs, prob, run, log
        )
    if "valid" in log:
        run.say(f"  Module IV: alpha={learner.alpha} valid={log['valid']}")
    return learner, vs, log


def train_reranker_module(
    prob: Problem,
    rerank: RerankParams,
    learner: Learner,
    vs: ValidShortlists | None,
    short: Shortlists,
    run: Run,
    for_ranker: bool,
) -> tuple[AfterIv, dict]:
    """The re-ranker: an independent (E~, R~, W~), started from the base model's E and W, trained
    on each fit point's positives and the base model's top mispredictions (at the extreme
    classifier's learning rates); beta chosen on the validation shortlists. The shortlist pass
    that finds the mispredictions also gives the sparse ranker's candidates when for_ranker;
    it is returned (`AfterIv`)."""
    cfg = run.cfg
    D, L = cfg.network.embedding_dim, prob.Y.shape[1]
    log: dict[str, Any] = {}
    with _timed(log):
        after = _after_iv_shortlists(
            learner, prob.Xf, prob.Yf, cfg, rerank=True, sparse=for_ranker, kept=short.kept
        )
        short.kept = None
        hard, after.hard = after.hard, None
        assert hard is not None
        rr = Encoder(prob.X.shape[1], D, cfg.network.spectral_lambda, cfg.network.dropout)
        with torch.no_grad():
            rr.embed.weight.copy_(learner.encoder.embed.weight)
        rr_clf = Classifier(L, D)
        with torch.no_grad():
            rr_clf.weight.weight.copy_(learner.clf.weight.weight)
            rr_clf.bias.weight.copy_(learner.clf.bias.weight)
        log["epochs"] = train_shortlisted(
            rr,
            rr_clf,
            prob.Xf,
            prob.Yf,
            hard,
            epochs=rerank.epochs,
            lr=cfg.extreme.lr,
            batch_size=cfg.training.batch_size,
            seed=run.seed + 1,
            finetune_embeddings=True,
            finetune_lr=cfg.extreme.finetune_lr,
            name="Re-ranker",
            progress=run.progress,
            device=run.device,
            fused=cfg.training.fused_kernels,
            valid=_epoch_objective(rr, rr_clf, prob, None if vs is None else vs.C, cfg),
        )
        del hard
        learner.reranker, learner.rr_clf = rr, rr_clf
        comb = cfg.combination
        learner.beta = _choose_weight(
            "beta", comb.beta, comb.beta_grid, learner.beta, learner, vs, prob, run, log
        )
    if "valid" in log:
        run.say(f"  Re-ranker: beta={learner.beta} valid={log['valid']}")
    return after, log


def train_sparse_module(
    prob: Problem,
    sparse: SparseRankerParams,
    learner: Learner,
    vs: ValidShortlists | None,
    short: Shortlists,
    after: AfterIv | None,
    run: Run,
) -> tuple[AfterIv, dict]:
    """The sparse ranker fitted on the fit points' positives and `sparse.negatives` shortlisted
    labels each (from `after`, the re-ranker's shortlist pass, when it has them), gamma chosen
    on the validation shortlists (an even mix without them). Returns the pass (its candidates
    seed the refit, `refit_sparse_ranker`) and the module's log."""
    cfg = run.cfg
    log: dict[str, Any] = {}
    with _timed(log):
        run.say(f"  Sparse ranker: shortlists and fit on {prob.Xf.shape[0]} points ...")
        if after is None or after.candidates is None:
            after = _after_iv_shortlists(
                learner, prob.Xf, prob.Yf, cfg, rerank=False, sparse=True, kept=short.kept
            )
            short.kept = None
        assert after.candidates is not None and prob.Xr is not None
        pairs = label_pairs(prob.Yf, after.candidates, run.threads)  # candidates: for the refit
        learner.sparse = _fit_ranker(prob.Xr[prob.fit], pairs, cfg, run.seed, rows=prob.fit)
        del pairs
        log["weights"] = int(learner.sparse.W.nnz)
        comb = cfg.combination
        learner.gamma = _choose_weight(
            "gamma", comb.gamma, comb.gamma_grid, 0.5, learner, vs, prob, run, log
        )
    if "valid" in log:
        run.say(f"  Sparse ranker: gamma={learner.gamma} valid={log['valid']}")
    return after, log


def serving_indexes(
    prob: Problem,
    learner: Learner,
    short: Shortlists,
    run: Run,
    log: dict,
    valid_extra: sp.csr_matrix | None = None,
    valid_scores: bool = False,
) -> tuple[sp.csr_matrix, sp.csr_matrix | None] | None:
    """Prediction's indexes: the search size chosen on validation with serving graphs over the
    fit points (so validation points do not find themselves; `select_search`), then the final
    indexes over every training point (the validation points' labels help prediction; built
    from those graphs where they can be). Returns the learner's final validation scores from
    before the validation points joined (see `train_learner`) when valid_scores, else None.
    Takes over short's indexes, v and centres."""
    cfg = run.cfg
    chosen: sp.csr_matrix | None = None  # the validation scores with the chosen search
    fit_serving = None  # the serving indexes over the fit points and their centres' vectors
    if prob.has_valid and cfg.search.fractions:
        assert short.Vf is not None and short.centres is not None
        learner.index = _build_index(
            learner.encoder,
            prob.Xf,
            prob.Yf,
            cfg,
            run.seed,
            short.Vf,
            serving=True,
            centres_owner=short.centres,
            same_points=short.index,
        )
        learner.search, chosen = select_search(
            learner, prob.Xv, prob.Yv, cfg, prob.inv_prop, log, prob.Xrv
        )
        fit_serving = (learner.index, short.centres[0])
    short.Vf = short.centres = None
    Sv = None
    if valid_scores and prob.has_valid:
        Sv = (
            chosen if chosen is not None else learner.scores(prob.Xv, cfg, prob.Xrv),
            None
            if valid_extra is None
            else learner.scores(prob.Xv, cfg, prob.Xrv, extra=valid_extra),
        )
    learner.index = _final_index(
        learner.encoder, prob.X, prob.Y, prob.fit, prob.valid, cfg, run.seed, short.index,
        fit_serving,
    )  # fmt: skip
    return Sv


def refit_sparse_ranker(
    prob: Problem, learner: Learner, after: AfterIv, run: Run, log: dict
) -> None:
    """The sparse ranker again on every training point once gamma is chosen (else labels seen
    only in the validation split would have no model), starting from the first fit's dual
    variables, which needs fewer sweeps than a cold fit; learner.index: the final indexes.
    Adds the refit's seconds and weights to the module's log."""

    assert learner.sparse is not None and prob.Xr is not None
    t0, c0 = time.time(), _cpu_s()
    run.say(f"  Sparse ranker: refit on all {prob.X.shape[0]} points ...")
    C, rows = _refit_candidates(learner, prob.X, prob.Y, prob.fit, prob.valid, after, run.cfg)
    # the candidates go once grouped into pairs: the two are the refit's largest arrays
    pairs = label_pairs(prob.Y[rows], C, run.threads)
    del C
    learner.sparse = _fit_ranker(
        prob.Xr[rows], pairs, run.cfg, run.seed, rows=rows, warm=learner.sparse
    )
    del pairs
    spent = _spent(t0, c0)
    log["refit_seconds"] = spent["seconds"]
    log["refit_cpu_seconds"] = spent["cpu_seconds"]
    log["weights"] = int(learner.sparse.W.nnz)


def train_learner(
    prob: Problem,
    cfg: AstecConfig,
    seed: int,
    *,
    progress: bool = True,
    valid_scores: bool = False,
    valid_extra: sp.csr_matrix | None = None,
) -> tuple[Learner, dict, tuple[sp.csr_matrix, sp.csr_matrix | None] | None]:
    """One learner, the paper's four steps (then the sparse ranker and prediction's indexes);
    returns (Learner, log, validation scores). The last is the learner's final scores of the
    validation points before they join its indexes (for an ensemble's and the label-name
    match's choices) as (scores, scores with the label-name candidates `valid_extra` in the
    shortlists or None), or None when not asked or without a validation split."""
    run = Run(cfg, seed, resolve_device(cfg.training.device), progress)
    log: dict = {"seed": seed, "modules": {}}
    modules = log["modules"]
    torch.manual_seed(seed)
    rerank_on = cfg.rerank.enabled and cfg.rerank.epochs > 0
    sparse_on = prob.Xr is not None and cfg.sparse.enabled
    # 1. Module I: E on the surrogate task
    encoder, modules["I"] = train_surrogate_module(prob, cfg.surrogate, run)
    # 2. Module II: indexes over E's v, hard negatives; its searches kept for step 4
    keep = _after_iv_depth(cfg, rerank_on, sparse_on)
    short, modules["II"] = train_shortlist_module(prob, cfg.shortlist, encoder, run, keep)
    # 3. Modules III/IV: residual R and the extreme classifiers W on positives + shortlists
    learner, vs, modules["IV"] = train_extreme_module(prob, cfg.extreme, encoder, short, run)
    # 4. the re-ranker on the base model's mispredictions
    after: AfterIv | None = None  # one shortlist pass serves both rankers
    if rerank_on:
        after, modules["reranker"] = train_reranker_module(
            prob, cfg.rerank, learner, vs, short, run, for_ranker=sparse_on
        )
    # the sparse ranker (beyond the paper) on the fit points; gamma on the validation points
    if sparse_on:
        after, modules["sparse"] = train_sparse_module(
            prob, cfg.sparse, learner, vs, short, after, run
        )
    Sv = serving_indexes(
        prob, learner, short, run, log, valid_extra=valid_extra, valid_scores=valid_scores
    )
    del short
    if learner.sparse is not None:
        if prob.has_valid:
            assert after is not None
            refit_sparse_ranker(prob, learner, after, run, modules["sparse"])
        learner.sparse.dual = None  # only a refit needs it: free it before the next learner
    return learner, log, Sv


def _features(
    texts, n: int, cfg: AstecConfig, progress: bool
) -> tuple[sp.csr_matrix, TfidfVectorizer | None, sp.csr_matrix | None, TfidfVectorizer | None]:
    """(X, its vectoriser or None for a given feature matrix, the sparse ranker's features or
    None without a ranker, their vectoriser or None) of n training texts (a list) or a feature
    matrix."""
    vectorizer = None
    if sp.issparse(texts):
        X = sp.csr_matrix(texts, dtype=np.float32)
    else:
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
    return X, vectorizer, Xr, ranker_vec


def _problem(X, Y: sp.csr_matrix, Xr, cfg: AstecConfig) -> Problem:
    """The learners' problem: a validation split of `validation.fraction` of the points (at
    most `max_points`; none under 20 points) drawn with the config's seed, the rest to fit."""
    n, L = Y.shape
    perm = np.random.default_rng(cfg.seed).permutation(n)
    n_valid = min(int(cfg.validation.fraction * n), cfg.validation.max_points) if n >= 20 else 0
    inv_prop = (
        inv_propensity(Y, A=cfg.validation.propensity_a, B=cfg.validation.propensity_b)
        if n >= 2
        else np.ones(L)
    )
    return Problem(X, Y, np.sort(perm[n_valid:]), np.sort(perm[:n_valid]), inv_prop, Xr)


def _ensemble_join(
    valid_scores: list, prob: Problem, cfg: AstecConfig, log: dict, progress: bool
) -> str:
    """How the learners' scores join ("mean" or "max"): the configured way, or with "auto" the
    one better on the learners' validation scores from before the validation points joined
    their indexes (the mean without a split). Logs the choice when there are several learners."""
    ensemble = cfg.ensembles.join if cfg.ensembles.join != "auto" else "mean"
    if cfg.ensembles.learners <= 1:
        return ensemble
    ens_log: dict = {}
    if prob.has_valid:
        ensemble = _select(
            "ensemble",
            ["mean", "max"] if cfg.ensembles.join == "auto" else [cfg.ensembles.join],
            lambda how: ensemble_scores([v[0] for v in valid_scores], how),
            prob.Yv,
            prob.inv_prop,
            cfg.validation.metrics,
            ens_log,
        )
    ens_log["ensemble"] = ensemble
    log["ensemble"] = ens_log
    if progress:
        tqdm.write(f"ensemble: {ensemble} {json.dumps(ens_log.get('ensemble_selection', []))}")
    return ensemble


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
        Y = sp.csr_matrix(Y, dtype=np.float32, copy=True)  # the caller's Y stays as it is
        Y.eliminate_zeros()  # a stored 0 is no label
        Y.data[:] = 1.0
        n, L = Y.shape
        if n == 0:
            raise ValueError("Astec.train: no training points")
        cfg = cfg.resolve(L)
        _set_threads(cfg.training.threads)
        fixed_mmap_threshold()
        t_start = time.time()
        if not sp.issparse(texts):
            texts = list(texts)  # read more than once (a generator would be spent)
        X, vectorizer, Xr, ranker_vec = _features(texts, n, cfg, progress)
        prob = _problem(X, Y, Xr, cfg)
        n_valid = int(prob.valid.size)
        log = {
            "num_points": n,
            "num_labels": L,
            "num_features": int(X.shape[1]),
            "valid_points": n_valid,
            "features_seconds": round(time.time() - t_start, 1),
            "learners": [],
        }
        if label_names is not None and len(label_names) != L:
            raise ValueError(f"Astec.train: {len(label_names)} label names for {L} labels")
        # the label-name match needs titles and names; its weight is chosen on validation
        lt = None
        if cfg.name_match.enabled and label_names is not None and vectorizer is not None:
            lt = LabelText(label_names)
        valid_texts = [texts[i] for i in prob.valid] if lt is not None else []
        valid_extra = (
            name_candidates(lt, valid_texts, cfg.name_match.min_match, L)
            if lt is not None and n_valid
            else None
        )
        models: list[Learner] = []
        valid_scores: list[Any] = []  # per learner: train_learner's validation scores
        for j in range(cfg.ensembles.learners):
            if progress:
                tqdm.write(f"learner {j + 1}/{cfg.ensembles.learners}")
            lr, llog, Sv = train_learner(
                prob,
                cfg,
                cfg.seed + 1000 * j,
                progress=progress,
                valid_scores=cfg.ensembles.learners > 1 or lt is not None,
                valid_extra=valid_extra,
            )
            models.append(lr)
            valid_scores.append(Sv)
            log["learners"].append(llog)
        ensemble = _ensemble_join(valid_scores, prob, cfg, log, progress)
        text_weight = 0.0
        if lt is not None:
            joined = None
            if n_valid:
                joined = tuple(
                    ensemble_scores(list(v), ensemble) if v[0] is not None else None
                    for v in zip(*valid_scores, strict=True)
                )
            text_weight = _label_text_weight(
                lt, valid_texts, joined, prob.Yv, prob.inv_prop, cfg, log, progress
            )
        valid_scores.clear()  # frees the learners' validation scores
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
