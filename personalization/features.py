"""Candidate queries and their hand features for a batch of events, without torch.

Training (torch) and serving (numpy / ONNX Runtime) both call `build_batch`, so the features a
model was trained on are bit-for-bit the ones it is served with. Events are left-padded to K
states (the current page is always the last slot); compiled kernels (`feature_kernels`) find
the union of the states' top-k query ids and compute every feature in one pass per event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Names of the per-candidate hand features, in column order (kept in the model manifest).
FEATURE_NAMES = (
    "score_current",  # Astec score of the query on the current page (0 if absent)
    "in_current",  # 1 if the query is in the current page's top-k
    "score_previous",  # Astec score on the previous page (0 if absent / no previous page)
    "mean_score_window",  # mean Astec score over the window's states (0 where absent)
    "frac_states",  # fraction of the window's states whose top-k holds the query
    "recency_score",  # score averaged with weights gamma^(age) over the window
    "mean_score_block",  # mean score over the current block (states since the last long gap)
    "frac_block",  # fraction of the current block's states whose top-k holds the query
    "inv_rank_current",  # 1 / (1 + rank) on the current page (0 if absent)
    "log_popularity",  # log1p(global count) / log1p(max count)
    "window_fill",  # number of states in the window / K
    "sim_current",  # cosine of the query's vector with the current page's mean query vector
    "sim_block",  # that cosine averaged over the current block's pages
    "sim_window",  # ... and over the whole window
    "intent_mass",  # filtered posterior mass of the query's cluster over the window's pages
    "page_cluster_share",  # the current page's share of predicted-query score in that cluster
    "shown_recent",  # how often the query was shown at the window's earlier visits, decayed
)
F = {name: i for i, name in enumerate(FEATURE_NAMES)}
N_KERNEL = 16  # the columns feature_kernels.features writes (the intent pair its last two)
if F["sim_window"] != 13 or FEATURE_NAMES[N_KERNEL - 2 : N_KERNEL] != (
    "intent_mass",
    "page_cluster_share",
):
    raise ImportError("feature_kernels.features writes the columns in FEATURE_NAMES' order")
N_FEATURES = len(FEATURE_NAMES)
SIM_DIM = 32  # size of the query vectors behind the sim_* features
N_SIM = 3  # the sim_* features are columns 11 .. 13
N_INTENT = 2  # the intent_* / page_cluster_* features are the kernel's last two columns
# What a policy without `feature_fit` in its manifest was trained with; policies trained now
# carry the values personalization.fit_filter fitted on their own logs (FeatureFit).
RECENCY_GAMMA = 0.7
BLOCK_GAP_S = 30 * 60
INTENT_KAPPA = 20.0
KAPPA_FLOOR = 0.5
INTENT_KEEP_BLOCK = 0.7
INTENT_KEEP = 0.95
INTENT_SCORE_WEIGHT = 0.05
# shown_recent's decay per earlier visit where the logs hold too few clicks to fit it
SHOWN_DECAY = 0.5


@dataclass(frozen=True)
class FeatureFit:
    """The constants of the features, fitted on a policy's training logs
    (personalization.fit_filter) and stored in its manifest (`feature_fit`), so serving uses
    exactly what was fit. The defaults are what older policies were trained with.

    block_gap_s: a gap this long between two visits starts a new block (a "session");
    keep / keep_block: the share of the intent filter's belief kept between two views of one
    block / across a block start (the rest through the successor kernel, uniform without one);
    kappa_*: a page whose predicted queries put share e(c) of their score in cluster c
    multiplies the belief in c by 1 + kappa(c) e(c),
    kappa(c) = kappa_scale x max(n x the cluster's share of the views' evidence,
    kappa_floor) ^ -kappa_power over n clusters (`cluster_kappa`); recency_gamma: the decay of
    recency_score's weights; intent_score_weight: the weight of score_current beside
    intent_mass's 1 in the fixed intent ranking (personalization.train.intent_rank_weights);
    shown_decay: the weight of a showing one visit further back in shown_recent."""

    block_gap_s: float = float(BLOCK_GAP_S)
    keep: float = INTENT_KEEP
    keep_block: float = INTENT_KEEP_BLOCK
    kappa_scale: float = INTENT_KAPPA
    kappa_floor: float = KAPPA_FLOOR
    kappa_power: float = 1.0
    recency_gamma: float = RECENCY_GAMMA
    intent_score_weight: float = INTENT_SCORE_WEIGHT
    shown_decay: float = SHOWN_DECAY

    def to_array(self) -> np.ndarray:
        """float64 [9] in field order (how a weights dict carries it, under FIT_KEY)."""
        return np.array([getattr(self, f) for f in FIT_FIELDS], np.float64)

    @classmethod
    def from_array(cls, a: np.ndarray) -> FeatureFit:
        """From to_array's values (a shorter array: the fields it lacks at their defaults)."""
        return cls(*(float(x) for x in np.asarray(a, np.float64).reshape(-1)))

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in FIT_FIELDS}

    @classmethod
    def from_json(cls, d: object) -> FeatureFit:
        """From a manifest's `feature_fit` (None: an older policy, the defaults; a field fitted
        only by later versions, OPTIONAL_FIELDS, missing: its default); ValueError naming the
        field that is missing or out of range."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"field 'feature_fit' must be an object, got {type(d).__name__}")
        vals = {}
        for f in FIT_FIELDS:
            if f in OPTIONAL_FIELDS and f not in d:
                continue
            x = d.get(f)
            if isinstance(x, bool) or not isinstance(x, int | float) or not np.isfinite(x):
                raise ValueError(f"field 'feature_fit.{f}' must be a finite number, got {x!r}")
            vals[f] = float(x)
        for f in ("keep", "keep_block", "recency_gamma", "shown_decay"):
            if f in vals and not 0.0 <= vals[f] <= 1.0:
                raise ValueError(f"field 'feature_fit.{f}' must be in [0, 1], got {vals[f]}")
        for f in ("block_gap_s", "kappa_scale", "kappa_floor"):
            if vals[f] <= 0:
                raise ValueError(f"field 'feature_fit.{f}' must be > 0, got {vals[f]}")
        if vals.get("intent_score_weight", 0.0) < 0:
            raise ValueError(
                f"field 'feature_fit.intent_score_weight' must be >= 0, "
                f"got {vals['intent_score_weight']}"
            )
        return cls(**vals)


FIT_FIELDS = tuple(FeatureFit.__dataclass_fields__)
# absent from the manifests of earlier fits
OPTIONAL_FIELDS = ("intent_score_weight", "shown_decay")
FIT_KEY = "_feature_fit"  # a weights dict's FeatureFit.to_array() (the manifest holds the JSON)
DEFAULT_FIT = FeatureFit()


def recency_weights(K: int, gamma: float) -> np.ndarray:
    """float32 [K] gamma^(age) of the window's slots (the current page, last, has age 0)."""
    return (gamma ** (K - 1 - np.arange(K))).astype(np.float32)


