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
)
F = {name: i for i, name in enumerate(FEATURE_NAMES)}
if F["sim_window"] != 13 or FEATURE_NAMES[-2:] != ("intent_mass", "page_cluster_share"):
    raise ImportError("feature_kernels.features writes the columns in FEATURE_NAMES' order")
N_FEATURES = len(FEATURE_NAMES)
RECENCY_GAMMA = 0.7
BLOCK_GAP_S = 30 * 60  # a gap this long between two visits starts a new block ("session")
SIM_DIM = 32  # size of the query vectors behind the sim_* features
N_SIM = 3  # the sim_* features are columns 11 .. 13
N_INTENT = 2  # the intent_* / page_cluster_* features are the last two columns
# The filter behind intent_mass: a page whose predicted queries put share e(c) of their score in
# query cluster c multiplies the odds of intent c by 1 + INTENT_KAPPA e(c); across a block start
# (a gap >= BLOCK_GAP_S: a new session) the belief keeps INTENT_KEEP_BLOCK of itself (the rest
# uniform), between views of one block INTENT_KEEP. Chosen on tuning worlds, where the rule
# "intent_mass + 0.05 score_current" comes near the window's Bayes-optimal choice (figures in
# docs/decisions.md). INTENT_KAPPA is the factor of a cluster with the uniform share of the
# traffic; cluster_kappa scales it per cluster, inverse to the share, floored at KAPPA_FLOOR x
# uniform (the floor's exact value hardly matters).
INTENT_KAPPA = 20.0
KAPPA_FLOOR = 0.5
INTENT_KEEP_BLOCK = 0.7
INTENT_KEEP = 0.95


class _Recency(dict):
    """gamma^(age) weights per window length K, computed once."""

    def __missing__(self, K):
        w = (RECENCY_GAMMA ** (K - 1 - np.arange(K))).astype(np.float32)
        self[K] = w
        return w


_RECENCY = _Recency()


@dataclass
class EventBatch:
    """Padded arrays for B events with up to K states each (slot K-1 = current page)."""

    z: np.ndarray  # float32 [B, K, D+1]: L2-normalised page features, then a 1 where
    # the state starts a block (long gap before it); zeros in padding
    state_mask: np.ndarray  # bool [B, K], True for real states (right-aligned)
    cand_ids: np.ndarray  # int64 [B, C], candidate query ids, -1 in padding
    cand_mask: np.ndarray  # bool [B, C]
    feats: np.ndarray  # float32 [B, C, N_FEATURES]


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
) -> EventBatch:
    """Candidates (union of the window's top-k ids) and their features for a padded batch.

    z [B,K,D], ids [B,K,k] (-1 = none, each row sorted by descending score), scores [B,K,k],
    state_mask [B,K] right-aligned, log_pop [L] = normalised log popularity per query id,
    ts [B,K] visit times in seconds (None = all one block), sim_table [L+1,d] unit query vectors
    (`sim_table_from_rows`) and sim_norm [2] the (mean, sd) of their raw cosines (None = the
    sim_* features stay 0), clusters the policy's `cluster_lookup` (None = the intent
    features stay 0).

    The features (FEATURE_NAMES): the Astec score / presence of each candidate averaged over
    the states with weights for the current page, the previous one, the window (uniform), by
    recency (RECENCY_GAMMA^age) and over the current block (the states since the last gap of
    BLOCK_GAP_S); its inverse rank on the current page, popularity and the window's fill; the
    sim_* cosines of its query vector with each page's unit summed query vector, over the
    current page, the block and the window, standardised by sim_norm; and the intent filter:
    each state's predicted queries spread their scores over query clusters (share e_t); a
    forward filter over the window (oldest first) multiplies the belief in cluster c by
    1 + kappa(c) e_t(c) (cluster_kappa) and, between states, keeps INTENT_KEEP
    (INTENT_KEEP_BLOCK across a block start) of itself, the rest uniform; `intent_mass` is the
    candidate's cluster's final belief (off-interest pages weighed against the earlier ones,
    which the score averages cannot do), `page_cluster_share` the current page's share in it.
    Padding candidates are all zeros. Compiled kernels (`feature_kernels`) do the arithmetic.
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
    feats, zz = fk.features(
        np.ascontiguousarray(z, np.float32),
        ids,
        np.ascontiguousarray(scores, np.float32),
        state_mask,
        np.zeros((B, K)) if ts is None else np.ascontiguousarray(ts, np.float64),
        float(BLOCK_GAP_S),
        _RECENCY[K],
        np.ascontiguousarray(log_pop, np.float32),
        cand_ids,
        np.ascontiguousarray(sim_table, np.float32) if has_sim else _NO_SIM,
        np.asarray(sim_norm if has_sim else (0.0, 1.0), np.float32),
        has_sim,
        clusters.lookup if clusters is not None else _NO_LOOKUP,
        clusters.kappa if clusters is not None else _NO_KAPPA,
        has_cl,
        INTENT_KEEP,
        INTENT_KEEP_BLOCK,
        N_FEATURES,
    )
    return EventBatch(
        z=zz, state_mask=state_mask, cand_ids=cand_ids, cand_mask=cand_ids >= 0, feats=feats
    )


_NO_SIM = np.zeros((1, SIM_DIM), np.float32)
_NO_LOOKUP = np.full(1, -1, np.int64)
_NO_KAPPA = np.ones(1, np.float64)


@dataclass(frozen=True)
class Clusters:
    """A policy's query clusters as the intent filter reads them."""

    lookup: np.ndarray  # int64 [L+1] cluster of every query id, -1 last (padding id -1 gathers it)
    kappa: np.ndarray  # float64 [n] odds factor per unit of a page's evidence for each cluster


