"""A synthetic web: topics and sub-topics, a query catalogue, pages (url, title) and
page -> queries.

Nobody outside a search engine has its click logs, so this builds a world with the statistics the
paper leans on: Zipfian popularity of pages and queries, short texts (titles 3-12 words, queries
1-6), a long tail of rare words (most of the vocabulary seen at most twice), and titles that
paraphrase their queries (synonyms, dropped words, filler) so bag-of-words overlap is partial.
Everything is vectorised numpy driven by one seed, so a world is reproducible and 1M queries take
seconds. `world_from_dataset` builds the same structure on real text (a TSV data set).

On disk (WORLD_DIR):
  world.json                   sizes, seed, source, generator settings
  queries.tsv                  id, text, topic, subtopic, popularity (header line first)
  pages.jsonl                  {id, url, title, topic, subtopic, popularity, queries,
                               query_weights[, split]}
  subtopics.tsv                subtopic, topic, name
  users.jsonl                  {user_id, activity}  (sessions per day)
  truth/user_interests.jsonl   {user_id, subtopics, weights}  (evaluation only: latent interests)
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

log = logging.getLogger(__name__)

# Syllables that spell the synthetic words; a word is its id written in base len(_SYL).
_SYL = np.array(
    [c + v for c in "bdfghklmnprstvwz" for v in "aeiou"] + ["ar", "el", "in", "on", "us"]
)
QUERY_LEN_P = np.array([0.12, 0.30, 0.28, 0.16, 0.09, 0.05])  # P(query has 1..6 words)
MAX_Q, MAX_T = 6, 12


@dataclass
class World:
    """Queries, pages, links and users; arrays are indexed by query / page / user id."""

    query_text: list[str]
    query_topic: np.ndarray
    query_subtopic: np.ndarray
    query_pop: np.ndarray  # sums to 1: how often the query is searched
    page_url: list[str]
    page_title: list[str]
    page_topic: np.ndarray
    page_subtopic: np.ndarray
    page_pop: np.ndarray  # sums to 1: how often the page is visited
    link_indptr: np.ndarray  # CSR rows = pages; queries of a page, strongest first
    link_query: np.ndarray
    link_weight: np.ndarray  # share of the page's search clicks per link (sums to 1 per page)
    subtopic_topic: np.ndarray
    subtopic_name: list[str]
    user_activity: np.ndarray  # sessions per day
    interest_indptr: np.ndarray  # truth: a user's latent interests (subtopics) and weights
    interest_subtopic: np.ndarray
    interest_weight: np.ndarray
    meta: dict = field(default_factory=dict)
    page_split: list[str] | None = None
    _keys: np.ndarray | None = field(default=None, repr=False)
    _head_score: np.ndarray | None = field(default=None, repr=False)  # simulator.clickmodel's

    @property
    def n_queries(self) -> int:
        return len(self.query_text)

    @property
    def n_pages(self) -> int:
        return len(self.page_title)

    @property
    def n_users(self) -> int:
        return len(self.user_activity)

    @property
    def n_subtopics(self) -> int:
        return len(self.subtopic_topic)

    def user_id(self, u) -> str:
        return f"u{int(u):07d}"

    def link_pages(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_pages), np.diff(self.link_indptr))

    def is_linked(self, page: np.ndarray, query: np.ndarray) -> np.ndarray:
        """Vectorised membership test: does `query` lead to `page`?"""
        if self._keys is None:
            self._keys = np.sort(
                self.link_pages().astype(np.int64) * self.n_queries + self.link_query
            )
        k = np.asarray(page, np.int64) * self.n_queries + np.asarray(query, np.int64)
        pos = np.minimum(np.searchsorted(self._keys, k), max(len(self._keys) - 1, 0))
        return (self._keys[pos] == k) if len(self._keys) else np.zeros(k.shape, bool)

    def top_queries(self, pages: np.ndarray, n: int) -> np.ndarray:
        """(len(pages), n) matrix of each page's n strongest queries, -1 padded."""
        pages = np.asarray(pages)
        start, cnt = self.link_indptr[pages], np.diff(self.link_indptr)[pages]
        j = np.arange(n)
        idx = start[:, None] + j[None, :]
        ok = j[None, :] < cnt[:, None]
        return np.where(ok, self.link_query[np.where(ok, idx, 0)], -1)


# ------------------------------------------------------------------------------------------------
# small vectorised helpers


