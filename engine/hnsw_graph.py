"""HNSW graphs read from hnswlib's own file and searched in compiled code.

One title's two shortlist searches visit ~1,100 graph nodes. hnswlib reads each visited node's
float32 vector (1.2 kB at D = 300), so the searches' ~1.3 MB and the classifier's rows evict
each other from L2 for every title, and each search is a Python call of its own. Reading the
graph file here lets the predictor keep each vector as int16 with one scale per vector (half
the bytes; a similarity's error is ~1e-5, far below the gaps between neighbours), prefetch a
node's unvisited neighbours before scoring them, and search from inside compiled code. The
graph, its entry point and the search are hnswlib's (searchKnn: greedy descent through the
upper layers, then best-first at layer 0 with ef = max(ef, k), ties broken by node), so the
answers are hnswlib's but for the last bits of the similarities.

The file is parsed with numpy and checked field by field (nothing in it is executed), so a
truncated or foreign file is refused with the field that is wrong.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numba import njit

from engine.prefetch import prefetch_at, prefetch_row

_HEADER = np.dtype(
    [
        ("offset_level0", "<u8"),
        ("max_elements", "<u8"),
        ("count", "<u8"),
        ("size_per_element", "<u8"),
        ("label_offset", "<u8"),
        ("offset_data", "<u8"),
        ("max_level", "<i4"),
        ("entry", "<u4"),
        ("max_m", "<u8"),
        ("max_m0", "<u8"),
        ("m", "<u8"),
        ("mult", "<f8"),
        ("ef_construction", "<u8"),
    ]
)
_SCALE = np.float32(32767.0)


class GraphFileError(ValueError):
    """An hnswlib index file this module cannot search (the message names the file)."""


@dataclass
class HnswGraph:
    """One hnswlib graph as flat arrays (internal node ids index every table)."""

    codes: np.ndarray  # [U, D] int16: vector / scale, rounded
    scale: np.ndarray  # [U] float32: max |x| / 32767 of each vector (0 for a zero vector)
    links0: np.ndarray  # [U, M0] int32: layer-0 neighbours
    count0: np.ndarray  # [U] int32: how many of links0's slots are used
    upper_indptr: np.ndarray  # [U + 1] int64: node -> its rows of `upper` (one per layer >= 1)
    upper: np.ndarray  # [R, M + 1] int32: count, then the neighbours at that layer
    labels: np.ndarray  # [U] int64: the id each node was added with
    entry: int
    max_level: int
    m: int
    ef: int = 1  # searched with max(ef, k), as hnswlib
    _local: threading.local = field(default_factory=threading.local, repr=False)

    @property
    def count(self) -> int:
        return int(self.labels.size)

    def scratch(self):
        """(visited stamps, stamp, two heaps' distances and nodes) for this thread: a search
        marks nodes with a new stamp instead of clearing an array of U."""
        loc = self._local
        if not hasattr(loc, "visited"):
            loc.visited = np.zeros(max(self.count, 1), np.uint32)
            loc.stamp = np.zeros(1, np.uint32)
            loc.hd = np.empty(2 * (self.count + 1), np.float32)  # see search_one
            loc.hi = np.empty(2 * (self.count + 1), np.int64)
        return loc.visited, loc.stamp, loc.hd, loc.hi

    def search(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(labels int64 [n, k'], similarities float32 [n, k']) best first, k' = min(k, U)."""
        Q = np.ascontiguousarray(Q, np.float32)
        ids, sims = search_rows(Q, int(k), int(self.ef), *self.arrays(), *self.scratch())
        if ids.size and ids[:, -1].min() < 0:
            raise GraphFileError(
                f"a graph search reached fewer than {ids.shape[1]} of {self.count} nodes: the "
                "graph is in islands (export it again with a larger M or an exact search)"
            )
        return ids, sims

    def arrays(self) -> tuple:
        return (
            *(self.codes, self.scale, self.links0, self.count0),
            *(self.upper_indptr, self.upper, self.labels, self.entry, self.max_level),
        )


def read_graph(path: str | Path, dim: int) -> HnswGraph:
    """The graph of an hnswlib index saved by `save_index` (space "ip", vectors of `dim`
    float32), its vectors quantised to int16; GraphFileError names what does not fit."""
    path = Path(path)
    try:  # mapped, not read: the file's pages are dropped with the map, not kept as heap
        raw = np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as e:
        raise GraphFileError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    try:
        return _parse(raw, path, dim)
    finally:
        del raw


def _parse(raw: np.ndarray, path: Path, dim: int) -> HnswGraph:

    def bad(what: str):
        return GraphFileError(f"{path}: not an hnswlib index of {dim}-d vectors: {what}")

    if raw.size < _HEADER.itemsize:
        raise bad(f"{raw.size} bytes, shorter than the {_HEADER.itemsize}-byte header")
    h = raw[: _HEADER.itemsize].view(_HEADER)[0]
    n, per, m0, m = (int(h[f]) for f in ("count", "size_per_element", "max_m0", "m"))
    od, lo = int(h["offset_data"]), int(h["label_offset"])
    if int(h["offset_level0"]) != 0 or not 0 < m0 <= 4096 or not 0 < int(h["max_m"]) <= 4096:
        raise bad(f"header fields offset {int(h['offset_level0'])}, M0 {m0}, M {int(h['max_m'])}")
    mm = int(h["max_m"])
    if od != 4 + 4 * m0 or lo != od + 4 * dim or per != lo + 8:
        raise bad(f"element layout ({od}, {lo}, {per}) is not ({4 + 4 * m0}, {od + 4 * dim}, ...)")
    end0 = _HEADER.itemsize + n * per
    if n < 1 or raw.size < end0:
        raise bad(f"{n} elements of {per} bytes do not fit in {raw.size} bytes")
    block = raw[_HEADER.itemsize : end0].reshape(n, per)
    head = np.ascontiguousarray(block[:, :4]).view("<u4")[:, 0]
    if np.any(head >> 16):
        raise bad("some elements are marked deleted")
    count0 = (head & 0xFFFF).astype(np.int32)
    links0 = np.ascontiguousarray(block[:, 4:od]).view("<u4").astype(np.int32)
    labels = np.ascontiguousarray(block[:, lo:per]).view("<u8")[:, 0]
    _check_links(count0, links0, n, bad, f"a layer-0 list longer than M0 = {m0}", "a layer-0")
    if labels.max() >= np.uint64(1 << 62):
        raise bad("an element label out of range")
    if np.unique(labels).size != n:
        raise bad("two elements share a label")
    levels, upper, end = _upper_lists(raw, end0, n, mm)
    if end != raw.size:
        raise bad("upper-layer link lists do not end where the file does")
    max_level, entry = int(h["max_level"]), int(h["entry"])
    if entry >= n or max_level < 0 or levels[entry] != max_level or levels.max() > max_level:
        raise bad(f"entry point {entry} at level {max_level} does not match the elements' levels")
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(levels, out=indptr[1:])
    if upper.shape[0]:
        row_level = np.arange(upper.shape[0]) - np.repeat(indptr[:-1], levels) + 1
        tgt = upper[:, 1:]
        live = _check_links(
            upper[:, 0], tgt, n, bad, f"an upper-layer list longer than M = {mm}", "an upper-layer"
        )
        t = np.where(live, tgt, entry)
        if np.any(levels[t] < row_level[:, None]):
            raise bad("an upper-layer neighbour below that layer")
    codes = np.empty((n, dim), np.int16)
    scale = np.empty(n, np.float32)
    for a in range(0, n, 4096):  # in slices: no float32 copy of the whole table on the heap
        v = np.ascontiguousarray(block[a : a + 4096, od:lo]).view("<f4")
        if not np.isfinite(v).all():
            raise bad("a vector with NaN or infinity")
        sc = np.abs(v).max(axis=1) / _SCALE
        inv = np.divide(1.0, sc, out=np.zeros_like(sc), where=sc > 0)
        codes[a : a + 4096] = np.rint(v * inv[:, None])
        scale[a : a + 4096] = sc
    return HnswGraph(
        codes=codes,
        scale=scale,
        links0=links0,
        count0=count0,
        upper_indptr=indptr,
        upper=upper,
        labels=labels.astype(np.int64),
        entry=entry,
        max_level=max_level,
        m=m,
    )


def _check_links(counts, links, n, bad, too_long: str, layer: str) -> np.ndarray:
    """The used slots [rows, width] of link lists (counts [rows], ids [rows, width]), once each
    count fits the width and each used id is a node of the graph; `bad` makes the error."""
    width = links.shape[1]
    if counts.size and (counts.min() < 0 or counts.max() > width):
        raise bad(too_long)
    live = np.arange(width)[None, :] < counts[:, None]
    if np.any(live & ((links < 0) | (links >= n))):
        raise bad(f"{layer} neighbour outside the graph")
    return live


@njit(cache=True, inline="always")
def _u32(raw, p):
    """The little-endian uint32 at byte p of raw (uint8), as int64."""
    v = np.int64(raw[p]) | (np.int64(raw[p + 1]) << 8)
    return v | (np.int64(raw[p + 2]) << 16) | (np.int64(raw[p + 3]) << 24)


@njit(cache=True)
def _upper_lists(raw, pos, n, mm):
    """(levels [n] int32, upper [R, mm + 1] int32, end position) of the per-element upper-layer
    link lists that follow layer 0 (end -1: the sizes do not fit the file)."""
    levels = np.zeros(n, np.int32)
    row_bytes = 4 * (mm + 1)
    start = pos
    rows = 0
    for i in range(n):
        if pos + 4 > raw.size:
            return levels, np.zeros((0, mm + 1), np.int32), -1
        size = _u32(raw, pos)
        pos += 4 + size
        if size % row_bytes or pos > raw.size:
            return levels, np.zeros((0, mm + 1), np.int32), -1
        levels[i] = size // row_bytes
        rows += levels[i]
    upper = np.empty((rows, mm + 1), np.int32)
    pos = start
    r = 0
    for i in range(n):
        pos += 4
        for _ in range(levels[i]):
            for j in range(mm + 1):
                v = _u32(raw, pos + 4 * j)
                upper[r, j] = np.int32(v if v < 2**31 else -1)
            pos += row_bytes
            r += 1
    return levels, upper, pos


@njit(cache=True, nogil=True, boundscheck=False, fastmath=True, inline="always")
def _dist(codes, scale, i, q):
    """1 - <q, vector i> from its int16 codes (fastmath: a vectorised sum)."""
    s = np.float32(0.0)
    for j in range(q.size):
        s += np.float32(codes[i, j]) * q[j]
    return np.float32(1.0) - s * scale[i]


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _above(d1, i1, d2, i2):
    return d1 > d2 or (d1 == d2 and i1 > i2)


@njit(cache=True, nogil=True, boundscheck=False)
def _push(hd, hi, base, n, d, i):
    """Push (d, i) on the max-heap hd/hi[base : base + n]; returns the new size."""
    k = n
    while k > 0:
        p = (k - 1) >> 1
        if _above(d, i, hd[base + p], hi[base + p]):
            hd[base + k] = hd[base + p]
            hi[base + k] = hi[base + p]
            k = p
        else:
            break
    hd[base + k] = d
    hi[base + k] = i
    return n + 1


@njit(cache=True, nogil=True, boundscheck=False)
def _pop(hd, hi, base, n):
    """Drop the top of the max-heap hd/hi[base : base + n]; returns the new size."""
    n -= 1
    d = hd[base + n]
    i = hi[base + n]
    k = 0
    while True:
        c = 2 * k + 1
        if c >= n:
            break
        if c + 1 < n and _above(hd[base + c + 1], hi[base + c + 1], hd[base + c], hi[base + c]):
            c += 1
        if _above(hd[base + c], hi[base + c], d, i):
            hd[base + k] = hd[base + c]
            hi[base + k] = hi[base + c]
            k = c
        else:
            break
    hd[base + k] = d
    hi[base + k] = i
    return n


@njit(cache=True, nogil=True, boundscheck=False, fastmath=True)
def search_one(
    q, k, ef, codes, scale, links0, count0, upper_indptr, upper, labels, entry, max_level,
    visited, stamp, hd, hi,
):  # fmt: skip
    """(labels int64 [k'], similarities float32 [k']) of the query q [D], best first.

    The two heaps share hd/hi: the result set (max-heap on distance, at most ef) at [0, n),
    the candidates (max-heap on -distance) at [n, 2n) with n = U + 1."""
    n_all = labels.size
    k = min(k, n_all)
    if k <= 0:
        return np.empty(0, np.int64), np.empty(0, np.float32)
    if stamp[0] == np.uint32(0xFFFFFFFF):
        visited[:] = 0
        stamp[0] = 0
    stamp[0] += 1
    tag = stamp[0]
    cur = np.int32(entry)
    curd = _dist(codes, scale, cur, q)
    for level in range(max_level, 0, -1):
        changed = True
        while changed:
            changed = False
            row = upper_indptr[cur] + level - 1
            for j in range(upper[row, 0]):
                c = upper[row, 1 + j]
                d = _dist(codes, scale, c, q)
                if d < curd:
                    curd = d
                    cur = c
                    changed = True
    ef = max(ef, k)
    cb = n_all + 1  # the candidates' heap starts here
    nt = _push(hd, hi, 0, 0, curd, cur)
    nc = _push(hd, hi, cb, 0, -curd, cur)  # the nearest first; ties: the larger node first
    visited[cur] = tag
    lower = curd
    todo = np.empty(links0.shape[1], np.int32)
    while nc > 0:
        if -hd[cb] > lower:
            break
        node = hi[cb]
        nc = _pop(hd, hi, cb, nc)
        m = 0
        for j in range(count0[node]):
            c = links0[node, j]
            if visited[c] == tag:
                continue
            visited[c] = tag
            todo[m] = c
            m += 1
            prefetch_row(codes, c)  # all of c's vector on its way before any is scored
        for t in range(m):
            c = todo[t]
            d = _dist(codes, scale, c, q)
            if nt < ef or lower > d:
                nc = _push(hd, hi, cb, nc, -d, c)
                prefetch_at(links0, c, 0)  # its links, read when c is expanded
                nt = _push(hd, hi, 0, nt, d, c)
                if nt > ef:
                    nt = _pop(hd, hi, 0, nt)
                lower = hd[0]
    while nt > k:
        nt = _pop(hd, hi, 0, nt)
    ids = np.empty(nt, np.int64)
    sims = np.empty(nt, np.float32)
    for r in range(nt - 1, -1, -1):
        ids[r] = labels[hi[0]]
        sims[r] = np.float32(1.0) - hd[0]
        nt = _pop(hd, hi, 0, nt)
    return ids, sims


@njit(cache=True, nogil=True, boundscheck=False)
def search_rows(
    Q, k, ef, codes, scale, links0, count0, upper_indptr, upper, labels, entry, max_level,
    visited, stamp, hd, hi,
):  # fmt: skip
    """search_one for every row of Q [n, D]: (labels [n, k'], similarities [n, k']); a row the
    search could not fill (a graph in islands) ends in label -1."""
    kq = max(min(k, labels.size), 0)
    ids = np.full((Q.shape[0], kq), -1, np.int64)
    sims = np.full((Q.shape[0], kq), -np.inf, np.float32)
    for r in range(Q.shape[0]):
        a, s = search_one(
            Q[r], k, ef, codes, scale, links0, count0, upper_indptr, upper, labels,
            entry, max_level, visited, stamp, hd, hi,
        )  # fmt: skip
        ids[r, : a.size] = a
        sims[r, : a.size] = s
    return ids, sims
