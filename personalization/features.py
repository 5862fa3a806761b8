"""Candidate queries and their hand features for a batch of events, in numpy only.

Training (torch) and serving (numpy) both call `build_batch`, so the features a model was
trained on are bit-for-bit the ones it is served with. Everything is vectorised over the batch:
events are left-padded to K states (the current page is always the last slot), and the union of
the states' top-k query ids is found with one sort per row instead of per-event Python sets.
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
N_FEATURES = len(FEATURE_NAMES)
RECENCY_GAMMA = 0.7
BLOCK_GAP_S = 30 * 60  # a gap this long between two visits starts a new block ("session")
SIM_DIM = 32  # size of the query vectors behind the sim_* features
N_SIM = 3  # the sim_* features are columns n_sel + 3 .. n_sel + 5
N_INTENT = 2  # the intent_* / page_cluster_* features are the last two columns
# The filter behind intent_mass: a page whose predicted queries put share e(c) of their score in
# query cluster c multiplies the odds of intent c by 1 + INTENT_KAPPA e(c); across a block start
# (a gap >= BLOCK_GAP_S: a new session) the belief keeps INTENT_KEEP_BLOCK of itself (the rest
# uniform), between views of one block INTENT_KEEP. Chosen on worlds 21/22 (docs/
# personalization.md): the rule "intent_mass + 0.05 score_current" earns 0.130 there against
# the window's Bayes-optimal 0.1365 and most frequent's 0.114. INTENT_KAPPA is the factor of a
# cluster with the uniform share of the traffic; cluster_kappa scales it per cluster, inverse to
# the share, floored at KAPPA_FLOOR x uniform (0.25 and 0.5 gave the same on worlds 22-26).
INTENT_KAPPA = 20.0
KAPPA_FLOOR = 0.5
INTENT_KEEP_BLOCK = 0.7
INTENT_KEEP = 0.95
# (weight column, score/presence) of the first 8 features in the batched window averages
_SEL_W = np.array([0, 0, 1, 2, 2, 3, 4, 4])
_SEL_S = np.array([0, 1, 0, 0, 1, 0, 0, 1])
_SIM_W = np.array([0, 4, 2])  # weight columns of sim_current, sim_block, sim_window


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


def block_starts(ts: np.ndarray, state_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts [B,K] bool: state follows a gap >= BLOCK_GAP_S or is the first,
    in_block [B,K] bool: state is in the current page's block)."""
    _B, K = state_mask.shape
    starts = state_mask.copy()
    if K > 1:
        starts[:, 1:] &= ~state_mask[:, :-1] | (ts[:, 1:] - ts[:, :-1] >= BLOCK_GAP_S)
    # a state is in the current block if no block starts after it
    later = np.flip(np.cumsum(np.flip(starts, 1), axis=1), 1) - starts
    return starts, state_mask & (later == 0)


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