@dataclass
class EventBatch:
    """Padded arrays for B events with up to K states each (slot K-1 = current page)."""

    z: np.ndarray  # float32 [B, K, gru_input_dim(D, n)]: the GRU's input per state: the
    # L2-normalised page features, a 1 where the state starts a block (long gap before it),
    # log1p(minutes to the next state) (0 on the current page) and the page's share of evidence
    # per query cluster (n = the policy's clusters, 1 zero column without); zeros in padding
    state_mask: np.ndarray  # bool [B, K], True for real states (right-aligned)
    cand_ids: np.ndarray  # int64 [B, C], candidate query ids, -1 in padding
    cand_mask: np.ndarray  # bool [B, C]
    feats: np.ndarray  # float32 [B, C, N_FEATURES]


def gru_input_dim(D: int, n_clusters: int) -> int:
    """Width of EventBatch.z for D page features and n_clusters query clusters (0 = none)."""
    return D + 2 + max(n_clusters, 1)


def page_feature_dim(z_dim: int, n_clusters: int) -> int:
    """D of a GRU input of width z_dim (the inverse of gru_input_dim)."""
    return z_dim - 2 - max(n_clusters, 1)


def pad_states(seqs: list[tuple[np.ndarray, ...]], K: int) -> tuple[np.ndarray, ...]:
    """Stack per-event (z[n,D], ids[n,k], scores[n,k], ts[n]) into left-padded [B,K,...] arrays
    (z, ids, scores, mask, ts). Only the last K states are kept (the current page is last)."""
    B = len(seqs)
    D = seqs[0][0].shape[1]
    k = max(s[1].shape[1] for s in seqs)
    z = np.zeros((B, K, D), np.float32)
    ids = np.full((B, K, k), -1, np.int64)
    scores = np.zeros((B, K, k), np.float32)
    mask = np.zeros((B, K), bool)
    ts = np.zeros((B, K), np.float64)
    for b, (zs, ii, ss, tt) in enumerate(seqs):  # B copies of small blocks; no per-element work
        n = min(len(zs), K)
        kk = ii.shape[1]
        z[b, K - n :] = zs[-n:]
        ids[b, K - n :, :kk] = ii[-n:]
        scores[b, K - n :, :kk] = ss[-n:]
        mask[b, K - n :] = True
        ts[b, K - n :] = tt[-n:]
    return z, ids, scores, mask, ts


