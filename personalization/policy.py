"""Serving the GRU policy without torch: pick one query per page view from the last K states.

`GruPolicy.load(path)` takes a policy version directory or a registry root (ROOT/CURRENT ->
ROOT/versions/<id>/); with a root it hot-reloads: every `reload_every_s` it looks at CURRENT
and swaps in a newly promoted version, keeping the old one if the new one is refused.

Cold start and bad state never fail an event: no history -> the current page's top query;
history states of another feature size or with no queries are dropped; query ids outside the
model's label space are ignored as candidates.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from personalization.artifact import PolicyFileError, load_policy
from personalization.features import EventBatch, build_batch, pad_states
from personalization.scoring import candidate_logits, softmax_masked

log = logging.getLogger(__name__)

NO_QUERY = -1   # returned (with score 0.0) when the current page has no predicted query


def state_arrays(state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z float32[D], query ids int64[k], scores float32[k]) of one UserState."""
    return (np.asarray(state.z, np.float32).reshape(-1),
            np.asarray(state.query_ids, np.int64).reshape(-1),
            np.asarray(state.scores, np.float32).reshape(-1))


def _resolve(path: Path) -> tuple[Path, Path | None, str | None]:
    """(version dir, registry root or None, version id or None) for a dir or a registry root."""
    if (path / "CURRENT").exists():
        from engine.registry import Registry, RegistryError
        try:
            reg = Registry(path)
            version = reg.current()
        except RegistryError as e:
            raise PolicyFileError(str(e)) from e
        return reg.path(version), path, version
    return path, None, None


