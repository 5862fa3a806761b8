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
    "score_current",      # Astec score of the query on the current page (0 if absent)
    "in_current",         # 1 if the query is in the current page's top-k
    "score_previous",     # Astec score on the previous page (0 if absent / no previous page)
    "mean_score_window",  # mean Astec score over the window's states (0 where absent)
    "frac_states",        # fraction of the window's states whose top-k holds the query
    "recency_score",      # score averaged with weights gamma^(age) over the window
    "mean_score_block",   # mean score over the current block (states since the last long gap)
    "frac_block",         # fraction of the current block's states whose top-k holds the query
    "inv_rank_current",   # 1 / (1 + rank) on the current page (0 if absent)
    "log_popularity",     # log1p(global count) / log1p(max count)
    "window_fill",        # number of states in the window / K
)
F = {name: i for i, name in enumerate(FEATURE_NAMES)}
N_FEATURES = len(FEATURE_NAMES)
RECENCY_GAMMA = 0.7
BLOCK_GAP_S = 30 * 60   # a gap this long between two visits starts a new block ("session")
# (weight column, score/presence) of the first 8 features in the batched window averages
_SEL_W = np.array([0, 0, 1, 2, 2, 3, 4, 4])
_SEL_S = np.array([0, 1, 0, 0, 1, 0, 0, 1])


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

    z: np.ndarray          # float32 [B, K, D+1]: L2-normalised page features, then a 1 where
                           # the state starts a block (long gap before it); zeros in padding
    state_mask: np.ndarray  # bool [B, K], True for real states (right-aligned)
    cand_ids: np.ndarray   # int64 [B, C], candidate query ids, -1 in padding
    cand_mask: np.ndarray  # bool [B, C]
    feats: np.ndarray      # float32 [B, C, N_FEATURES]


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
        z[b, K - n:] = zs[-n:]
        ids[b, K - n:, :kk] = ii[-n:]
        scores[b, K - n:, :kk] = ss[-n:]
        mask[b, K - n:] = True
        ts[b, K - n:] = tt[-n:]
    return z, ids, scores, mask, ts


def normalise_rows(x: np.ndarray) -> np.ndarray:
    """L2-normalise the last axis in float32 (zero rows stay zero)."""
    x = np.asarray(x, np.float32)
    n = np.sqrt((x * x).sum(-1, keepdims=True))
    return x / np.maximum(n, 1e-6)


def block_starts(ts: np.ndarray, state_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts [B,K] bool: state follows a gap >= BLOCK_GAP_S or is the first,
        in_block [B,K] bool: state is in the current page's block)."""
    B, K = state_mask.shape
    starts = state_mask.copy()
    if K > 1:
        starts[:, 1:] &= ~state_mask[:, :-1] | (ts[:, 1:] - ts[:, :-1] >= BLOCK_GAP_S)
    # a state is in the current block if no block starts after it
    later = np.flip(np.cumsum(np.flip(starts, 1), axis=1), 1) - starts
    return starts, state_mask & (later == 0)


def build_batch(z: np.ndarray, ids: np.ndarray, scores: np.ndarray, state_mask: np.ndarray,
                log_pop: np.ndarray, ts: np.ndarray | None = None) -> EventBatch:
    """Candidates (union of the window's top-k ids) and their features for a padded batch.

    z [B,K,D], ids [B,K,k] (-1 = none, each row sorted by descending score), scores [B,K,k],
    state_mask [B,K] right-aligned, log_pop [L] = normalised log popularity per query id,
    ts [B,K] visit times in seconds (None = all one block).
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
    cidx_sorted = np.cumsum(first, axis=1) - 1          # candidate index of each sorted entry
    C = max(int(cidx_sorted[:, -1].max()) + 1 if B else 0, 1)
    cand_ids = np.full((B, C), -1, np.int64)
    bf, jf = np.nonzero(first)
    cand_ids[bf, cidx_sorted[bf, jf]] = srt[bf, jf]
    cand_mask = cand_ids >= 0
    # scatter every valid (event, state, slot) entry into its candidate column
    bv, jv = np.nonzero(srt >= 0)
    pos = order[bv, jv]                      # flat position = state * k + slot
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
    feats *= cand_mask[..., None]
    zz = np.empty(z.shape[:2] + (z.shape[2] + 1,), np.float32)
    zz[..., :-1] = normalise_rows(z) * state_mask[..., None]
    zz[..., -1] = starts
    return EventBatch(z=zz, state_mask=state_mask, cand_ids=cand_ids,
                      cand_mask=cand_mask, feats=feats)


def log_popularity(counts: np.ndarray) -> np.ndarray:
    """Normalised log popularity in [0, 1] from raw per-query counts."""
    counts = np.asarray(counts, np.float64)
    top = np.log1p(counts.max()) if counts.size and counts.max() > 0 else 1.0
    return (np.log1p(counts) / top).astype(np.float32)