def pad_shown(shown: list[np.ndarray], K: int) -> np.ndarray:
    """Left-pad per-event shown query ids (one per state, as pad_states keeps the states) into
    an int64 [B, K] array (-1: padding or nothing shown), the last K of each."""
    out = np.full((len(shown), K), -1, np.int64)
    for b, s in enumerate(shown):
        n = min(len(s), K)
        if n:
            out[b, K - n :] = s[-n:]
    return out


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalise the last axis in float32 (zero rows stay zero)."""
    x = np.asarray(x, np.float32)
    n = np.sqrt((x * x).sum(-1, keepdims=True))
    return x / np.maximum(n, 1e-6)


def sim_table_from_rows(rows: np.ndarray, dim: int = SIM_DIM) -> np.ndarray:
    """Unit query vectors [L+1, dim] for the sim_* features: the L2-normalised Astec classifier
    rows projected on their top `dim` (uncentred) singular directions; row L is zeros, so the
    padding id -1 gathers a zero vector without a mask. A candidate whose vector agrees with
    the window's pages' queries is the one the window's pages point at together; 32 dims keep
    that signal (held-out intent hit of a hand ranking 0.803 vs 0.806 with all 300 dims) at a
    tenth of the serving cost."""
    R = np.asarray(rows, np.float32)
    R = R / np.maximum(np.linalg.norm(R, axis=1, keepdims=True), 1e-6)
    dim = min(dim, R.shape[1], R.shape[0])
    # right singular vectors from the small D x D Gram matrix (L may be large)
    _, V = np.linalg.eigh(R.T.astype(np.float64) @ R)
    E = normalise_rows(R @ V[:, ::-1][:, :dim].astype(np.float32))
    return np.concatenate([E, np.zeros((1, dim), np.float32)])


def build_batch(
    z: np.ndarray,
    ids: np.ndarray,
    scores: np.ndarray,
    state_mask: np.ndarray,
    log_pop: np.ndarray,
    ts: np.ndarray | None = None,
    sim_table: np.ndarray | None = None,
    sim_norm: np.ndarray | None = None,
    clusters: Clusters | None = None,
    shown: np.ndarray | None = None,
) -> EventBatch:
    """Candidates (union of the window's top-k ids) and their features for a padded batch.

    z [B,K,D], ids [B,K,k] (-1 = none, each row sorted by descending score), scores [B,K,k],
    state_mask [B,K] right-aligned, log_pop [L] = normalised log popularity per query id,
    ts [B,K] visit times in seconds (None = all one block), sim_table [L+1,d] unit query vectors
    (`sim_table_from_rows`) and sim_norm [2] the (mean, sd) of their raw cosines (None = the
    sim_* features stay 0), clusters the policy's `cluster_lookup` (None = the intent
    features stay 0), shown [B,K] the query shown to the user at each window visit (-1: none;
    the current slot is not read: its ad is what is being chosen; None: nothing shown).

    The features (FEATURE_NAMES): the Astec score / presence of each candidate averaged over
    the states with weights for the current page, the previous one, the window (uniform), by
    recency (recency_gamma^age) and over the current block (the states since the last gap of
    block_gap_s); its inverse rank on the current page, popularity and the window's fill; the
    sim_* cosines of its query vector with each page's unit summed query vector, over the
    current page, the block and the window, standardised by sim_norm; and the intent filter:
    each state's predicted queries spread their scores over query clusters (share e_t); a
    forward filter over the window (oldest first) multiplies the belief in cluster c by
    1 + kappa(c) e_t(c) (cluster_kappa) and, between states, keeps `keep`
    (`keep_block` across a block start) of itself, the rest moved through the policy's
    successor kernel (uniform without one); `intent_mass` is the
    candidate's cluster's final belief (off-interest pages weighed against the earlier ones,
    which the score averages cannot do), `page_cluster_share` the current page's share in it;
    `shown_recent`: shown_recent().
    Padding candidates are all zeros. Compiled kernels (`feature_kernels`) do the arithmetic.
    The constants (block_gap_s, recency_gamma, keep, keep_block, shown_decay) are the policy's
    FeatureFit, carried by `clusters` (DEFAULT_FIT without clusters).
    """
    from personalization import feature_kernels as fk

    B, K = ids.shape[:2]
    ids = np.ascontiguousarray(ids, np.int64)
    state_mask = np.ascontiguousarray(state_mask, np.bool_)
    if sim_table is not None and sim_norm is None:
        raise ValueError("sim_table needs sim_norm, the (mean, sd) of its raw cosines")
    cand_ids = fk.candidates(ids, state_mask)
    has_sim = sim_table is not None
    has_cl = clusters is not None
    fit = clusters.fit if clusters is not None else DEFAULT_FIT
    succ, succ_p, rest = clusters.successors() if clusters is not None else NO_SUCCESSORS
    feats, zz = fk.features(
        np.ascontiguousarray(z, np.float32),
        ids,
        np.ascontiguousarray(scores, np.float32),
        state_mask,
        np.zeros((B, K)) if ts is None else np.ascontiguousarray(ts, np.float64),
        float(fit.block_gap_s),
        recency_weights(K, fit.recency_gamma),
        np.ascontiguousarray(log_pop, np.float32),
        cand_ids,
        np.ascontiguousarray(sim_table, np.float32) if has_sim else _NO_SIM,
        np.asarray(sim_norm if has_sim else (0.0, 1.0), np.float32),
        has_sim,
        clusters.lookup if clusters is not None else _NO_LOOKUP,
        clusters.kappa if clusters is not None else _NO_KAPPA,
        has_cl,
        float(fit.keep),
        float(fit.keep_block),
        succ,
        succ_p,
        rest,
        N_KERNEL,
    )
    feats = np.concatenate(
        [feats, shown_recent(cand_ids, shown, state_mask, fit.shown_decay)[..., None]], -1
    )
    return EventBatch(
        z=zz, state_mask=state_mask, cand_ids=cand_ids, cand_mask=cand_ids >= 0, feats=feats
    )


def shown_recent(
    cand_ids: np.ndarray, shown: np.ndarray | None, state_mask: np.ndarray, decay: float
) -> np.ndarray:
    """float32 [B,C]: per candidate, sum over the window's earlier visits that showed it of
    decay^(visits back - 1) (the visit before the current one counts 1). What the user was
    shown lately changes what a repeat earns (a tired reader clicks a repeat less; one still
    on the interest may click it again): the sign and size are the scorer's to learn, the
    decay is fitted on the logs (personalization.fit_filter)."""
    from personalization import feature_kernels as fk

    if shown is None:
        return np.zeros(cand_ids.shape, np.float32)
    return fk.shown_recent(
        np.ascontiguousarray(cand_ids, np.int64),
        np.ascontiguousarray(shown, np.int64),
        np.ascontiguousarray(state_mask, np.bool_),
        np.float32(decay),
    )


_NO_SIM = np.zeros((1, SIM_DIM), np.float32)
_NO_LOOKUP = np.full(1, -1, np.int64)
_NO_KAPPA = np.ones(1, np.float64)
# (succ, succ_p, rest) of a filter without a fitted successor kernel: what is not kept of the
# belief goes uniformly to every cluster (feature_kernels._carry)
NO_SUCCESSORS = (np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float64), np.zeros(0))


@dataclass(frozen=True)
class Clusters:
    """A policy's query clusters as the intent filter reads them, with its fitted constants."""

    lookup: np.ndarray  # int64 [L+1] cluster of every query id, -1 last (padding id -1 gathers it)
    kappa: np.ndarray  # float64 [n] odds factor per unit of a page's evidence for each cluster
    fit: FeatureFit = DEFAULT_FIT  # block gap, keep rates, recency decay
    # the successor kernel: where an interest that is not kept goes (Successors; None: uniform)
    kernel: Successors | None = None

    def successors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(succ, succ_p, rest) as the compiled filter reads them."""
        return successor_arrays(self.kernel)


@dataclass(frozen=True)
class Successors:
    """A sparse successor kernel over n clusters: T(j, c) = rest[j] / n + sum_r succ_p[j, r]
    [succ[j, r] = c], each cluster's r likeliest successors explicit, the rest of its mass
    spread uniformly; fitted on the page sequences of a policy's logs
    (personalization.fit_filter.fit_successors) and stored in its weights as float32
    `cluster_succ` (ids) and `cluster_succ_p` [n, r]."""

    succ: np.ndarray  # int64 [n, r]
    succ_p: np.ndarray  # float64 [n, r], float32 values (as stored)
    rest: np.ndarray  # float64 [n]: 1 - the row's sum of succ_p

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.succ, self.succ_p, self.rest

    def dense(self) -> np.ndarray:
        """float64 [n, n] T."""
        n = self.succ.shape[0]
        T = np.repeat(self.rest[:, None] / n, n, 1)
        np.add.at(
            T, (np.repeat(np.arange(n), self.succ.shape[1]), self.succ.ravel()), self.succ_p.ravel()
        )
        return T

    def weights(self) -> dict[str, np.ndarray]:
        return {
            "cluster_succ": self.succ.astype(np.float32),
            "cluster_succ_p": self.succ_p.astype(np.float32),
        }

    @classmethod
    def from_weights(cls, succ: np.ndarray, succ_p: np.ndarray, n: int) -> Successors:
        """From the stored arrays; ValueError naming what is wrong (shapes, ids outside the
        clusters, probabilities outside [0, 1] or rows summing above 1)."""
        succ, p = np.asarray(succ), np.asarray(succ_p, np.float32).astype(np.float64)
        if succ.ndim != 2 or succ.shape[0] != n or p.shape != succ.shape:
            raise ValueError(
                f"cluster_succ / cluster_succ_p have shapes {succ.shape} / {p.shape}, "
                f"{n} clusters need ({n}, r) both"
            )
        if not np.all(np.isfinite(succ)) or np.any(succ != np.round(succ)):
            raise ValueError("cluster_succ must hold cluster ids")
        ids = succ.astype(np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise ValueError(f"cluster_succ holds ids outside 0..{n - 1}")
        rows = p.sum(1)
        if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(rows > 1 + 1e-5):
            raise ValueError("cluster_succ_p must be probabilities in [0, 1], rows summing to <= 1")
        return cls(ids, p, np.maximum(1.0 - rows, 0.0))


def successor_arrays(kernel: Successors | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(succ, succ_p, rest) of a kernel for the compiled filter (NO_SUCCESSORS: uniform)."""
    return NO_SUCCESSORS if kernel is None else kernel.arrays()