def _sim_features(
    sim_table: np.ndarray,
    sim_norm: np.ndarray,
    ids: np.ndarray,
    cand_ids: np.ndarray,
    Wt: np.ndarray,
) -> np.ndarray:
    """[B,C,3] standardised cosines of each candidate's vector with the current page's, the
    block's and the window's mean query vectors: two gathers and two small batched matmuls
    (padding ids are -1 and gather the table's zero last row)."""
    m = normalise_rows(sim_table[ids].sum(2))  # [B,K,d] page vectors
    S = np.matmul(sim_table[cand_ids], m.transpose(0, 2, 1))  # [B,C,K]
    out = np.matmul(S, Wt[:, :, _SIM_W])  # [B,C,3]
    out -= sim_norm[0]
    out *= 1.0 / sim_norm[1]
    return out


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
    """
    B, K, k = ids.shape
    flat = np.where(state_mask[:, :, None], ids, -1).reshape(B, K * k)
    order = np.argsort(flat, axis=1, kind="stable")
    rows = np.arange(B)[:, None]
    srt = flat[rows, order]
    first = np.empty(srt.shape, bool)
    first[:, 0] = True
    np.not_equal(srt[:, 1:], srt[:, :-1], out=first[:, 1:])
    first &= srt >= 0
    cidx_sorted = np.cumsum(first, axis=1) - 1  # candidate index of each sorted entry
    C = max(int(cidx_sorted[:, -1].max()) + 1 if B else 0, 1)
    cand_ids = np.full((B, C), -1, np.int64)
    bf, jf = np.nonzero(first)
    cand_ids[bf, cidx_sorted[bf, jf]] = srt[bf, jf]
    cand_mask = cand_ids >= 0
    # scatter every valid (event, state, slot) entry into its candidate column
    bv, jv = np.nonzero(srt >= 0)
    pos = order[bv, jv]  # flat position = state * k + slot
    tt, jj = np.divmod(pos, k)
    cc = cidx_sorted[bv, jv]
    bb = bv
    # score / presence of every candidate in every state: SP [B, K, 2, C]
    SP = np.zeros((B, K, 2, C), np.float32)
    SP[bb, tt, 0, cc] = scores[bb, tt, jj]
    SP[bb, tt, 1, cc] = 1.0
    Rk = np.zeros((B, C), np.float32)
    cur = tt == K - 1
    Rk[bb[cur], cc[cur]] = 1.0 / (1.0 + jj[cur])
    if ts is None:
        starts = np.zeros_like(state_mask)
        starts[np.arange(B), np.argmax(state_mask, 1)] = True
        in_block = state_mask
    else:
        starts, in_block = block_starts(ts, state_mask)
    # per-state weights [B, K, 5]: current, previous, uniform, recency, current block; one
    # batched matmul then gives every window average of scores and presences at once
    Wt = np.zeros((B, K, 5), np.float32)
    Wt[:, K - 1, 0] = 1.0
    if K > 1:
        Wt[:, K - 2, 1] = state_mask[:, K - 2]
    n_states = np.maximum(state_mask.sum(1, keepdims=True), 1).astype(np.float32)
    Wt[:, :, 2] = state_mask / n_states
    rec = _RECENCY[K][None, :] * state_mask
    Wt[:, :, 3] = rec / np.maximum(rec.sum(1, keepdims=True), 1e-9)
    Wt[:, :, 4] = in_block / np.maximum(in_block.sum(1, keepdims=True), 1)
    G = np.matmul(Wt.transpose(0, 2, 1), SP.reshape(B, K, 2 * C)).reshape(B, 5, 2, C)
    feats = np.empty((B, C, N_FEATURES), np.float32)
    n_sel = len(_SEL_W)
    feats[..., :n_sel] = G[:, _SEL_W, _SEL_S, :].transpose(0, 2, 1)
    feats[..., n_sel] = Rk
    feats[..., n_sel + 1] = log_pop[np.where(cand_mask, cand_ids, 0)]
    feats[..., n_sel + 2] = n_states / K
    if sim_table is not None:
        if sim_norm is None:
            raise ValueError("sim_table needs sim_norm, the (mean, sd) of its raw cosines")
        feats[..., n_sel + 3 : n_sel + 3 + N_SIM] = _sim_features(
            sim_table, sim_norm, flat.reshape(B, K, k), cand_ids, Wt
        )
    else:
        feats[..., n_sel + 3 : n_sel + 3 + N_SIM] = 0.0
    if clusters is not None:
        feats[..., -N_INTENT:] = intent_features(
            flat.reshape(B, K, k), scores, state_mask, starts, cand_ids, clusters
        )
    else:
        feats[..., -N_INTENT:] = 0.0
    feats *= cand_mask[..., None]
    zz = np.empty((*z.shape[:2], z.shape[2] + 1), np.float32)
    zz[..., :-1] = normalise_rows(z) * state_mask[..., None]
    zz[..., -1] = starts
    return EventBatch(
        z=zz, state_mask=state_mask, cand_ids=cand_ids, cand_mask=cand_mask, feats=feats
    )


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
    a niche. A flat factor let the busiest clusters win on off-interest pages; scaled this way
    the fixed ranking fitted on the logs closed 0.36-0.87 -> 0.74-0.88 of the gap to
    bayes_window on worlds 22-26 (docs/personalization.md)."""
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


def intent_features(
    ids: np.ndarray,
    scores: np.ndarray,
    state_mask: np.ndarray,
    starts: np.ndarray,
    cand_ids: np.ndarray,
    clusters: Clusters,
) -> np.ndarray:
    """[B,C,2] (intent_mass, page_cluster_share) of every candidate.

    Each state's predicted queries spread their scores over query clusters (share e_t); a
    forward filter over the window (oldest first) multiplies the belief in cluster c by
    1 + kappa(c) e_t(c) (cluster_kappa) and, between states, keeps INTENT_KEEP
    (INTENT_KEEP_BLOCK across a block start) of itself, the rest uniform. A candidate's
    intent_mass is its cluster's final belief: what the window says about the user's current
    interest, with off-interest pages weighed against the earlier ones, which the score
    averages cannot do. K steps on [B, n] arrays; the evidence is one bincount."""
    B, K, _ = ids.shape
    lookup = clusters.lookup
    n = len(clusters.kappa)
    cid = lookup[ids]  # [B,K,k]; padding id -1 gathers -1
    ok = (cid >= 0) & state_mask[:, :, None]
    flat = (np.arange(B * K).reshape(B, K, 1) * n + cid)[ok]
    E = np.bincount(flat, weights=scores[ok], minlength=B * K * n).reshape(B, K, n)
    E = E / np.maximum(E.sum(2, keepdims=True), 1e-9)
    lik = 1.0 + clusters.kappa * E
    keep = np.where(starts, INTENT_KEEP_BLOCK, INTENT_KEEP)[:, :, None]
    # states are right-aligned: a padding state (E = 0) and the first real one meet a uniform
    # belief, which mixing leaves uniform, so no mask is needed; the belief is normalised once
    # at the end (mixing toward uniform uses its current total)
    belief = np.ones((B, n))
    for t in range(K):  # K sequential steps on [B,n] blocks
        total = belief.sum(1, keepdims=True)
        belief = keep[:, t] * belief + (1.0 - keep[:, t]) * (total / n)
        belief *= lik[:, t]
    belief /= belief.sum(1, keepdims=True)
    cc = lookup[cand_ids]  # [B,C]
    has = cc >= 0
    safe = np.maximum(cc, 0)
    out = np.empty((*cand_ids.shape, 2), np.float32)
    out[..., 0] = np.take_along_axis(belief, safe, 1) * has
    out[..., 1] = np.take_along_axis(E[:, K - 1], safe, 1) * has
    return out


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
