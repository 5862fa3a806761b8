"""Compiled (numba) kernels of the predictor's single-text path.

One title is a few hundred numbers: as numpy, its ~60 small calls cost more in dispatch than in
arithmetic (~120 us of a ~290 us prediction, besides the two graph searches), and each
compiled call still costs ~2 us. So a model of one learner with float32 classifier rows takes a
title in two calls around the two graph searches (`title_front`, `title_back`, which chain the
stage kernels below); ensembles and float16 rows call the stages one by one. Arithmetic in
float32 like the batch path (sums may be ordered differently, so scores can differ in the last
bits); the tests hold the kernels to the torch model and to the batch path. Compiled on first
use and cached on disk (numba's cache), so a new process pays a fraction of a second at load,
not seconds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from engine.hnsw_graph import search_one

_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_CLIP = np.float32(30.0)


@njit(cache=True, nogil=True, boundscheck=False)
def bag_features(idx, val, E, D):
    """(vv [W], q [1, D]): vv = ReLU(sum_j val_j E[idx_j]) over the fused table E [V, W]
    (W = D, or 2D with the re-ranker's embeddings), q = vv[:D] scaled to unit length (the
    shortlist's query)."""
    W = E.shape[1]
    vv = np.zeros(W, np.float32)
    for j in range(idx.size):
        row = E[idx[j]]
        a = val[j]
        for d in range(W):
            vv[d] += a * row[d]
    nrm = _F0
    for d in range(W):
        if vv[d] < _F0:
            vv[d] = _F0
    for d in range(D):
        nrm += vv[d] * vv[d]
    nrm = np.sqrt(nrm)
    q = np.empty((1, D), np.float32)
    for d in range(D):
        q[0, d] = vv[d] / nrm if nrm > _F0 else vv[d]
    return vv, q


@njit(cache=True, nogil=True, boundscheck=False)
def _touch(T, rows, n):
    """Read one float per cache line of the rows T[rows[i]] for i < n.

    The rows are scattered over tables far larger than the caches, and the dot products that
    follow would fetch them one after another; these loads are independent, so the CPU keeps
    many in flight at once, which shortens the scoring with cold caches."""
    t = _F0
    for i in range(n):
        row = T[rows[i]]
        for d in range(0, row.size, 16):
            t += row[d]
    return t


@njit(cache=True, nogil=True, boundscheck=False, fastmath=True)
def _residual(v, RT, off, D, out):
    """out = v + ReLU(R v) for v = vv[off:off+D], from R's transpose RT [D, D] (row d of RT is
    column d of R): v is a ReLU output, about half zeros, so only its non-zero entries' rows
    are read."""
    h = np.zeros(D, np.float32)
    for d in range(D):
        a = v[off + d]
        if a != _F0:
            row = RT[d]
            for e in range(D):
                h[e] += a * row[e]
    for e in range(D):
        out[e] = v[off + e] + max(h[e], _F0)


@njit(cache=True, nogil=True, boundscheck=False)
def residual_features(vv, RT, RrT, D, has_rr):
    """(z [D], z~ [D]): the classifier's and (if has_rr) the re-ranker's features from vv."""
    z = np.empty(D, np.float32)
    zr = np.zeros(D, np.float32)
    _residual(vv, RT, 0, D, z)
    if has_rr:
        _residual(vv, RrT, D, D, zr)
    return z, zr


@njit(cache=True, nogil=True, boundscheck=False)
def graph_hits(
    q, k, ef, codes, scale, links0, count0, upper_indptr, upper, labels, entry, max_level,
    visited, stamp, hd, hi, members_indptr, members,
):  # fmt: skip
    """(ids int64 [k'], sims float32 [k']) of one graph search for q [D] (engine.hnsw_graph,
    over distinct vectors, best first), each distinct vector expanded to its original ids in
    ascending order (members_indptr of size 1: no duplicates) keeping the first k, as
    AnnSearch.query does for a batch."""
    hit, sim = search_one(  # at most min(k, distinct vectors) hits
        q, k, ef, codes, scale, links0, count0, upper_indptr, upper, labels, entry,
        max_level, visited, stamp, hd, hi,
    )  # fmt: skip
    if members_indptr.size <= 1:
        return hit, sim
    total = 0
    for j in range(hit.size):
        u = hit[j]
        total += members_indptr[u + 1] - members_indptr[u]
    n = min(total, k)
    ids = np.empty(n, np.int64)
    sims = np.empty(n, np.float32)
    m = 0
    for j in range(hit.size):
        u = hit[j]
        for p in range(members_indptr[u], members_indptr[u + 1]):
            if m == n:
                return ids, sims
            ids[m] = members[p]
            sims[m] = sim[j]
            m += 1
    return ids, sims


@njit(cache=True, nogil=True, boundscheck=False)
def shortlist(
    pids,
    psims,
    point_indptr,
    point_labels,
    point_values,
    cids,
    csims,
    centre_owner,
    prior,
    prior_score,
    acc,
    mu,
    centroid_weight,
    knn_power,
    shortlist_size,
):
    """(labels ascending, s) of one query, as engine.predictor's ServingLearner.base_scores
    computes them for a row.

    s = (1-c) * sum over the k nearest training points of their normalised similarity times the
    point's label value + c * the best similarity among the label's nearest centres; prior
    labels always get their tiny base score. acc and mu are zeroed [L] scratch arrays: only the
    touched labels are read and reset, so the cost does not grow with L.
    """
    n_lab = 0
    for j in range(pids.size):
        n_lab += point_indptr[pids[j] + 1] - point_indptr[pids[j]]
    cand = np.empty(n_lab + cids.size + prior.size, np.int64)
    m = 0
    ws = np.empty(pids.size, np.float32)
    den = _F0
    for j in range(pids.size):
        s = max(psims[j], _F0)
        if knn_power != 1.0:
            s = s ** np.float32(knn_power)
        ws[j] = s
        den += s
    if den <= _F0:
        den = _F1
    for j in range(pids.size):
        w = ws[j] / den
        for p in range(point_indptr[pids[j]], point_indptr[pids[j] + 1]):
            lab = point_labels[p]
            acc[lab] += w * point_values[p]
            cand[m] = lab
            m += 1
    for j in range(cids.size):
        o = centre_owner[cids[j]]
        s = max(csims[j], _F0)
        if s > mu[o]:
            mu[o] = s
        cand[m] = o
        m += 1
    for j in range(prior.size):
        cand[m] = prior[j]
        m += 1
    cand = np.sort(cand[:m])
    a, b = np.float32(1.0 - centroid_weight), np.float32(centroid_weight)
    c = np.empty(m, np.int64)
    sv = np.empty(m, np.float32)
    n = 0
    for j in range(m):
        if j > 0 and cand[j] == cand[j - 1]:
            continue
        lab = cand[j]
        c[n] = lab
        sv[n] = a * acc[lab] + b * mu[lab]
        acc[lab] = _F0
        mu[lab] = _F0
        n += 1
    if prior.size:
        pos = np.searchsorted(c[:n], prior)
        for j in range(prior.size):
            sv[pos[j]] += prior_score[j]
    kept = 0
    for j in range(n):
        if sv[j] != _F0:
            c[kept] = c[j]
            sv[kept] = sv[j]
            kept += 1
    c, sv = c[:kept], sv[:kept]
    if kept <= shortlist_size:
        return c, sv
    # keep the best shortlist_size (ties: lower label); prior labels cut from the top stay
    # scored with their prior score alone
    order = np.argsort(-sv, kind="mergesort")  # c is ascending: stable = lower label first
    keep = np.zeros(kept, np.bool_)
    keep[order[:shortlist_size]] = True
    s2 = sv.copy()
    if prior.size:
        for j in order[shortlist_size:]:
            i = np.searchsorted(prior, c[j])
            if i < prior.size and prior[i] == c[j]:
                keep[j] = True
                s2[j] = prior_score[i]
    sel = np.flatnonzero(keep)
    return c[sel], s2[sel]


@njit(cache=True, nogil=True, boundscheck=False)
def _sigmoid(x):
    x = min(max(x, -_CLIP), _CLIP)
    return _F1 / (_F1 + np.exp(-x))


@njit(cache=True, nogil=True, boundscheck=False, fastmath=True)
def _dot(row, off, z, D):
    a = _F0
    for d in range(D):
        a += row[off + d] * z[d]
    return a


@njit(cache=True, nogil=True, boundscheck=False)
def combine_scores(Wc, rows, bc, labels, s, z, zr, alpha, beta, D, has_rr):
    """(y [n], a number to ignore): the paper's combination for candidates `labels` with
    shortlist scores s:
    y = beta * (alpha * sig(w.z + b) + (1-alpha) * sig(s)) + (1-beta) * sig(w~.z~ + b~),
    with (w | w~) = Wc[rows[i]] (the fused float32 classifier rows) and (b, b~) = bc[labels[i]];
    without a re-ranker the last term is dropped."""
    n = labels.size
    y = np.empty(n, np.float32)
    t = _touch(Wc, rows, n)
    al, be = np.float32(alpha), np.float32(beta)
    for i in range(n):
        row = Wc[rows[i]]
        lab = labels[i]
        yy = al * _sigmoid(_dot(row, 0, z, D) + bc[lab, 0]) + (_F1 - al) * _sigmoid(s[i])
        if has_rr:
            yy = be * yy + (_F1 - be) * _sigmoid(_dot(row, D, zr, D) + bc[lab, 1])
        y[i] = yy
    return y, t  # returning t keeps the touching loads from being optimised away


@njit(cache=True, nogil=True, boundscheck=False)
def top_k(labels, y, k):
    """(ids int64 [k], scores float32 [k]) best first, ties to the lower label; labels must be
    ascending. Slots past the candidates hold -1 / 0."""
    ids = np.full(k, -1, np.int64)
    sc = np.zeros(k, np.float32)
    if k <= 0:
        return ids, sc
    n = 0
    for i in range(labels.size):  # insertion into a sorted top-k: k is small
        v = y[i]
        if n == k and not v > sc[k - 1]:
            continue
        j = n if n < k else k - 1
        while j > 0 and v > sc[j - 1]:  # strictly greater: an earlier (lower) label keeps a tie
            if j < k:
                ids[j] = ids[j - 1]
                sc[j] = sc[j - 1]
            j -= 1
        ids[j] = labels[i]
        sc[j] = v
        if n < k:
            n += 1
    return ids, sc


@njit(cache=True, nogil=True, boundscheck=False)
def _merge_dot(xidx, xval, x0, x1, widx, wval, a, b):
    """Dot product of two sparse rows with ascending ids (x[x0:x1], w[a:b]) by merging them."""
    s = _F0
    p, r = x0, a
    while p < x1 and r < b:
        fx, fw = xidx[p], widx[r]
        if fx == fw:
            s += wval[r] * xval[p]
            p += 1
            r += 1
        elif fx < fw:
            p += 1
        else:
            r += 1
    return s


@njit(cache=True, nogil=True, boundscheck=False)
def sparse_entry_scores(cptr, cidx, xptr, xidx, xval, wptr, widx, wval):
    """u_l . x_i for every candidate (i, l) of a CSR candidate pattern (cptr, cidx), in its entry
    order: the sparse ranker's scores. Rows of x and of the weights must have ascending feature
    ids. A short weight row is merged with x; a long one (frequent labels carry tens of
    thousands of weights) is binary-searched for x's ~15 features, so no candidate costs more
    than |x| log |u_l|. Both sum the matched terms in ascending feature order: same result."""
    out = np.zeros(cidx.size, np.float32)
    for i in range(cptr.size - 1):
        x0, x1 = xptr[i], xptr[i + 1]
        nx = x1 - x0
        if nx == 0:
            continue
        for q in range(cptr[i], cptr[i + 1]):
            lab = cidx[q]
            a, b = wptr[lab], wptr[lab + 1]
            s = _F0
            if b - a <= 8 * nx:
                s = _merge_dot(xidx, xval, x0, x1, widx, wval, a, b)
            else:
                lo = a
                for p in range(x0, x1):
                    f = xidx[p]
                    hi = b
                    while lo < hi:
                        mid = (lo + hi) >> 1
                        if widx[mid] < f:
                            lo = mid + 1
                        else:
                            hi = mid
                    if lo >= b:
                        break
                    if widx[lo] == f:
                        s += wval[lo] * xval[p]
                        lo += 1
            out[q] = s
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def sparse_scores_split(
    cptr, cidx, xptr, xidx, xval, wptr, widx, wval, tptr, tslot, tval, slot, hbias, bias_feature
):
    """sparse_entry_scores with the frequent labels' long weight rows served from their
    transpose: for each text, x's features (the bias excepted) are pushed through W_heavy^T
    (tptr/tslot/tval: feature -> heavy slot, weight) into a small accumulator, so a frequent
    label (tens of thousands of weights) costs one read instead of |x| bisections. Heavy label
    l has slot[l] >= 0 and bias weight hbias[slot]; the others are merged as in
    sparse_entry_scores. Terms are added in ascending feature order either way (the bias last),
    so the results equal sparse_entry_scores'."""
    out = np.zeros(cidx.size, np.float32)
    acc = np.zeros(hbias.size, np.float32)
    for i in range(cptr.size - 1):
        x0, x1 = xptr[i], xptr[i + 1]
        if x1 == x0:
            continue
        for p in range(x0, x1):
            f = xidx[p]
            if f == bias_feature:
                continue
            xv = xval[p]
            for t in range(tptr[f], tptr[f + 1]):
                acc[tslot[t]] += tval[t] * xv
        has_bias = xidx[x1 - 1] == bias_feature
        bx = xval[x1 - 1] if has_bias else _F0
        for q in range(cptr[i], cptr[i + 1]):
            lab = cidx[q]
            h = slot[lab]
            if h >= 0:
                s = acc[h]
                if has_bias:
                    s += hbias[h] * bx
                out[q] = s
                continue
            out[q] = _merge_dot(xidx, xval, x0, x1, widx, wval, wptr[lab], wptr[lab + 1])
        for p in range(x0, x1):  # reset what this text touched
            f = xidx[p]
            if f == bias_feature:
                continue
            for t in range(tptr[f], tptr[f + 1]):
                acc[tslot[t]] = _F0
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def sparse_mix_dense(
    labels, y, xidx, xval, xd, wptr, widx, wval, tptr, tslot, tval, slot, hbias, bias_feature, gamma
):
    """One text's sparse ranker folded into its candidates' scores, in place:
    y = gamma * y + (1 - gamma) * sigmoid(u_l . x) (the batch path's combination).

    x is scattered into xd, a zeroed float32 [F] scratch (reset before returning), so a short
    weight row is summed over its own entries (xd[f] = 0 where x has no f) without a merge's
    unpredictable branch per step (~30 weights a row, ~15 features a title; a debian-related
    title's CPU time p50 -3%, docs/benchmarks.md). The matched terms are added in the same
    ascending feature order as sparse_scores_split's merge, the others add zeros, so u is the
    batch path's bit for bit; the frequent labels' long rows are served from their transpose
    as there."""
    for p in range(xidx.size):
        xd[xidx[p]] = xval[p]
    acc = np.zeros(hbias.size, np.float32)
    nx = xidx.size
    has_bias = nx > 0 and xidx[nx - 1] == bias_feature
    if nx:
        for p in range(nx):
            f = xidx[p]
            if f == bias_feature:
                continue
            xv = xval[p]
            for t in range(tptr[f], tptr[f + 1]):
                acc[tslot[t]] += tval[t] * xv
    bx = xval[nx - 1] if has_bias else _F0
    g = np.float32(gamma)
    for q in range(labels.size):
        lab = labels[q]
        s = _F0
        if nx:
            h = slot[lab]
            if h >= 0:
                s = acc[h]
                if has_bias:
                    s += hbias[h] * bx
            else:
                for r in range(wptr[lab], wptr[lab + 1]):
                    s += wval[r] * xd[widx[r]]
        y[q] = g * y[q] + (_F1 - g) * _sigmoid(s)
    for p in range(nx):
        xd[xidx[p]] = _F0
    return y


# ---- label-name match (engine/label_text.py): single text, and batches row by row ----------
@njit(cache=True, nogil=True, boundscheck=False)
def _bitmap(ids):
    """A bitmap (int64 words) of non-negative ids: bit i of word w is id 64 w + i. It covers
    the largest id only; _has reads ids past it as absent."""
    top = -1
    for j in range(ids.size):
        top = max(top, ids[j])
    bits = np.zeros((top >> 6) + 1, np.int64)
    for j in range(ids.size):
        bits[ids[j] >> 6] |= np.int64(1) << (ids[j] & 63)
    return bits


@njit(cache=True, nogil=True, boundscheck=False)
def _has(bits, i):
    """Whether non-negative id i is in the bitmap of _bitmap."""
    w = i >> 6
    return w < bits.size and (bits[w] >> (i & 63)) & 1 != 0


@njit(cache=True, nogil=True, boundscheck=False)
def _name_match_bits(bits, piece, weight, lab):
    """_name_match with the title's ids as a bitmap (_bitmap of tids): each spelling is one
    load from a few hundred bytes instead of a binary search with unpredictable branches.
    Same components, same order of the sum: the same float32 result."""
    tot = _F0
    for c in range(piece.shape[1]):
        if piece[lab, c, 0] < 0:
            break
        best = _F0
        for a in range(piece.shape[2]):
            p = piece[lab, c, a]
            if p >= 0 and _has(bits, p) and weight[lab, c, a] > best:
                best = weight[lab, c, a]
        tot += best
    return tot


@njit(cache=True, nogil=True, boundscheck=False)
def _name_match(tids, piece, weight, lab):
    """match(title, label): per component, the best weight among its spellings in the sorted
    title ids tids, summed (LabelText.scores for one pair). A name's components come first and
    pads after (piece -1), so the walk stops at the first pad: the rest would add zeros, and a
    short name (most have one to three words) reads one cache line of piece, not two."""
    tot = _F0
    for c in range(piece.shape[1]):
        if piece[lab, c, 0] < 0:
            break
        best = _F0
        for a in range(piece.shape[2]):
            p = piece[lab, c, a]
            if p < 0:
                continue
            i = np.searchsorted(tids, p)
            if i < tids.size and tids[i] == p and weight[lab, c, a] > best:
                best = weight[lab, c, a]
        tot += best
    return tot


@njit(cache=True, nogil=True, boundscheck=False)
def name_candidates(tids, indptr, ilab, piece, weight, theta):
    """Ascending labels whose name the title (sorted ids tids) matches at least theta, found
    through the inverted index (indptr, ilab) of LabelText._index(theta)."""
    total = 0
    for j in range(tids.size):
        total += indptr[tids[j] + 1] - indptr[tids[j]]
    found = np.empty(total, np.int64)
    k = 0
    for j in range(tids.size):
        for q in range(indptr[tids[j]], indptr[tids[j] + 1]):
            found[k] = ilab[q]
            k += 1
    found = np.sort(found)
    out = np.empty(total, np.int64)
    n = 0
    lim = np.float32(theta) - np.float32(1e-6)
    bits = _bitmap(tids)
    for q in range(total):
        lab = found[q]
        if q > 0 and found[q - 1] == lab:
            continue
        if _name_match_bits(bits, piece, weight, lab) >= lim:
            out[n] = lab
            n += 1
    return out[:n]


@njit(cache=True, nogil=True, boundscheck=False)
def merge_candidates(labels, s, extra, s_extra):
    """Ascending candidates (labels, s) joined by the ascending labels extra not among them,
    which get base similarity s_extra."""
    out_l = np.empty(labels.size + extra.size, np.int64)
    out_s = np.empty(labels.size + extra.size, np.float32)
    i = j = n = 0
    while i < labels.size or j < extra.size:
        if j >= extra.size or (i < labels.size and labels[i] <= extra[j]):
            if j < extra.size and labels[i] == extra[j]:
                j += 1
            out_l[n] = labels[i]
            out_s[n] = s[i]
            i += 1
        else:
            out_l[n] = extra[j]
            out_s[n] = np.float32(s_extra)
            j += 1
        n += 1
    return out_l[:n], out_s[:n]


@njit(cache=True, nogil=True, boundscheck=False)
def add_name_match(labels, y, tids, piece, weight, delta):
    """y += delta * match(title, label) for each candidate, in place (a title without a word
    of any name adds zeros: skipped)."""
    if tids.size == 0:
        return
    d = np.float32(delta)
    bits = _bitmap(tids)
    for q in range(labels.size):
        y[q] += d * _name_match_bits(bits, piece, weight, labels[q])


@njit(cache=True, nogil=True, boundscheck=False)
def add_name_match_rows(rows, labels, y, tptr, tids, piece, weight, delta):
    """add_name_match for a batch: candidate q belongs to text rows[q], whose sorted title ids
    are tids[tptr[r]:tptr[r + 1]]."""
    d = np.float32(delta)
    for q in range(labels.size):
        r = rows[q]
        y[q] += d * _name_match(tids[tptr[r] : tptr[r + 1]], piece, weight, labels[q])


@njit(cache=True, nogil=True, boundscheck=False)
def name_candidates_rows(tptr, tids, indptr, ilab, piece, weight, theta):
    """(rows, labels) of name_candidates for each text of a batch, grouped by row."""
    parts = []
    total = 0
    for r in range(tptr.size - 1):
        c = name_candidates(tids[tptr[r] : tptr[r + 1]], indptr, ilab, piece, weight, theta)
        parts.append(c)
        total += c.size
    rows = np.empty(total, np.int64)
    labels = np.empty(total, np.int64)
    n = 0
    for r in range(len(parts)):
        c = parts[r]
        for q in range(c.size):
            rows[n] = r
            labels[n] = c[q]
            n += 1
    return rows, labels


# ---- one title's words -> each consumer's features (engine/title_words.py) --------------------
@njit(cache=True, nogil=True, boundscheck=False)
def title_tfidf(wids, unigram, pair_keys, pair_ids, idf, sublinear, bias):
    """(indices int64 ascending, values float32) of one title from its joint word ids: the
    TfidfVectorizer.transform_one row (features counted, tf (or 1 + ln tf) times idf, summed
    and scaled in float64 in ascending id order, then rounded to float32); bias >= 0 appends
    that feature with value 1 (the sparse ranker's bias)."""
    n = wids.size
    W = unigram.size
    ids = np.empty(2 * n, np.int64)
    m = 0
    for j in range(n):
        w = wids[j]
        if w >= 0 and unigram[w] >= 0:
            ids[m] = unigram[w]
            m += 1
    if pair_keys.size:
        for j in range(n - 1):
            a, b = wids[j], wids[j + 1]
            if a < 0 or b < 0:
                continue
            key = a * W + b
            p = np.searchsorted(pair_keys, key)
            if p < pair_keys.size and pair_keys[p] == key:
                ids[m] = pair_ids[p]
                m += 1
    ids = np.sort(ids[:m])
    extra = 1 if bias >= 0 else 0
    idx = np.empty(m + extra, np.int64)
    wt = np.empty(m, np.float64)
    u = 0
    j = 0
    while j < m:
        f = ids[j]
        c = 1
        while j + c < m and ids[j + c] == f:
            c += 1
        tf = 1.0 + np.log(np.float64(c)) if sublinear else np.float64(c)
        idx[u] = f
        wt[u] = tf * idf[f]
        u += 1
        j += c
    ss = 0.0
    for j in range(u):
        ss += wt[j] * wt[j]
    nrm = np.sqrt(ss)
    val = np.empty(u + extra, np.float32)
    for j in range(u):
        val[j] = np.float32(wt[j] / nrm)
    if extra:
        idx[u] = bias
        val[u] = _F1
    return idx[: u + extra], val


@njit(cache=True, nogil=True, boundscheck=False)
def title_name_ids(wids, name_ids):
    """Sorted unique label-name vocabulary ids of a title's words (LabelText.title_ids)."""
    out = np.empty(wids.size, np.int64)
    m = 0
    for j in range(wids.size):
        w = wids[j]
        if w >= 0 and name_ids[w] >= 0:
            out[m] = name_ids[w]
            m += 1
    out = np.sort(out[:m])
    u = 0
    for j in range(m):
        if j == 0 or out[j] != out[j - 1]:
            out[u] = out[j]
            u += 1
    return out[:u]


# ---- one title end to end, around the two graph searches (one learner, float32 rows) ----------
@njit(cache=True, nogil=True, boundscheck=False)
def title_front(
    wids,
    theta,
    nptr,
    nlab,
    vuni,
    vkeys,
    vids,
    vidf,
    vsub,
    E,
    D,
    RT,
    RrT,
    has_rr,
    runi,
    rkeys,
    rids,
    ridf,
    rsub,
    rbias,
    name_ids,
    piece,
    weight,
):
    """Everything a title needs before the graph searches, in one call (each call costs ~2 us
    of dispatch): (q [1, D], z, z~, ranker (idx, val), label-name ids, name candidates) from the
    joint word ids, as title_tfidf, bag_features, residual_features, title_name_ids and
    name_candidates give them. rbias < 0: no sparse ranker; name_ids empty: no name match;
    theta <= 0: no name candidates."""
    idx, val = title_tfidf(wids, vuni, vkeys, vids, vidf, vsub, -1)
    vv, q = bag_features(idx, val, E, D)
    z, zr = residual_features(vv, RT, RrT, D, has_rr)
    ridx = np.empty(0, np.int64)
    rval = np.empty(0, np.float32)
    if rbias >= 0:
        ridx, rval = title_tfidf(wids, runi, rkeys, rids, ridf, rsub, rbias)
    tids = np.empty(0, np.int64)
    if name_ids.size:
        tids = title_name_ids(wids, name_ids)
    extra = np.empty(0, np.int64)
    if theta > 0 and tids.size:
        extra = name_candidates(tids, nptr, nlab, piece, weight, theta)
    return q, z, zr, ridx, rval, tids, extra


@njit(cache=True, nogil=True, boundscheck=False)
def _touch_rest(labels, bc, piece, names, slot, wptr, widx, wval, ranker):
    """_touch for what the candidates read besides their classifier rows: biases, name pieces
    (names) and the sparse ranker's short rows (ranker). Scoring one candidate is a long loop,
    so the CPU barely looks ahead to the next one's loads; here they are all independent and
    in flight together (predict_one's CPU time p50 about -2% on debian-related titles)."""
    t = _F0
    for q in range(labels.size):
        lab = labels[q]
        t += bc[lab, 0]
        if names:
            t += np.float32(piece[lab, 0, 0])
        if ranker and slot[lab] < 0:
            for r in range(wptr[lab], wptr[lab + 1], 16):
                t += wval[r] + np.float32(widx[r])
    return t


@njit(cache=True, nogil=True, boundscheck=False)
def title_back(
    pids,
    psims,
    cids,
    csims,
    acc,
    mu,
    xd,
    z,
    zr,
    ridx,
    rval,
    tids,
    extra,
    k,
    centroid_weight,
    knn_power,
    shortlist_size,
    alpha,
    beta,
    gamma,
    delta,
    point_indptr,
    point_labels,
    point_values,
    centre_owner,
    prior,
    prior_score,
    s_extra,
    Wc,
    bc,
    D,
    has_rr,
    wptr,
    widx,
    wval,
    tptr,
    tslot,
    tval,
    slot,
    hbias,
    bias_feature,
    piece,
    weight,
):
    """Everything a title needs after the graph searches, in one call: shortlist, name
    candidates joined, classifier and re-ranker, sparse ranker (ridx empty: none), label-name
    match (delta <= 0: none) and the top k, as shortlist, merge_candidates, combine_scores,
    sparse_mix_dense, add_name_match and top_k give them. The title's own arrays, this
    thread's zeroed scratch (acc, mu, xd) and the model's scalars come first, its arrays after.
    Returns
    (ids, scores, a number to ignore)."""
    c, s = shortlist(
        pids,
        psims,
        point_indptr,
        point_labels,
        point_values,
        cids,
        csims,
        centre_owner,
        prior,
        prior_score,
        acc,
        mu,
        centroid_weight,
        knn_power,
        shortlist_size,
    )
    if extra.size:
        c, s = merge_candidates(c, s, extra, s_extra)
    t2 = _touch_rest(
        c, bc, piece, delta > 0 and tids.size > 0, slot, wptr, widx, wval, ridx.size > 0
    )
    y, t = combine_scores(Wc, c, bc, c, s, z, zr, alpha, beta, D, has_rr)
    t += t2
    if ridx.size:
        sparse_mix_dense(
            c,
            y,
            ridx,
            rval,
            xd,
            wptr,
            widx,
            wval,
            tptr,
            tslot,
            tval,
            slot,
            hbias,
            bias_feature,
            gamma,
        )
    if delta > 0:
        add_name_match(c, y, tids, piece, weight, delta)
    ids, sc = top_k(c, y, k)
    return ids, sc, t