@dataclass
class GruPolicy:
    """A loaded policy; `choose` / `choose_batch` are the per-event API the stream calls."""

    weights: dict[str, np.ndarray]
    manifest: dict
    path: Path
    root: Path | None = None
    version: str | None = None
    reload_every_s: float = 5.0
    backend: str = "onnx"         # "onnx" (ONNX Runtime, the fast path) or "numpy"
    fallbacks: int = 0            # events answered by the cold-start rule because of bad state
    _session: object = field(default=None, repr=False)
    _next_check: float = field(default=0.0, repr=False)

    @classmethod
    def load(cls, path: str | Path, reload_every_s: float = 5.0, backend: str = "onnx"
             ) -> "GruPolicy":
        """Load and verify a policy (version dir or registry root); PolicyFileError if corrupt.

        backend "onnx" serves with ONNX Runtime (falls back to numpy if the version has no
        model.onnx); "numpy" always uses the pure-numpy forward pass.
        """
        if backend not in ("onnx", "numpy"):
            raise ValueError(f"backend must be 'onnx' or 'numpy', got {backend!r}")
        vdir, root, version = _resolve(Path(path))
        weights, manifest, onnx_bytes = load_policy(vdir)
        version = version or manifest.get("version") or vdir.name
        log.info("GRU policy %s loaded from %s", version, vdir)
        return cls(weights=weights, manifest=manifest, path=vdir, root=root, version=version,
                   reload_every_s=reload_every_s, backend=backend,
                   _session=_make_session(onnx_bytes, backend, vdir),
                   _next_check=time.monotonic() + reload_every_s)

    @property
    def K(self) -> int:
        return int(self.manifest["config"]["K"])

    @property
    def feature_dim(self) -> int:
        return int(self.weights["gru.w_ih"].shape[1]) - 1   # + the block-start channel

    @property
    def n_labels(self) -> int:
        return int(self.weights["query_table"].shape[0])

    # ---- hot reload ----------------------------------------------------------------------
    def maybe_reload(self, force: bool = False) -> bool:
        """Swap in a newly promoted version of the registry root; True if it changed."""
        if self.root is None:
            return False
        now = time.monotonic()
        if not force and now < self._next_check:
            return False
        self._next_check = now + self.reload_every_s
        try:
            vdir, _, version = _resolve(self.root)
            if version == self.version:
                return False
            weights, manifest, onnx_bytes = load_policy(vdir)
            sess = _make_session(onnx_bytes, self.backend, vdir)
        except (PolicyFileError, OSError) as e:
            log.error("GRU policy reload refused, keeping %s: %s", self.version, e)
            return False
        self.weights, self.manifest, self.path, self.version = weights, manifest, vdir, version
        self._session = sess
        log.info("GRU policy hot-reloaded: now %s", version)
        return True

    # ---- scoring -------------------------------------------------------------------------
    def _clean(self, history: Sequence, current) -> tuple | None:
        """Stacked arrays of the usable window (<= K states, current last), or None if the
        current page itself is unusable (-> cold-start rule)."""
        D = self.feature_dim
        window = list(history)[-(self.K - 1):] if self.K > 1 else []
        window.append(current)
        zs, ids, scs, tss = [], [], [], []
        for s in window:   # at most K states: only attribute and length checks per state
            try:
                z, i, sc, t = s.z, s.query_ids, s.scores, float(s.ts)
                ok = len(z) == D and 0 < len(i) == len(sc)
            except (AttributeError, TypeError, ValueError):
                ok = False
            if not ok:
                if s is current:
                    return None
                continue
            zs.append(z)
            ids.append(i)
            scs.append(sc)
            tss.append(t)
        try:
            I = np.array(ids, np.int64)
            S = np.array(scs, np.float32)
        except ValueError:   # states with different k: pad to the longest
            k = max(len(x) for x in ids)
            I = np.full((len(ids), k), -1, np.int64)
            S = np.zeros((len(ids), k), np.float32)
            for r, (i, sc) in enumerate(zip(ids, scs)):
                I[r, :len(i)] = i
                S[r, :len(sc)] = sc
        I[(I < 0) | (I >= self.n_labels)] = -1
        return np.array(zs, np.float32), I, S, np.array(tss, np.float64)

    @staticmethod
    def _top_of(state) -> tuple[int, float]:
        try:
            _, ids, sc = state_arrays(state)
        except (AttributeError, TypeError, ValueError):
            return NO_QUERY, 0.0
        if ids.size == 0:
            return NO_QUERY, 0.0
        j = int(np.argmax(sc)) if sc.shape == ids.shape else 0
        return int(ids[j]), float(sc[j]) if sc.shape == ids.shape else 0.0

    def rank_batch(self, histories: Sequence[Sequence], currents: Sequence
                   ) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Per event: (candidate ids, probabilities) best first, or None for the cold-start rule."""
        self.maybe_reload()
        out: list = [None] * len(currents)
        rows, seqs = [], []
        for b, (hist, cur) in enumerate(zip(histories, currents)):
            if not hist:
                continue
            arr = self._clean(hist, cur)
            if arr is None or not (arr[1][-1] >= 0).any():
                self.fallbacks += 1
                continue
            if len(arr[0]) == 1:   # no usable history left: the cold-start rule
                continue
            rows.append(b)
            seqs.append(arr)
        if not seqs:
            return out
        z, ids, scores, mask, ts = pad_states(seqs, self.K)
        batch = build_batch(z, ids, scores, mask, self.weights["log_pop"], ts,
                            self.weights["sim_table"], self.weights["sim_norm"])
        probs = softmax_masked(self.logits(batch))
        order = np.argsort(-probs, axis=1, kind="stable")
        n_c = batch.cand_mask.sum(1)
        for r, b in enumerate(rows):
            o = order[r, :n_c[r]]
            out[b] = (batch.cand_ids[r, o], probs[r, o])
        return out

    def logits(self, batch: EventBatch) -> np.ndarray:
        """Candidate logits [B,C] (-inf on padding) from ONNX Runtime or numpy."""
        if self._session is None:
            return candidate_logits(self.weights, batch)
        B, K, _ = batch.z.shape
        n = batch.state_mask.sum(1)
        T = int(n.max())
        if (n == T).all():
            z = batch.z[:, K - T:]
        else:   # right-aligned -> left-aligned rows for the GRU op's sequence_lens
            idx = (np.arange(T)[None, :] + (K - n)[:, None]) % K
            z = batch.z[np.arange(B)[:, None], idx]
        out = self._session.run(None, {
            "z": np.ascontiguousarray(z.transpose(1, 0, 2)),
            "seq_lens": n.astype(np.int32),
            "cand": np.where(batch.cand_mask, batch.cand_ids, 0),
            "feats": batch.feats})[0]
        return np.where(batch.cand_mask, out, -np.inf).astype(np.float32)

    def choose_batch(self, histories: Sequence[Sequence], currents: Sequence
                     ) -> list[tuple[int, float]]:
        """One (query id, score) per event; score = the policy's probability of that query."""
        ranked = self.rank_batch(histories, currents)
        res = []
        for r, cur in zip(ranked, currents):
            if r is None or r[0].size == 0:
                res.append(self._top_of(cur))
            else:
                res.append((int(r[0][0]), float(r[1][0])))
        return res

    def choose(self, history: Sequence, current) -> tuple[int, float]:
        """The query to send to the ads pipeline for this visit (history oldest first)."""
        if not history:
            return self._top_of(current)
        return self.choose_batch([history], [current])[0]



def _make_session(onnx_bytes: bytes | None, backend: str, vdir: Path):
    if backend != "onnx" or onnx_bytes is None:
        return None
    from personalization.onnx_graph import session
    try:
        return session(onnx_bytes)
    except Exception as e:  # onnxruntime raises its own exception types for bad graphs
        raise PolicyFileError(f"{vdir / 'model.onnx'}: ONNX Runtime refused the graph ({e})") from e