def query_lookup(query_cluster: np.ndarray) -> np.ndarray:
    """int64 [L+1] cluster of every query id with -1 last (the padding id -1 gathers it) from a
    float32 `query_cluster` [L]."""
    return np.append(np.asarray(query_cluster).astype(np.int64), np.int64(-1))


def cluster_lookup(weights: dict) -> Clusters | None:
    """The Clusters of a policy's float32 `query_cluster` [L] and `cluster_kappa` [n] weights,
    its FeatureFit (under FIT_KEY; the defaults for a policy without one; a policy without
    `cluster_kappa` filters with INTENT_KAPPA for every cluster) and its successor kernel
    (`cluster_succ`, `cluster_succ_p`; uniform without them); cached in `weights` (None: no
    clusters). ValueError if they disagree on the number of clusters."""
    if "_cl" not in weights:
        qc = weights.get("query_cluster")
        if qc is None:
            weights["_cl"] = None
        else:
            lookup = query_lookup(qc)
            n = max(int(lookup.max()) + 1, 1)
            kap = weights.get("cluster_kappa")
            kappa = np.full(n, INTENT_KAPPA) if kap is None else np.asarray(kap, np.float64)
            if kappa.shape != (n,):
                raise ValueError(f"cluster_kappa has shape {kappa.shape}, {n} clusters need ({n},)")
            fit = weights.get(FIT_KEY)
            ff = DEFAULT_FIT if fit is None else FeatureFit.from_array(fit)
            succ, succ_p = weights.get("cluster_succ"), weights.get("cluster_succ_p")
            kern = None
            if succ is not None and succ_p is not None:
                kern = Successors.from_weights(succ, succ_p, n)
            elif succ is not None or succ_p is not None:
                raise ValueError("cluster_succ and cluster_succ_p come together")
            weights["_cl"] = Clusters(lookup, kappa, ff, kern)
    return weights["_cl"]


