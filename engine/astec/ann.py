"""Nearest-neighbour search over unit vectors: exact (torch matmul) for small sets, hnswlib above.

At tens of thousands of points a blocked exact search is faster than building an HNSW graph and
has perfect recall; hnswlib (inner product on L2-normalised vectors = cosine) takes over above
`exact_max` vectors so that cost stays O(N log N). Similarities are cosines in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import hnswlib
import numpy as np
import torch
from numba import njit

from .sparse import normalize_rows


@dataclass
class AnnIndex:
    kind: str  # "exact" or "hnsw"
    dim: int
    count: int
    vectors: np.ndarray | None = None  # exact: the normalised vectors
    hnsw: hnswlib.Index | None = None
    ef_search: int = 100

    def _graph(self) -> hnswlib.Index:
        if self.hnsw is None:
            raise ValueError(f"{self.kind} index of {self.count} vectors has no hnswlib graph")
        return self.hnsw

    def _table(self) -> np.ndarray:
        if self.vectors is None:
            raise ValueError(f"{self.kind} index of {self.count} vectors has no vector table")
        return self.vectors

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
    ) -> AnnIndex:
        V = normalize_rows(np.ascontiguousarray(vectors, dtype=np.float32))
        n, d = V.shape
        if n <= exact_max:
            return cls("exact", d, n, vectors=V, ef_search=ef_search)
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

    def as_exact(self) -> AnnIndex:
        """The same vectors searched exactly (blocked matmul + top-k): for bulk searches at a
        large k over a few ten thousand vectors, cheaper than the graph at ef >= k."""
        if self.kind == "exact":
            return self
        V = np.ascontiguousarray(self.vectors_of(np.arange(self.count)))
        return AnnIndex("exact", self.dim, self.count, vectors=V, ef_search=self.ef_search)

    def vectors_of(self, ids: np.ndarray) -> np.ndarray:
        """The stored (normalised) vectors of these ids, float32 [len(ids), dim]."""
        ids = np.asarray(ids, np.int64)
        if self.kind == "exact":
            return self._table()[ids]
        if ids.size == 0:
            return np.zeros((0, self.dim), np.float32)
        return np.asarray(self._graph().get_items(ids), np.float32).reshape(ids.size, self.dim)

    def query(self, Q: np.ndarray, k: int, num_threads: int = 2, block: int = 256):
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
        # ties (duplicate training texts have identical vectors) go to the lower id, as in the
        # exported predictor: take a margin past k; top-k comes sorted by value, so ordering the
        # ids within each run of equal values gives the (-sim, id) order (a lexsort of the tied
        # rows cost a tenth of a bulk search at k = 600 over label centres, which tie often)
        kk = int(min(k + 32, self.count))
        for s in range(0, n, block):
            S = torch.from_numpy(Q[s : s + block]) @ B.T
            top = torch.topk(S, kk, dim=1)
            v, i = top.values.numpy(), top.indices.numpy().astype(np.int64)
            _order_ties(v, i)
            e = s + v.shape[0]
            ids[s:e], sims[s:e] = i[:, :k], v[:, :k]
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
            return cls(
                "exact",
                dim,
                count,
                vectors=np.ascontiguousarray(V, np.float32),
                ef_search=ef_search,
            )
        index = hnswlib.Index(space="ip", dim=dim)
        index.load_index(str(path), max_elements=count)
        if index.get_current_count() != count:
            raise ValueError(
                f"{path}: hnsw index holds {index.get_current_count()} items, expected {count}"
            )
        index.set_ef(ef_search)
        return cls("hnsw", dim, count, hnsw=index, ef_search=ef_search)


@njit(cache=True, nogil=True, boundscheck=False)
def _order_ties(vals, ids):
    """Sort the ids within each run of equal values of rows sorted by descending value."""
    n, m = vals.shape
    for r in range(n):
        a = 0
        while a < m:
            b = a + 1
            while b < m and vals[r, b] == vals[r, a]:
                b += 1
            if b - a > 1:
                ids[r, a:b] = np.sort(ids[r, a:b])
            a = b