def query_lookup(query_cluster: np.ndarray) -> np.ndarray:
    """int64 [L+1] cluster of every query id with -1 last (the padding id -1 gathers it) from a
    float32 `query_cluster` [L]."""
    return np.append(np.asarray(query_cluster).astype(np.int64), np.int64(-1))


def cluster_lookup(weights: dict) -> Clusters | None:
    """The Clusters of a policy's float32 `query_cluster` [L] and `cluster_kappa` [n] weights
    (a policy without `cluster_kappa` filters with INTENT_KAPPA for every cluster); cached in
    `weights` (None: no clusters). ValueError if the two disagree on the number of clusters."""
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
            weights["_cl"] = Clusters(lookup, kappa)
    return weights["_cl"]


def cluster_kappa(ids: np.ndarray, scores: np.ndarray, lookup: np.ndarray) -> np.ndarray:
    """float32 [n] the intent filter's odds factor of each cluster: INTENT_KAPPA x the uniform
    share 1/n over the cluster's share of the evidence of the page views ids / scores [V,k]
    (one row per view, so pages count by traffic), that share floored at KAPPA_FLOOR / n.

    A page's likelihood ratio for an interest is inverse to how often such pages are seen
    anyway: in the simulator 1 + a / (1 - a) / pop(s), off-interest views being popular pages;
    in real traffic a page of a cluster everyone reads says less about this reader than one of
    a niche. A flat factor lets the busiest clusters win on off-interest pages; scaled this
    way the fixed ranking fitted on the logs closes more of the gap to bayes_window
    (docs/decisions.md)."""
    n = max(int(lookup.max()) + 1, 1)
    ids = np.asarray(ids, np.int64)
    sc = np.where(ids >= 0, np.asarray(scores, np.float64), 0.0)
    cid = lookup[ids]
    sc = np.where(cid >= 0, sc, 0.0)
    share = sc / np.maximum(sc.sum(1, keepdims=True), 1e-12)  # each view's evidence sums to 1
    used = sc.sum(1) > 0
    ok = (cid >= 0) & used[:, None]
    pop = np.bincount(cid[ok], weights=share[ok], minlength=n)[:n] / max(int(used.sum()), 1)
    return (INTENT_KAPPA / n / np.maximum(pop, KAPPA_FLOOR / n)).astype(np.float32)


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