def cluster_share(ids: np.ndarray, scores: np.ndarray, lookup: np.ndarray) -> np.ndarray:
    """float64 [n] each cluster's share of the evidence of the page views ids / scores [V,k]
    (one row per view, so pages count by traffic; each view's clustered scores sum to 1, a view
    with none does not count)."""
    n = max(int(lookup.max()) + 1, 1)
    ids = np.asarray(ids, np.int64)
    sc = np.where(ids >= 0, np.asarray(scores, np.float64), 0.0)
    cid = lookup[ids]
    sc = np.where(cid >= 0, sc, 0.0)
    share = sc / np.maximum(sc.sum(1, keepdims=True), 1e-12)  # each view's evidence sums to 1
    used = sc.sum(1) > 0
    ok = (cid >= 0) & used[:, None]
    return np.bincount(cid[ok], weights=share[ok], minlength=n)[:n] / max(int(used.sum()), 1)


def kappa_of_share(share: np.ndarray, fit: FeatureFit = DEFAULT_FIT) -> np.ndarray:
    """float32 [n] the odds factor of each cluster from its share of the evidence:
    kappa_scale x max(n x share, kappa_floor) ^ -kappa_power. A page's likelihood ratio for an
    interest falls with how often such pages are seen anyway (a page of a cluster everyone reads
    says less about this reader than one of a niche); how steeply, and the floor, are fitted."""
    n = max(len(share), 1)
    rel = np.maximum(n * np.asarray(share, np.float64), fit.kappa_floor)
    return (fit.kappa_scale * rel ** (-fit.kappa_power)).astype(np.float32)