def zipf_cdf(n: int, s: float) -> np.ndarray:
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    c = np.cumsum(w)
    return c / c[-1]


def zipf_weights(rng: np.random.Generator, n: int, s: float) -> np.ndarray:
    """Zipf popularity over ids in random rank order, normalised to sum to 1."""
    w = np.empty(n)
    w[rng.permutation(n)] = np.arange(1, n + 1, dtype=np.float64) ** -s
    return w / w.sum()


def _draw(rng, cdf: np.ndarray, size) -> np.ndarray:
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), len(cdf) - 1)


def sample_in_ranges(rng, weights: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each (lo, hi), draw an id in [lo, hi) with probability proportional to `weights`."""
    cw = np.concatenate([[0.0], np.cumsum(weights)])
    a, b = cw[lo], cw[hi]
    u = a + rng.random(len(lo)) * (b - a)
    return np.clip(np.searchsorted(cw, u, side="right") - 1, lo, np.maximum(hi - 1, lo))


def render_words(n_words: int, rng) -> np.ndarray:
    """Distinct pronounceable words of 2-4 random syllables (drawn, deduplicated, shuffled)."""
    B = len(_SYL)
    got = np.zeros(0, np.int64)
    while len(got) < n_words:
        m = int(1.3 * (n_words - len(got))) + 100
        nsyl = 2 + np.searchsorted([0.25, 0.8], rng.random(m), side="right")
        digits = rng.integers(0, B, (m, 4))
        code = np.zeros(m, np.int64)
        for d in range(4):  # mixed radix with the length folded in keeps codes distinct
            code = code * (B + 1) + np.where(d < nsyl, digits[:, d] + 1, 0)
        got = np.unique(np.concatenate([got, code]))
    code = rng.permutation(got)[:n_words]
    out = np.full(n_words, "", dtype="<U16")
    for d in range(3, -1, -1):
        digit = (code // (B + 1) ** d) % (B + 1)
        out = np.where(digit > 0, np.char.add(out, _SYL[np.maximum(digit - 1, 0)]), out)
    return out


def render_codes(n: int) -> np.ndarray:
    """Distinct rare tokens that look like model numbers or names ('kabo12')."""
    B = len(_SYL)
    j = np.arange(n, dtype=np.int64)
    return np.char.add(np.char.add(_SYL[j % B], _SYL[(j // B) % B]), (j // (B * B)).astype(str))


def render_rows(vocab: np.ndarray, W: np.ndarray) -> list[str]:
    """Join each row's word ids (-1 = padding) with spaces (one gather, then one join per row)."""
    flat = vocab[W[W >= 0]].tolist()
    ends = np.cumsum((W >= 0).sum(axis=1)).tolist()
    starts = [0, *ends[:-1]]
    return [" ".join(flat[i:j]) for i, j in zip(starts, ends, strict=True)]


def _row_dups(W: np.ndarray) -> np.ndarray:
    """Mask of entries equal to an earlier entry of the same row (padding ignored)."""
    eq = (W[:, :, None] == W[:, None, :]) & (W[:, :, None] >= 0)
    earlier = np.tril(np.ones((W.shape[1], W.shape[1]), bool), -1)
    return (eq & earlier[None]).any(axis=2)


def _row_hash(W: np.ndarray) -> np.ndarray:
    h = np.zeros(len(W), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(W.shape[1]):
            h = h * np.uint64(1_000_003) + (W[:, j] + 2).astype(np.uint64)
    return h


def _compact_left(W: np.ndarray) -> np.ndarray:
    """Move each row's non-padding entries to the front, keeping their order."""
    order = np.argsort(W < 0, axis=1, kind="stable")
    return np.take_along_axis(W, order, axis=1)


def _shuffle_rows(rng, W: np.ndarray) -> np.ndarray:
    keys = np.where(W >= 0, rng.random(W.shape), 2.0)
    return np.take_along_axis(W, np.argsort(keys, axis=1), axis=1)


# ------------------------------------------------------------------------------------------------
# users (shared by generated and dataset worlds)


def make_users(rng, n_users: int, subtopic_traffic: np.ndarray, subtopic_topic: np.ndarray):
    """Activity (sessions/day, lognormal) and 1-3 latent interests per user, correlated by topic."""
    activity = np.clip(rng.lognormal(np.log(1.2), 0.8, n_users), 0.1, 20.0)
    n_int = 1 + rng.binomial(2, 0.5, n_users)
    p = subtopic_traffic / subtopic_traffic.sum()
    cdf = np.cumsum(p)
    first = np.minimum(np.searchsorted(cdf, rng.random(n_users), side="right"), len(p) - 1)
    ints = np.minimum(np.searchsorted(cdf, rng.random((n_users, 3)), side="right"), len(p) - 1)
    ints[:, 0] = first
    # half of the secondary interests stay in the first interest's topic
    S = np.bincount(subtopic_topic).max()
    topic = subtopic_topic[first]
    same = rng.random((n_users, 3)) < 0.5
    sib = topic[:, None] * S + rng.integers(0, S, (n_users, 3))
    sib = np.minimum(sib, len(p) - 1)
    ints = np.where(same & (np.arange(3) > 0), sib, ints)
    ints = np.where(_row_dups(ints), -1, ints)
    mask = (np.arange(3)[None, :] < n_int[:, None]) & (ints >= 0)
    w = rng.dirichlet(np.ones(3), n_users) * mask
    w = w / w.sum(axis=1, keepdims=True)
    counts = mask.sum(axis=1)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return activity, indptr, ints[mask].astype(np.int32), w[mask]


def _pages_by_subtopic_weights(page_subtopic, page_pop, n_sub):
    return np.bincount(page_subtopic, weights=page_pop, minlength=n_sub) + 1e-12


# ------------------------------------------------------------------------------------------------
# generated world


def generate_world(
    n_queries: int = 50_000,
    n_pages: int = 100_000,
    n_users: int = 10_000,
    seed: int = 0,
    n_topics: int | None = None,
    subtopics_per_topic: int = 8,
    links_per_page: float = 5.0,
) -> World:
    """Build a synthetic world; deterministic in `seed`."""
    if n_queries < 10 or n_pages < 10 or n_users < 1:
        raise ValueError("need at least 10 queries, 10 pages and 1 user")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    T = n_topics or max(4, round(np.sqrt(n_queries) / 10))
    S = subtopics_per_topic
    NS = T * S
    q_per_sub = n_queries / NS
    Ws = 2 * int((40 + 0.5 * q_per_sub) // 2)  # words per subtopic pool (even: synonyms
    Wt = 2 * Ws  # pair ids 2i <-> 2i+1 inside a pool)
    G = 3000
    off_t, off_s = G, G + T * Wt
    V0 = off_s + NS * Ws
    cdf_s, cdf_t, cdf_g = zipf_cdf(Ws, 1.0), zipf_cdf(Wt, 1.0), zipf_cdf(G, 1.0)
    subtopic_topic = np.repeat(np.arange(T), S).astype(np.int32)

    def words(src_p, sub, size_shape, extra_rare=None):
        """Word ids for slots of rows whose subtopic is `sub` (per row)."""
        src = np.searchsorted(np.cumsum(src_p), rng.random(size_shape), side="right")
        subm = np.broadcast_to(sub[:, None], size_shape)
        top = subtopic_topic[subm]
        w_sub = off_s + subm * Ws + _draw(rng, cdf_s, size_shape)
        w_top = off_t + top * Wt + _draw(rng, cdf_t, size_shape)
        w_glb = _draw(rng, cdf_g, size_shape)
        out = np.select([src == 0, src == 1, src == 2], [w_sub, w_top, w_glb], default=-2)
        return out  # -2 marks a rare-word slot (filled by the caller)

    # --- queries: subtopic sizes are lognormal, ids are grouped by subtopic
    sub_w = rng.lognormal(0, 0.7, NS)
    q_sub = np.sort(
        np.minimum(
            np.searchsorted(np.cumsum(sub_w / sub_w.sum()), rng.random(n_queries), side="right"),
            NS - 1,
        )
    )
    q_start = np.searchsorted(q_sub, np.arange(NS + 1))
    qlen = 1 + np.searchsorted(np.cumsum(QUERY_LEN_P), rng.random(n_queries), side="right")
    qlen = np.minimum(qlen, MAX_Q)
    slot = np.arange(MAX_Q)[None, :] < qlen[:, None]
    Wq = np.where(slot, words([0.6, 0.25, 0.15], q_sub, (n_queries, MAX_Q)), -1)

    def uniform_sub_word(rows):
        return off_s + q_sub[rows] * Ws + rng.integers(0, Ws, len(rows))

    for _ in range(60):  # no repeated word inside a query, no two identical queries
        d = _row_dups(Wq)
        r, c = np.nonzero(d)
        Wq[r, c] = uniform_sub_word(r)
        h = _row_hash(Wq)
        order = np.argsort(h, kind="stable")
        dup_rows = order[1:][h[order][1:] == h[order][:-1]]
        if len(dup_rows) == 0 and not d.any():
            break
        lens = (Wq[dup_rows] >= 0).sum(axis=1)
        col = np.minimum(lens, MAX_Q - 1)
        Wq[dup_rows, col] = uniform_sub_word(dup_rows)
    else:
        raise RuntimeError("could not make query texts unique; raise the vocabulary size")
    qlen = (Wq >= 0).sum(axis=1)
    q_topic = subtopic_topic[q_sub]
    q_pop = zipf_weights(rng, n_queries, 1.0)

    # --- pages: grouped by subtopic, in proportion to the subtopic's queries (with noise)
    pw = (np.diff(q_start) + 1) * rng.lognormal(0, 0.5, NS)
    p_sub = np.sort(
        np.minimum(
            np.searchsorted(np.cumsum(pw / pw.sum()), rng.random(n_pages), side="right"), NS - 1
        )
    )
    p_pop = zipf_weights(rng, n_pages, 0.8)

    # --- links page -> queries: mostly its subtopic, some its topic, a few anywhere
    k = np.minimum(1 + rng.poisson(links_per_page - 1, n_pages), 30)
    lp = np.repeat(np.arange(n_pages), k)
    lsub = p_sub[lp]
    kind = np.searchsorted([0.8, 0.95], rng.random(len(lp)), side="right")
    ltop = subtopic_topic[lsub]
    lo = np.select([kind == 0, kind == 1], [q_start[lsub], q_start[ltop * S]], 0)
    hi = np.select([kind == 0, kind == 1], [q_start[lsub + 1], q_start[ltop * S + S]], n_queries)
    empty = hi <= lo  # a subtopic without queries: fall back to the whole catalogue
    lo, hi = np.where(empty, 0, lo), np.where(empty, n_queries, hi)
    lq = sample_in_ranges(rng, q_pop, lo, hi)
    key = lp.astype(np.int64) * n_queries + lq
    _, keep = np.unique(key, return_index=True)
    lp, lq = lp[keep], lq[keep]
    strength = q_pop[lq] * rng.lognormal(0, 0.5, len(lq))
    order = np.lexsort((-strength, lp))
    lp, lq, strength = lp[order], lq[order], strength[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(lp, minlength=n_pages))])
    share = strength**0.25
    share = share / np.repeat(np.add.reduceat(share, indptr[:-1]), np.diff(indptr))

    # --- titles: paraphrase the page's two strongest queries, then fill with topic words
    tlen = 3 + rng.binomial(MAX_T - 3, 0.36, n_pages)
    NP = 3  # the title paraphrases the page's three strongest queries
    cnt = np.diff(indptr)
    topn = np.where(
        np.arange(NP)[None, :] < cnt[:, None],
        lq[np.minimum(indptr[:-1, None] + np.arange(NP)[None, :], len(lq) - 1)],
        -1,
    )
    para = np.concatenate(
        [np.where(topn[:, j : j + 1] >= 0, Wq[np.maximum(topn[:, j], 0)], -1) for j in range(NP)],
        axis=1,
    )
    act = rng.random(para.shape)
    drop_p = np.repeat([0.15, 0.4, 0.55], MAX_Q)[None, :]
    para = np.where(act < drop_p, -1, np.where(act < drop_p + 0.25, para ^ 1, para))
    para = np.where(para >= 0, para, -1)
    para = _compact_left(para)[:, :MAX_T]
    n_para = np.minimum((para >= 0).sum(axis=1), tlen - 1)
    col = np.arange(MAX_T)[None, :]
    fill = words([0.45, 0.2, 0.2], p_sub, (n_pages, MAX_T))
    Wt_ = np.where(col < n_para[:, None], para, np.where(col < tlen[:, None], fill, -1))
    rare = Wt_ == -2
    Wt_[rare] = V0 + np.arange(int(rare.sum()))
    n_rare = int(rare.sum())
    for _ in range(20):
        d = _row_dups(Wt_)
        if not d.any():
            break
        r, c = np.nonzero(d)
        Wt_[r, c] = off_s + p_sub[r] * Ws + rng.integers(0, Ws, len(r))
    Wt_ = _shuffle_rows(rng, Wt_)

    vocab = np.concatenate([render_words(V0, rng), render_codes(n_rare)])
    query_text = render_rows(vocab, Wq)
    titles = render_rows(vocab, Wt_)
    sub_name = [
        f"{vocab[off_t + t * Wt]}/{vocab[off_s + s * Ws]}" for s, t in enumerate(subtopic_topic)
    ]
    site = vocab[off_t + np.arange(T) * Wt]
    slug0, slug1 = vocab[np.maximum(Wt_[:, 0], 0)], vocab[np.maximum(Wt_[:, 1], 0)]
    p_topic = subtopic_topic[p_sub]
    urls = [
        f"https://www.{site[t]}.example/{a}-{b}/{i}"
        for i, (t, a, b) in enumerate(
            zip(p_topic.tolist(), slug0.tolist(), slug1.tolist(), strict=True)
        )
    ]

    traffic = _pages_by_subtopic_weights(p_sub, p_pop, NS)
    activity, iptr, isub, iw = make_users(rng, n_users, traffic, subtopic_topic)
    meta = {
        "source": "generated",
        "seed": seed,
        "n_queries": n_queries,
        "n_pages": n_pages,
        "n_users": n_users,
        "n_topics": T,
        "subtopics_per_topic": S,
        "vocabulary": {"base_words": int(V0), "rare_codes": n_rare},
        "links": len(lq),
        "generated_s": round(time.perf_counter() - t0, 2),
    }
    return World(
        query_text,
        q_topic.astype(np.int32),
        q_sub.astype(np.int32),
        q_pop,
        urls,
        titles,
        p_topic.astype(np.int32),
        p_sub.astype(np.int32),
        p_pop,
        indptr.astype(np.int64),
        lq.astype(np.int32),
        share,
        subtopic_topic,
        sub_name,
        activity,
        iptr.astype(np.int64),
        isub,
        iw,
        meta,
    )


# ------------------------------------------------------------------------------------------------
# world on a real data set


def _spherical_kmeans(X: np.ndarray, k: int, rng, iters: int = 15) -> np.ndarray:
    n = len(X)
    k = max(1, min(k, n))
    C = X[rng.choice(n, k, replace=False)].copy()
    a = np.zeros(n, np.int64)
    for _ in range(iters):
        a = np.argmax(X @ C.T, axis=1)
        C = np.zeros_like(C)
        np.add.at(C, a, X)
        norm = np.linalg.norm(C, axis=1)
        empty = norm == 0
        C[empty] = X[rng.choice(n, int(empty.sum()))]
        C /= np.maximum(np.linalg.norm(C, axis=1, keepdims=True), 1e-12)
    return a


def _normalize_rows(M: np.ndarray) -> np.ndarray:
    return M / np.maximum(np.linalg.norm(M, axis=1, keepdims=True), 1e-12)


def world_from_dataset(
    data_dir: str | Path,
    n_users: int = 10_000,
    seed: int = 0,
    n_topics: int | None = None,
    subtopics_per_topic: int = 8,
) -> World:
    """A world on a TSV data set: pages = points (train then test), queries = label names,
    page -> queries = the point's labels, topics = clusters of label co-occurrence."""
    from engine.formats import read_label_names, read_text_tsv

    data_dir = Path(data_dir)
    names = read_label_names(data_dir / "labels.txt")
    L = len(names)
    texts, Ys, splits = [], [], []
    for split in ("train", "test"):
        p = data_dir / f"{split}.tsv"
        if p.exists():
            t, Y = read_text_tsv(p, num_labels=L)
            texts += t
            Ys.append(Y)
            splits += [split] * len(t)
    if not Ys:
        raise FileNotFoundError(f"{data_dir}: no train.tsv or test.tsv")
    Y = sp.vstack(Ys).tocsr()
    Y.data[:] = 1
    rng = np.random.default_rng(seed)
    N = Y.shape[0]
    T = n_topics or max(4, round(np.sqrt(L) / 10))
    S = subtopics_per_topic
    # label embedding: random projection of its points, smoothed one hop over co-occurrence
    R = rng.standard_normal((N, 64))
    X0 = _normalize_rows(np.asarray(Y.T @ R))
    X1 = _normalize_rows(np.asarray(Y.T @ _normalize_rows(np.asarray(Y @ X0))))
    has = np.asarray(Y.sum(axis=0)).ravel() > 0
    topic = rng.integers(0, T, L)
    topic[has] = _spherical_kmeans(X1[has], T, rng)
    sub = topic * S + rng.integers(0, S, L)
    for t in range(T):
        idx = np.nonzero(has & (topic == t))[0]
        if len(idx):
            sub[idx] = t * S + _spherical_kmeans(X1[idx], S, rng)
    subtopic_topic = np.repeat(np.arange(T), S).astype(np.int32)
    freq = np.asarray(Y.sum(axis=0)).ravel()
    q_pop = (freq + 1.0) / (freq + 1.0).sum()
    # a page's subtopic: the one most of its labels fall in
    onehot = sp.csr_matrix((np.ones(L), (np.arange(L), sub)), shape=(L, T * S))
    p_sub = np.asarray((Y @ onehot).argmax(axis=1)).ravel().astype(np.int32)
    p_pop = zipf_weights(rng, N, 0.8)
    # links ordered by label frequency, strongest first
    Y.sort_indices()
    lp = np.repeat(np.arange(N), np.diff(Y.indptr))
    lq = Y.indices.astype(np.int64)
    order = np.lexsort((-freq[lq], lp))
    lq = lq[order]
    indptr = Y.indptr.astype(np.int64)
    share = (freq[lq] + 1.0) ** 0.6
    nz = np.diff(indptr) > 0
    sums = np.zeros(N)
    sums[nz] = np.add.reduceat(share, indptr[:-1][nz])
    share = share / np.repeat(sums, np.diff(indptr))
    sub_name = []
    for s in range(T * S):
        members = np.nonzero(sub == s)[0]
        sub_name.append(
            names[members[np.argmax(freq[members])]] if len(members) else f"subtopic-{s}"
        )
    urls = [f"dataset://{data_dir.name}/{sp_}/{i}" for i, sp_ in enumerate(splits)]
    traffic = _pages_by_subtopic_weights(p_sub, p_pop, T * S)
    activity, iptr, isub, iw = make_users(rng, n_users, traffic, subtopic_topic)
    meta = {
        "source": f"dataset:{data_dir}",
        "seed": seed,
        "n_queries": L,
        "n_pages": N,
        "n_users": n_users,
        "n_topics": T,
        "subtopics_per_topic": S,
        "links": len(lq),
    }
    return World(
        list(names),
        topic.astype(np.int32),
        sub.astype(np.int32),
        q_pop,
        urls,
        [t.replace("\t", " ") for t in texts],
        subtopic_topic[p_sub],
        p_sub,
        p_pop,
        indptr,
        lq.astype(np.int32),
        share,
        subtopic_topic,
        sub_name,
        activity,
        iptr.astype(np.int64),
        isub,
        iw,
        meta,
        page_split=splits,
    )


# ------------------------------------------------------------------------------------------------
# files


def save_world(world: World, out: str | Path) -> Path:
    """Write the world's files (see the module docstring)."""
    out = Path(out)
    (out / "truth").mkdir(parents=True, exist_ok=True)
    with open(out / "queries.tsv", "w", encoding="utf-8") as f:
        f.write("id\ttext\ttopic\tsubtopic\tpopularity\n")
        f.writelines(
            f"{i}\t{t}\t{a}\t{b}\t{p:.6g}\n"
            for i, (t, a, b, p) in enumerate(
                zip(
                    world.query_text,
                    world.query_topic.tolist(),
                    world.query_subtopic.tolist(),
                    world.query_pop.tolist(),
                    strict=True,
                )
            )
        )
    ip = world.link_indptr.tolist()
    lq = world.link_query.tolist()
    lw = np.round(world.link_weight, 5).tolist()
    with open(out / "pages.jsonl", "w", encoding="utf-8") as f:
        for i in range(world.n_pages):
            rec = {
                "id": i,
                "url": world.page_url[i],
                "title": world.page_title[i],
                "topic": int(world.page_topic[i]),
                "subtopic": int(world.page_subtopic[i]),
                "popularity": float(f"{world.page_pop[i]:.6g}"),
                "queries": lq[ip[i] : ip[i + 1]],
                "query_weights": lw[ip[i] : ip[i + 1]],
            }
            if world.page_split is not None:
                rec["split"] = world.page_split[i]
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    with open(out / "subtopics.tsv", "w", encoding="utf-8") as f:
        f.write("subtopic\ttopic\tname\n")
        f.writelines(
            f"{s}\t{t}\t{n}\n"
            for s, (t, n) in enumerate(
                zip(world.subtopic_topic.tolist(), world.subtopic_name, strict=True)
            )
        )
    with open(out / "users.jsonl", "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"user_id": world.user_id(u), "activity": round(a, 4)}) + "\n"
            for u, a in enumerate(world.user_activity.tolist())
        )
    iptr, isub, iw = (
        world.interest_indptr.tolist(),
        world.interest_subtopic.tolist(),
        world.interest_weight,
    )
    with open(out / "truth" / "user_interests.jsonl", "w", encoding="utf-8") as f:
        for u in range(world.n_users):
            a, b = iptr[u], iptr[u + 1]
            f.write(
                json.dumps(
                    {
                        "user_id": world.user_id(u),
                        "subtopics": isub[a:b],
                        "weights": np.round(iw[a:b], 4).tolist(),
                    }
                )
                + "\n"
            )
    meta = dict(
        world.meta,
        n_queries=world.n_queries,
        n_pages=world.n_pages,
        n_users=world.n_users,
        n_subtopics=world.n_subtopics,
        format=1,
    )
    (out / "world.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


class WorldFormatError(ValueError):
    """A world file that cannot be read (the message names the file and line)."""


def _jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise WorldFormatError(f"{path}:{n}: invalid JSON: {e}") from e


def load_world(path: str | Path) -> World:
    """Read a world written by `save_world` (truth files included)."""
    path = Path(path)
    if not (path / "world.json").is_file():
        raise WorldFormatError(
            f"{path}: not a world directory (no world.json); "
            "create one with `astec simulate world --out DIR`"
        )
    meta = json.loads((path / "world.json").read_text())
    qpath = path / "queries.tsv"
    lines = qpath.read_text(encoding="utf-8").split("\n")[1:]
    rows = [r.split("\t") for r in lines if r]
    bad = next((i for i, r in enumerate(rows) if len(r) != 5), None)
    if bad is not None:
        raise WorldFormatError(f"{qpath}:{bad + 2}: expected 5 tab-separated fields")
    cols = list(zip(*rows, strict=True)) if rows else [()] * 5
    q_text = list(cols[1])
    q_topic, q_sub = np.array(cols[2], np.int32), np.array(cols[3], np.int32)
    q_pop = np.array(cols[4], np.float64)
    pages = list(_jsonl(path / "pages.jsonl"))
    try:
        urls = [p["url"] for p in pages]
        titles = [p["title"] for p in pages]
        p_topic = np.array([p["topic"] for p in pages], np.int32)
        p_sub = np.array([p["subtopic"] for p in pages], np.int32)
        p_pop = np.array([p["popularity"] for p in pages], np.float64)
        cnt = np.array([len(p["queries"]) for p in pages], np.int64)
        lq = np.array([q for p in pages for q in p["queries"]], np.int32)
        lw = np.array([w for p in pages for w in p["query_weights"]], np.float64)
        split = [p["split"] for p in pages] if pages and "split" in pages[0] else None
    except KeyError as e:
        raise WorldFormatError(f"{path / 'pages.jsonl'}: a record lacks field {e}") from e
    subs = [
        r.split("\t")
        for r in (path / "subtopics.tsv").read_text(encoding="utf-8").split("\n")[1:]
        if r
    ]
    sub_topic = np.array([int(r[1]) for r in subs], np.int32)
    sub_name = [r[2] for r in subs]
    users = list(_jsonl(path / "users.jsonl"))
    activity = np.array([u["activity"] for u in users], np.float64)
    ints = list(_jsonl(path / "truth" / "user_interests.jsonl"))
    icnt = np.array([len(u["subtopics"]) for u in ints], np.int64)
    isub = np.array([s for u in ints for s in u["subtopics"]], np.int32)
    iw = np.array([w for u in ints for w in u["weights"]], np.float64)
    return World(
        q_text,
        q_topic,
        q_sub,
        q_pop / q_pop.sum(),
        urls,
        titles,
        p_topic,
        p_sub,
        p_pop / p_pop.sum(),
        np.concatenate([[0], np.cumsum(cnt)]),
        lq,
        lw,
        sub_topic,
        sub_name,
        activity,
        np.concatenate([[0], np.cumsum(icnt)]),
        isub,
        iw,
        meta,
        page_split=split,
    )
