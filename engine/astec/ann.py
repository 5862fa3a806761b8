"""Nearest-neighbour search over unit vectors: exact (torch matmul) for small sets, hnswlib above.

At tens of thousands of points a blocked exact search is faster than building an HNSW graph and
has perfect recall; hnswlib (inner product on L2-normalised vectors = cosine) takes over above
`exact_max` vectors so that cost stays O(N log N). Similarities are cosines in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hnswlib
import numpy as np
import torch
from numba import njit

from .config import resolve_precision
from .sparse import normalize_rows, row_parts

# similarities per block of an exact search at most: 32 MB of bfloat16, 512 MB of float32.
# float32 products take 4x the bfloat16 ones' time, and their blocks must be larger for the
# matmul to run at speed: 248,800 label centres, k = 600, 2 threads, AVX2 (no bfloat16): 128
# rows a block (64 MB would have been 67) 2.17 ms a point, 256 rows 1.91, 512 1.76, 1,024 1.69
_BLOCK_FLOATS = 1 << 24
_BLOCK_FLOATS_F32 = 1 << 27


@dataclass
class AnnIndex:
    kind: str  # "exact" or "hnsw"
    dim: int
    count: int
    vectors: np.ndarray | None = None  # exact: the normalised vectors
    hnsw: hnswlib.Index | None = None
    ef_search: int = 100
    # exact searches' products: "bfloat16" for training-time bulk searches (hard negatives,
    # candidate pools), where a similarity off by <= 0.003 only moves the k-th neighbour's
    # boundary; prediction searches in float32 as the exported predictor does
    precision: str = "float32"
    _table16: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def _graph(self) -> hnswlib.Index:
        if self.hnsw is None:
            raise ValueError(f"{self.kind} index of {self.count} vectors has no hnswlib graph")
        return self.hnsw

    def _table(self) -> np.ndarray:
        if self.vectors is None:
            raise ValueError(f"{self.kind} index of {self.count} vectors has no vector table")
        return self.vectors

    @classmethod
    def exact(cls, V: np.ndarray, ef_search: int = 100, precision: str = "float32") -> AnnIndex:
        """An exact index over V, rows already normalised float32 (one constructor for
        `build`, `load`, `as_exact` and `with_vectors`)."""
        return cls(
            "exact",
            V.shape[1],
            V.shape[0],
            vectors=V,
            ef_search=ef_search,
            precision=resolve_precision(precision),
        )

    @classmethod
    def build(
        cls,
        vectors: np.ndarray,
        exact_max: int,
        M: int = 50,
        ef_construction: int = 100,
        ef_search: int = 100,
        num_threads: int = 2,
        seed: int = 0,
        precision: str = "float32",
    ) -> AnnIndex:
        """precision: the exact search's products ("auto": see resolve_precision); an hnswlib
        graph computes in float32."""
        V = normalize_rows(np.ascontiguousarray(vectors, dtype=np.float32))
        n, d = V.shape
        if n <= exact_max:
            return cls.exact(V, ef_search, precision)
        index = hnswlib.Index(space="ip", dim=d)
        index.init_index(max_elements=n, M=M, ef_construction=ef_construction, random_seed=seed)
        index.add_items(V, np.arange(n), num_threads=num_threads)
        index.set_ef(ef_search)
        return cls("hnsw", d, n, hnsw=index, ef_search=ef_search)

    def grown(self, vectors: np.ndarray, num_threads: int = 2) -> AnnIndex:
        """This hnswlib graph with `vectors` added as ids count, count + 1, ...: inserting a few
        thousand points into a graph costs a fraction of building it again over all of them.
        Takes the graph over: this index must not be searched afterwards."""
        graph = self._graph()
        V = normalize_rows(np.ascontiguousarray(vectors, dtype=np.float32))
        n = self.count + V.shape[0]
        graph.resize_index(n)
        graph.add_items(V, np.arange(self.count, n), num_threads=num_threads)
        self.hnsw = None
        return AnnIndex("hnsw", self.dim, n, hnsw=graph, ef_search=self.ef_search)

    def with_vectors(self, vectors: np.ndarray, num_threads: int = 2) -> AnnIndex:
        """A graph with this one's links over new vectors of the same points (row i: id i), this
        index untouched. Why: after Module IV has fine-tuned E, the points moved little from where
        Module II's graph placed them (the paper's premise for Module III), and rewriting each
        node's vector costs a copy instead of a build, at the recall of a fresh build.
        hnswlib has no call that replaces a vector in place; its in-memory state (the pickling
        protocol's arrays, never a file) holds each node's vector at `offset_data` of its
        level-0 record. A state of another layout is built anew with the graph's parameters.
        An exact index: the same exact search over the new vectors."""
        V = normalize_rows(np.ascontiguousarray(vectors, dtype=np.float32))
        if V.shape != (self.count, self.dim):
            raise ValueError(
                f"with_vectors: {V.shape} vectors for a graph of {self.count} x {self.dim}"
            )
        if self.kind == "exact":
            return AnnIndex.exact(V, self.ef_search, self.precision)
        (state,) = self._graph().__getstate__()
        n, per, off = (
            state["cur_element_count"],
            state["size_data_per_element"],
            state["offset_data"],
        )
        data = np.asarray(state["data_level0"])
        if (
            state.get("ser_version") != 1
            or n != self.count
            or data.size < n * per
            or per < off + 4 * self.dim
        ):
            return AnnIndex.build(
                V,
                0,
                int(state["M"]),
                int(state["ef_construction"]),
                self.ef_search,
                num_threads,
                int(state["seed"]),
            )
        # `data` is the state's own copy (hnswlib copies its records out; the test checks that
        # the graph it came from keeps its vectors): written in place, no second copy (at L =
        # 500k, ~480 MB each)
        # node k (hnswlib's internal order) holds the point of label external[k]
        node_of = np.asarray(state["label_lookup_internal"], np.int64)
        point = np.empty(n, np.int64)
        point[node_of] = np.asarray(state["label_lookup_external"], np.int64)
        records = data[: n * per].reshape(n, per)
        records[:, off : off + 4 * self.dim] = V[point].view(np.uint8)
        state = {**state, "data_level0": data}
        moved = hnswlib.Index.__new__(hnswlib.Index)
        moved.__setstate__((state,))
        return AnnIndex("hnsw", self.dim, self.count, hnsw=moved, ef_search=self.ef_search)

    def as_exact(self, precision: str = "float32") -> AnnIndex:
        """The same vectors searched exactly (blocked matmul + top-k): for bulk searches at a
        large k over a few ten thousand vectors, cheaper than the graph at ef >= k."""
        if self.kind == "exact":
            return self
        V = np.ascontiguousarray(self.vectors_of(np.arange(self.count)))
        return AnnIndex.exact(V, self.ef_search, precision)

    def vectors_of(self, ids: np.ndarray) -> np.ndarray:
        """The stored (normalised) vectors of these ids, float32 [len(ids), dim]."""
        ids = np.asarray(ids, np.int64)
        if self.kind == "exact":
            return self._table()[ids]
        if ids.size == 0:
            return np.zeros((0, self.dim), np.float32)
        return np.asarray(self._graph().get_items(ids), np.float32).reshape(ids.size, self.dim)

    def query(self, Q: np.ndarray, k: int, num_threads: int = 2, block: int = 128):
        """(ids int64 [n, k'], sims float32 [n, k']) with k' = min(k, count), best first."""
        Q = normalize_rows(np.ascontiguousarray(Q, dtype=np.float32))
        k = int(min(k, self.count))
        n = Q.shape[0]
        if k <= 0 or n == 0:
            return np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
        if self.kind == "hnsw":
            graph = self._graph()
            graph.set_ef(max(self.ef_search, k))
            ids, dist = graph.knn_query(Q, k=k, num_threads=num_threads)
            return ids.astype(np.int64), (1.0 - dist).astype(np.float32)
        ids = np.empty((n, k), np.int64)
        sims = np.empty((n, k), np.float32)
        B = torch.from_numpy(self._table())
        low = self.precision == "bfloat16"
        if low and self._table16 is None:
            self._table16 = B.to(torch.bfloat16)
        # blocks of up to `cap` similarities (above): torch's OpenMP threads spin for a while after
        # each matmul, beside the top-k threads; fewer, larger blocks waste less of it (k = 600
        # over 21k centres: 256 rows a block 1.5 s of top-k per 16k queries, 1024 rows 1.0 s).
        # `block` rows at least: at 248,800 centres the default 128 holds 64 MB of bfloat16
        # blocks (256 held twice that for ~5% less time; the 64 MB cap's 67 rows took 28% more)
        cap = _BLOCK_FLOATS if low else _BLOCK_FLOATS_F32
        block = max(block, min(1024, cap // max(self.count, 1)))
        rows = min(block, n)
        out = torch.empty((rows, self.count), dtype=torch.bfloat16 if low else torch.float32)
        for s in range(0, n, block):
            q = torch.from_numpy(Q[s : s + block])
            m = q.shape[0]
            if low and self._table16 is not None:
                # the top k read the products' bfloat16 bits: half the bytes, and an order
                # by counting (`_top_rows_bf16`)
                torch.matmul(q.to(torch.bfloat16), self._table16.T, out=out[:m])
                S = out[:m].view(torch.int16).numpy()
                top = _top_rows_bf16
            else:
                S = torch.matmul(q, B.T, out=out[:m]).numpy()
                top = _top_rows
            e = s + m

            def part(a: int, b: int, S=S, i=ids[s:e], v=sims[s:e], top=top) -> None:
                top(S, k, i, v, a, b)

            row_parts(m, num_threads, part, min_rows=16)
        return ids, sims

    def save(self, path: Path) -> str:
        """Write to `path` (.npy for exact, .hnsw for hnswlib); returns the file name used."""
        path = Path(path)
        if self.kind == "exact":
            p = path.with_suffix(".npy")
            np.save(p, self._table(), allow_pickle=False)
        else:
            p = path.with_suffix(".hnsw")
            self._graph().save_index(str(p))
        return p.name

    @classmethod
    def load(cls, path: Path, kind: str, dim: int, count: int, ef_search: int) -> AnnIndex:
        path = Path(path)
        if kind == "exact":
            V = np.load(path, allow_pickle=False)
            if V.shape != (count, dim):
                raise ValueError(f"{path}: shape {V.shape}, expected {(count, dim)}")
            return cls.exact(np.ascontiguousarray(V, np.float32), ef_search)
        index = hnswlib.Index(space="ip", dim=dim)
        index.load_index(str(path), max_elements=count)
        if index.get_current_count() != count:
            raise ValueError(
                f"{path}: hnsw index holds {index.get_current_count()} items, expected {count}"
            )
        index.set_ef(ef_search)
        return cls("hnsw", dim, count, hnsw=index, ef_search=ef_search)


@njit(cache=True, nogil=True, inline="always")
def _sample_plan(m, k):
    """The top-k kernels' bar: (stride, samples, q) of a strided sample of ~1,024 of a row's m
    columns whose q-th largest keeps ~1.25 k columns above it."""
    stride = max(1, m // 1024)
    ns = (m + stride - 1) // stride
    return stride, ns, min(ns, int(k * ns / m * 1.25) + 8)


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _bf16_key(h):
    """An int in [0, 65535] ordered as the bfloat16 value of bits h (-0 as +0)."""
    h = np.int32(h) & 0xFFFF
    if h == 0x8000:
        h = 0
    return (h ^ 0xFFFF) if h & 0x8000 else (h | 0x8000)


@njit(cache=True, nogil=True, boundscheck=False)
def _top_rows_bf16(H, k, ids, vals, a, b):
    """_top_rows of bfloat16 similarities given as their bits (int16 [n, m]): the same answer
    (ties to the lower column), but a bfloat16 has 65,536 values, so the candidates above a
    sampled bar are ordered by counting their keys, and the bar is read off a histogram of the
    sample, which is several times faster than widening to float32 and sorting."""
    m = H.shape[1]
    stride, ns, q = _sample_plan(m, k)
    key = np.empty(m, np.int32)
    cj = np.empty(m, np.int64)
    cnt = np.zeros(65537, np.int32)
    hb = np.zeros(8192, np.int32)  # the sample's keys >> 3
    for r in range(a, b):
        row = H[r]
        for j in range(m):
            key[j] = _bf16_key(row[j])
        top = 0
        for i in range(ns):
            kb = key[i * stride] >> 3
            hb[kb] += 1
            top = max(top, kb)
        seen = 0
        kb = top
        while True:  # the bar: the lowest key of the bucket holding the sample's q-th largest
            seen += hb[kb]
            if seen >= q or kb == 0:
                break
            kb -= 1
        t = kb << 3
        for i in range(ns):
            hb[key[i * stride] >> 3] = 0
        c = 0
        hi = 0
        for j in range(m):  # every column at or above the bar (branch-free)
            cj[c] = j
            c += key[j] >= t
            hi = max(hi, key[j])
        if c < k:  # too few above the bar: the whole row
            t = 0
            c = m
            for j in range(m):
                cj[j] = j
        # counting sort by key, descending; columns in ascending order within a key
        span = hi - t + 1
        for u in range(span + 1):
            cnt[u] = 0
        for u in range(c):
            cnt[hi - key[cj[u]] + 1] += 1
        for u in range(1, span + 1):
            cnt[u] += cnt[u - 1]
        for u in range(c):
            j = cj[u]
            p = cnt[hi - key[j]]
            cnt[hi - key[j]] += 1
            if p < k:
                ids[r, p] = j
                vals[r, p] = np.int32(np.int32(row[j]) << 16).view(np.float32)


@njit(cache=True, nogil=True, boundscheck=False)
def _top_rows(S, k, ids, vals, a, b):
    """ids[r], vals[r] = row r's k best columns of S by (-value, column), for rows [a, b).

    Ties (duplicate training texts, labels sharing a centre) go to the lower id, as in the
    exported predictor. A threshold from a strided sample of the row keeps ~1.25 k columns
    (every column above the k-th best value among them, so the answer is exact; too few falls
    back to the whole row), and a stable sort of those orders them: torch.topk plus a
    reordering of tied runs cost ~140 us a row at k = 600 over 21k label centres, this ~110,
    and half that at k = 300."""
    m = S.shape[1]
    stride, ns, q = _sample_plan(m, k)
    smp = np.empty(ns, np.float32)
    cj = np.empty(m, np.int64)
    cv = np.empty(m, np.float32)
    for r in range(a, b):
        row = S[r]
        for i in range(ns):
            smp[i] = -row[i * stride]
        t = -np.partition(smp, q - 1)[q - 1]
        c = 0
        for j in range(m):
            if row[j] >= t:
                cj[c] = j
                cv[c] = -row[j]
                c += 1
        if c < k:
            for j in range(m):
                cj[j] = j
                cv[j] = -row[j]
            c = m
        o = np.argsort(cv[:c], kind="mergesort")  # stable: lower column first among ties
        for u in range(k):
            ids[r, u] = cj[o[u]]
            vals[r, u] = -cv[o[u]]