def cluster_kappa(
    ids: np.ndarray, scores: np.ndarray, lookup: np.ndarray, fit: FeatureFit = DEFAULT_FIT
) -> np.ndarray:
    """float32 [n] the intent filter's odds factor of each cluster over the page views ids /
    scores [V,k]: kappa_of_share of cluster_share (with the defaults: INTENT_KAPPA x the
    uniform share 1/n over the cluster's share, floored at KAPPA_FLOOR / n)."""
    return kappa_of_share(cluster_share(ids, scores, lookup), fit)


# The fixed `sim_rank` ranking (evaluate's reference row, and the policy's starting point):
# raw sim_block cosine + 0.1 x frac_states + 0.1 x mean window score, chosen on a validation
# split of the training period.
SIM_RANK = {"sim_block": 1.0, "frac_states": 0.1, "mean_score_window": 0.1}


def sim_rank_weights(sim_norm: np.ndarray) -> np.ndarray:
    """[N_FEATURES] weights w with feats @ w = the sim_rank key up to a per-event constant
    (sim_* columns are standardised, so a raw cosine's weight is multiplied by their sd)."""
    w = np.zeros(N_FEATURES, np.float32)
    for name, c in SIM_RANK.items():
        w[F[name]] = c * (float(sim_norm[1]) if name.startswith("sim_") else 1.0)
    return w


def log_popularity(counts: np.ndarray) -> np.ndarray:
    """Normalised log popularity in [0, 1] from raw per-query counts."""
    counts = np.asarray(counts, np.float64)
    top = np.log1p(counts.max()) if counts.size and counts.max() > 0 else 1.0
    return (np.log1p(counts) / top).astype(np.float32)
