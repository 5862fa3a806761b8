"""Compiled (numba) kernels behind `features.build_batch`.

A policy serves one event at a time as often as in batches; as numpy, one event's features were
~80 small calls whose dispatch cost ~150 us against a few microseconds of arithmetic. These
kernels loop over the events once, in float32 like the numpy code they replace (the intent
filter in float64), so training and serving still share one implementation. Compiled on first
use and cached on disk (numba's cache): a new process pays a fraction of a second at load.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_EPS_NORM = np.float32(1e-6)
_EPS_REC = np.float32(1e-9)


@njit(cache=True, nogil=True, boundscheck=False)
def candidates(ids, mask):
    """(cand_ids [B, C] int64, -1 padding): the distinct ids >= 0 of each event's real states
    (ids [B, K, k], mask [B, K]), ascending; C >= 1 is the largest count."""
    B, K, k = ids.shape
    buf = np.empty((B, K * k), np.int64)
    counts = np.zeros(B, np.int64)
    tmp = np.empty(K * k, np.int64)
    for b in range(B):
        m = 0
        for t in range(K):
            if not mask[b, t]:
                continue
            for j in range(k):
                q = ids[b, t, j]
                if q >= 0:
                    tmp[m] = q
                    m += 1
        s = np.sort(tmp[:m])
        c = 0
        for i in range(m):
            if i == 0 or s[i] != s[i - 1]:
                buf[b, c] = s[i]
                c += 1
        counts[b] = c
    C = max(counts.max() if B else 0, 1)
    out = np.full((B, C), -1, np.int64)
    for b in range(B):
        out[b, : counts[b]] = buf[b, : counts[b]]
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def _block_starts(mask, ts, block_gap, starts):
    """starts[t] (bool [K]) of one window: the first real state, or one after a gap >=
    block_gap."""
    for t in range(mask.shape[0]):
        starts[t] = mask[t] and (t == 0 or not mask[t - 1] or ts[t] - ts[t - 1] >= block_gap)


@njit(cache=True, nogil=True, boundscheck=False)
def _carry(belief, kp, succ, succ_p, rest, out):
    """out = the belief carried over one step: kp of itself, the rest through the successor
    kernel (succ / succ_p [n, r]: each cluster's r likeliest successors and their
    probabilities, rest [n]: the share of each cluster's mass spread uniformly); a kernel of
    another row count than the belief's: uniform, as before kernels were fitted."""
    n_cl = belief.shape[0]
    if succ.shape[0] != n_cl:
        tot = 0.0
        for e in range(n_cl):
            tot += belief[e]
        mix = (1.0 - kp) * (tot / n_cl)
        for e in range(n_cl):
            out[e] = kp * belief[e] + mix
        return
    spread = 0.0
    for j in range(n_cl):
        spread += belief[j] * rest[j]
    mix = (1.0 - kp) * (spread / n_cl)
    for e in range(n_cl):
        out[e] = kp * belief[e] + mix
    for j in range(n_cl):
        bj = (1.0 - kp) * belief[j]
        if bj != 0.0:
            for r in range(succ.shape[1]):
                out[succ[j, r]] += bj * succ_p[j, r]


@njit(cache=True, nogil=True, boundscheck=False)
def _evidence(ids, scores, mask, lookup, E):
    """E [K, n]: each state's share of its clustered score per cluster (ids / scores [K, k])."""
    K, k = ids.shape
    n_cl = E.shape[1]
    for t in range(K):
        tot = 0.0
        for e in range(n_cl):
            E[t, e] = 0.0
        if mask[t]:
            for j in range(k):
                q = ids[t, j]
                if q >= 0:
                    g = lookup[q]
                    if g >= 0:
                        E[t, g] += np.float64(scores[t, j])
            for e in range(n_cl):
                tot += E[t, e]
        tot = max(tot, 1e-9)
        for e in range(n_cl):
            E[t, e] = E[t, e] / tot


@njit(cache=True, nogil=True, boundscheck=False)
def _filter(
    ids, scores, mask, starts, lookup, kappa, keep, keep_block, succ, succ_p, rest, E, belief, nb
):
    """The intent filter over one window (ids / scores [K, k], mask / starts [K]): E [K, n] gets
    each state's share of its clustered score per cluster, belief [n] the unnormalised forward
    belief (uniform start; per state, oldest first: keep (keep_block at a block start) of
    itself, the rest through the successor kernel (_carry; uniform without one), times
    1 + kappa(c) E[t, c]); returns belief's sum. nb [n]: scratch. With a kernel, the belief
    is carried only from the window's first real state on (a uniform start stays uniform)."""
    K = ids.shape[0]
    n_cl = kappa.shape[0]
    _evidence(ids, scores, mask, lookup, E)
    fitted = succ.shape[0] == n_cl
    for e in range(n_cl):
        belief[e] = 1.0
    started = False
    for t in range(K):
        kp = keep_block if starts[t] else keep
        if started or not fitted:
            _carry(belief, kp, succ, succ_p, rest, nb)
            for e in range(n_cl):
                belief[e] = nb[e] * (1.0 + kappa[e] * E[t, e])
        else:
            for e in range(n_cl):
                belief[e] = belief[e] * (1.0 + kappa[e] * E[t, e])
        started = started or mask[t]
    tot = 0.0
    for e in range(n_cl):
        tot += belief[e]
    return tot


@njit(cache=True, nogil=True, boundscheck=False)
def intent_mass(
    ids, scores, mask, ts, block_gap, lookup, kappa, keep, keep_block, succ, succ_p, rest, target
):
    """(mass [B], share [B]) float64: the filtered belief in cluster target[b] at the end of
    each window and the current page's share in it (0 where target[b] < 0): the intent_mass /
    page_cluster_share of `features` for one query per event, without the other features
    (personalization.fit_filter evaluates many filter settings on the same windows)."""
    B, K = ids.shape[:2]
    n_cl = kappa.shape[0]
    mass = np.zeros(B)
    share = np.zeros(B)
    starts = np.zeros(K, np.bool_)
    E = np.zeros((K, n_cl))
    belief = np.zeros(n_cl)
    nb = np.zeros(n_cl)
    for b in range(B):
        g = target[b]
        if g < 0:
            continue
        _block_starts(mask[b], ts[b], block_gap, starts)
        tot = _filter(
            *(ids[b], scores[b], mask[b], starts, lookup, kappa, keep, keep_block),
            *(succ, succ_p, rest, E, belief, nb),
        )
        mass[b] = belief[g] / tot
        share[b] = E[K - 1, g]
    return mass, share


@njit(cache=True, nogil=True, boundscheck=False)
def features(
    z,
    ids,
    scores,
    mask,
    ts,
    block_gap,
    recency,
    log_pop,
    cand,
    sim_table,
    sim_norm,
    has_sim,
    lookup,
    kappa,
    has_clusters,
    keep,
    keep_block,
    succ,
    succ_p,
    rest,
    n_features,
):
    """(feats [B, C, n_features] float32, zz [B, K, D + 2 + n] float32) of
    `features.build_batch`: its column order (FEATURE_NAMES), its weights and its padding rules,
    one event at a time; zz is the GRU's input (features.gru_input_dim)."""
    B, K, k = ids.shape
    D = z.shape[2]
    C = cand.shape[1]
    d = sim_table.shape[1]
    n_cl = kappa.shape[0]
    feats = np.zeros((B, C, n_features), np.float32)
    zz = np.zeros((B, K, D + 2 + n_cl), np.float32)
    Sc = np.zeros((K, C), np.float32)  # score of each candidate in each state
    Pr = np.zeros((K, C), np.float32)  # its presence
    Rk = np.zeros(C, np.float32)
    starts = np.zeros(K, np.bool_)
    in_block = np.zeros(K, np.bool_)
    w_uni = np.zeros(K, np.float32)
    w_rec = np.zeros(K, np.float32)
    w_blk = np.zeros(K, np.float32)
    pages = np.zeros((K, d), np.float32)
    E = np.zeros((K, n_cl), np.float64)
    belief = np.zeros(n_cl, np.float64)
    nb = np.zeros(n_cl, np.float64)
    for b in range(B):
        nc = 0
        while nc < C and cand[b, nc] >= 0:
            nc += 1
        # states: block starts (first real state, or a gap >= block_gap), the current block
        n_states = 0
        for t in range(K):
            if mask[b, t]:
                n_states += 1
        _block_starts(mask[b], ts[b], block_gap, starts)
        later = False
        n_blk = 0
        for t in range(K - 1, -1, -1):
            in_block[t] = mask[b, t] and not later
            if in_block[t]:
                n_blk += 1
            later = later or starts[t]
        n_f = np.float32(max(n_states, 1))
        rsum = _F0
        for t in range(K):
            w_uni[t] = (_F1 if mask[b, t] else _F0) / n_f
            w_rec[t] = recency[t] if mask[b, t] else _F0
            rsum += w_rec[t]
            w_blk[t] = (_F1 if in_block[t] else _F0) / np.float32(max(n_blk, 1))
        rsum = max(rsum, _EPS_REC)
        for t in range(K):
            w_rec[t] = w_rec[t] / rsum
        # every (state, slot) entry into its candidate's column (a later slot wins a repeat)
        for t in range(K):
            for c in range(nc):
                Sc[t, c] = _F0
                Pr[t, c] = _F0
        for c in range(nc):
            Rk[c] = _F0
        mine = cand[b, :nc]
        for t in range(K):
            if not mask[b, t]:
                continue
            for j in range(k):
                q = ids[b, t, j]
                if q < 0:
                    continue
                c = np.searchsorted(mine, q)  # q is among the event's candidates
                Sc[t, c] = scores[b, t, j]
                Pr[t, c] = _F1
                if t == K - 1:
                    Rk[c] = _F1 / (_F1 + np.float32(j))
        prev_w = _F1 if K > 1 and mask[b, K - 2] else _F0
        for c in range(nc):
            f = feats[b, c]
            f[0] = Sc[K - 1, c]
            f[1] = Pr[K - 1, c]
            f[2] = prev_w * Sc[K - 2, c] if K > 1 else _F0
            s_uni = _F0
            p_uni = _F0
            s_rec = _F0
            s_blk = _F0
            p_blk = _F0
            for t in range(K):
                s_uni += w_uni[t] * Sc[t, c]
                p_uni += w_uni[t] * Pr[t, c]
                s_rec += w_rec[t] * Sc[t, c]
                s_blk += w_blk[t] * Sc[t, c]
                p_blk += w_blk[t] * Pr[t, c]
            f[3] = s_uni
            f[4] = p_uni
            f[5] = s_rec
            f[6] = s_blk
            f[7] = p_blk
            f[8] = Rk[c]
            f[9] = log_pop[cand[b, c]]
            f[10] = n_f / np.float32(K)
        if has_sim:
            # each page's unit summed query vector; each candidate's cosine with it, averaged
            # over the current page, the block and the window, then standardised
            for t in range(K):
                for e in range(d):
                    pages[t, e] = _F0
                if not mask[b, t]:
                    continue
                for j in range(k):
                    q = ids[b, t, j]
                    if q >= 0:
                        for e in range(d):
                            pages[t, e] += sim_table[q, e]
                nrm = _F0
                for e in range(d):
                    nrm += pages[t, e] * pages[t, e]
                nrm = max(np.sqrt(nrm), _EPS_NORM)
                for e in range(d):
                    pages[t, e] = pages[t, e] / nrm
            inv_sd = _F1 / sim_norm[1]
            for c in range(nc):
                row = sim_table[cand[b, c]]
                cur = _F0
                blk = _F0
                win = _F0
                for t in range(K):
                    if not mask[b, t]:
                        continue
                    s = _F0
                    for e in range(d):
                        s += row[e] * pages[t, e]
                    if t == K - 1:
                        cur = s
                    blk += w_blk[t] * s
                    win += w_uni[t] * s
                f = feats[b, c]
                f[11] = (cur - sim_norm[0]) * inv_sd
                f[12] = (blk - sim_norm[0]) * inv_sd
                f[13] = (win - sim_norm[0]) * inv_sd
        if has_clusters:
            tot = _filter(
                *(ids[b], scores[b], mask[b], starts, lookup, kappa, keep, keep_block),
                *(succ, succ_p, rest, E, belief, nb),
            )
            for c in range(nc):
                g = lookup[cand[b, c]]
                if g >= 0:
                    feats[b, c, n_features - 2] = np.float32(belief[g] / tot)
                    feats[b, c, n_features - 1] = np.float32(E[K - 1, g])
        # the GRU's inputs (zeros in padding): unit page features, the block-start flag, the
        # log of the minutes to the next state (0 on the current page) and the page's share of
        # evidence per query cluster (the intent filter's E; zeros without clusters)
        for t in range(K):
            if not mask[b, t]:
                continue
            nrm = _F0
            for e in range(D):
                nrm += z[b, t, e] * z[b, t, e]
            nrm = max(np.sqrt(nrm), _EPS_NORM)
            for e in range(D):
                zz[b, t, e] = z[b, t, e] / nrm
            zz[b, t, D] = _F1 if starts[t] else _F0
            if t < K - 1:
                gap = max(ts[b, t + 1] - ts[b, t], 0.0)
                zz[b, t, D + 1] = np.float32(np.log1p(gap / 60.0))
            if has_clusters:
                for e in range(n_cl):
                    zz[b, t, D + 2 + e] = np.float32(E[t, e])
    return feats, zz


@njit(cache=True, nogil=True, boundscheck=False)
def _last_pair(ids, scores, mask, ts, block_gap, lookup, starts, e):
    """For one window (ids / scores [K, k], mask / ts [K]) whose last two states are real:
    e [n] <- the last state's clustered scores, starts <- its block starts, and the sum of e
    returned (0: the window has no such pair with clustered evidence, e and starts unset)."""
    K = ids.shape[0]
    if K < 2 or not mask[K - 1] or not mask[K - 2]:
        return 0.0
    for j in range(e.shape[0]):
        e[j] = 0.0
    tot_e = 0.0
    for j in range(ids.shape[1]):
        q = ids[K - 1, j]
        if q >= 0 and lookup[q] >= 0:
            e[lookup[q]] += np.float64(scores[K - 1, j])
            tot_e += np.float64(scores[K - 1, j])
    if tot_e > 0.0:
        _block_starts(mask, ts, block_gap, starts)
    return tot_e


@njit(cache=True, nogil=True, boundscheck=False)
def _before_last(
    ids,
    scores,
    mask,
    starts,
    kp,
    lookup,
    kappa,
    keep,
    keep_block,
    succ,
    succ_p,
    rest,
    E,
    belief,
    nb,
    pred,
):
    """One window (ids / scores [K, k], mask / starts [K]): belief <- the filter over all but
    its last page, pred <- that belief carried over the last step (keep rate kp); returns
    belief's sum."""
    K = ids.shape[0]
    tot = _filter(
        *(ids[: K - 1], scores[: K - 1], mask[: K - 1], starts[: K - 1]),
        *(lookup, kappa, keep, keep_block, succ, succ_p, rest, E, belief, nb),
    )
    _carry(belief, kp, succ, succ_p, rest, pred)
    return tot


@njit(cache=True, nogil=True, boundscheck=False)
def page_prediction(
    ids, scores, mask, ts, block_gap, lookup, kappa, keep, keep_block, succ, succ_p, rest
):
    """(sum, count) over the windows whose last page has clustered evidence and an earlier
    page: log of sum_c b(c) (1 + kappa(c) e(c)) / sum_c (1 + kappa(c) e(c)) / n, the last
    page's evidence e under the filter's belief b from the pages before it, carried over the
    last step (keep, keep_block at a block start; the rest through the successor kernel where
    one is given), against the uniform belief: how much better than knowing nothing the filter
    predicts where the next page's interest lies. (Without a kernel the belief is carried
    twice over the last step, as when the keep rates of earlier policies were fitted.)"""
    B, K = ids.shape[:2]
    n_cl = kappa.shape[0]
    fitted = succ.shape[0] == n_cl
    starts = np.zeros(K, np.bool_)
    prior = np.zeros(K, np.bool_)
    E = np.zeros((K, n_cl))
    belief = np.zeros(n_cl)
    nb = np.zeros(n_cl)
    pred = np.zeros(n_cl)
    e = np.zeros(n_cl)
    total = 0.0
    count = 0
    for b in range(B):
        tot_e = _last_pair(ids[b], scores[b], mask[b], ts[b], block_gap, lookup, starts, e)
        if tot_e <= 0.0:
            continue
        kp = keep_block if starts[K - 1] else keep
        num = 0.0
        den = 0.0
        if fitted:
            tot = _before_last(
                *(ids[b], scores[b], mask[b], starts, kp, lookup, kappa, keep, keep_block),
                *(succ, succ_p, rest, E, belief, nb, pred),
            )
            for j in range(n_cl):
                lr = 1.0 + kappa[j] * e[j] / tot_e
                num += pred[j] / tot * lr
                den += lr / n_cl
        else:
            for t in range(K):
                prior[t] = mask[b, t] and t < K - 1
            tot = _filter(
                *(ids[b], scores[b], prior, starts, lookup, kappa, keep, keep_block),
                *(succ, succ_p, rest, E, belief, nb),
            )
            for j in range(n_cl):
                lr = 1.0 + kappa[j] * e[j] / tot_e
                num += (kp * belief[j] / tot + (1.0 - kp) / n_cl) * lr
                den += lr / n_cl
        total += np.log(num / den)
        count += 1
    return total, count


@njit(cache=True, nogil=True, boundscheck=False)
def successor_counts(
    ids, scores, mask, ts, block_gap, lookup, kappa, keep, keep_block, succ, succ_p, rest, T
):
    """float64 [n, n]: the expected number of intent moves j -> c between the last two pages of
    the windows page_prediction reads, under the filter with this kernel (uniform where none
    is given; T [n, n] the same kernel dense, features.Successors.dense): the belief b from the
    pages before the last, times the move's probability (1 - keep) T(j, c), times the last
    page's odds 1 + kappa(c) e(c), normalised per window. One E-step of fitting the kernel to
    the page sequence (personalization.fit_filter)."""
    B, K = ids.shape[:2]
    n_cl = kappa.shape[0]
    counts = np.zeros((n_cl, n_cl))
    starts = np.zeros(K, np.bool_)
    E = np.zeros((K, n_cl))
    belief = np.zeros(n_cl)
    nb = np.zeros(n_cl)
    pred = np.zeros(n_cl)
    e = np.zeros(n_cl)
    lr = np.zeros(n_cl)
    for b in range(B):
        tot_e = _last_pair(ids[b], scores[b], mask[b], ts[b], block_gap, lookup, starts, e)
        if tot_e <= 0.0:
            continue
        kp = keep_block if starts[K - 1] else keep
        _before_last(
            *(ids[b], scores[b], mask[b], starts, kp, lookup, kappa, keep, keep_block),
            *(succ, succ_p, rest, E, belief, nb, pred),
        )
        z = 0.0
        for c in range(n_cl):
            lr[c] = 1.0 + kappa[c] * e[c] / tot_e
            z += pred[c] * lr[c]
        if z <= 0.0:
            continue
        for j in range(n_cl):
            w = (1.0 - kp) * belief[j] / z
            if w == 0.0:
                continue
            for c in range(n_cl):
                counts[j, c] += w * T[j, c] * lr[c]
    return counts


@njit(cache=True, nogil=True, boundscheck=False)
def shown_recent(cand, shown, mask, decay):
    """float32 [B, C] of `features.shown_recent`: per candidate (cand [B, C]), decay^(visits
    back - 1) summed over the window's earlier real states (mask [B, K]) whose shown query
    (shown [B, K], -1 none) it is; the current slot K - 1 is not read."""
    B, C = cand.shape
    K = shown.shape[1]
    out = np.zeros((B, C), np.float32)
    for b in range(B):
        w = _F1
        for t in range(K - 2, -1, -1):
            q = shown[b, t]
            if mask[b, t] and q >= 0:
                for c in range(C):
                    if cand[b, c] == q:
                        out[b, c] += w
            w = w * decay
    return out
