"""Serving the GRU policy without torch: pick one query per page view from the last K states.

`GruPolicy.load(path)` takes a policy version directory or a registry root (ROOT/CURRENT ->
ROOT/versions/<id>/); with a root it hot-reloads: every `reload_every_s` it looks at CURRENT
and swaps in a newly promoted version, keeping the old one if the new one is refused.

Cold start and bad state never fail an event: no history -> the current page's top query;
history states of another feature size or with no queries are dropped; query ids outside the
model's label space are ignored as candidates. The window is the one training read
(personalization.state.serving_window): states ordered by timestamp, none after the current
visit, none older than the policy's TTL, none of another engine label space.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from personalization import logit_kernel
from personalization.artifact import PolicyFileError, load_policy
from personalization.explain import page_top, sources
from personalization.features import (
    EventBatch,
    build_batch,
    cluster_lookup,
    pad_shown,
    pad_states,
    page_feature_dim,
)
from personalization.scoring import candidate_logits, softmax_masked
from personalization.serve_kernels import serve_rows
from personalization.state import UserState, serving_window
from personalization.window import WINDOW

log = logging.getLogger(__name__)

BACKENDS = ("compiled", "onnx", "numpy")  # GruPolicy.backend: how the logits are computed
# An engine's scores lie in [0, 1 + label_text_weight] and that weight is at most 1e3 (the
# predictor's config check): a stored score beyond this, or NaN, is a corrupt record
MAX_ABS_SCORE = 1e6
NO_QUERY = -1  # returned (with score 0.0) when the current page has no predicted query
# Exploration of the served policy (what makes its logs teach a successor): with probability
# EPSILON the shown query is drawn from softmax(logits / TEMPERATURE) over the same candidates
# the policy ranks, else the policy's top choice. Every candidate keeps a propensity >= EPSILON *
# its softmax share, so DR / SNIPS can evaluate any later policy on these candidates; 0.1 costs
# at most 10% of the traffic's greedy value.
EPSILON = 0.1
TEMPERATURE = 1.0


@dataclass
class Served:
    """What was served for a batch of events, and everything a log needs to learn from it.

    Candidates are padded to C columns with id -1, ordered by the policy's preference.
    """

    query: np.ndarray  # int64 [B] the shown query id (-1: nothing to show)
    score: np.ndarray  # float32 [B] the policy's softmax probability of that query
    propensity: np.ndarray  # float32 [B] P(the exploring policy shows that query)
    greedy: np.ndarray  # bool [B] the shown query is the policy's top choice
    cand_ids: np.ndarray  # int64 [B,C] every candidate the policy ranked (-1 padding)
    cand_scores: np.ndarray  # float32 [B,C] the policy's softmax probability of each
    cand_prop: np.ndarray  # float32 [B,C] P(shown) of each under the exploring policy
    # why (personalization.explain): visits ago of the window state the query came from (0 =
    # this page, -1 unknown), that state's event id, and the policy's probability of the query
    # minus that of the page's own top query (NaN unknown); None: not computed
    source_ago: np.ndarray | None = None  # int64 [B]
    source_event: list[str] | None = None  # [B]
    margin: np.ndarray | None = None  # float32 [B]

    def fields(self, i: int) -> dict:
        """The ad-query message fields of event i (query names are the caller's)."""
        m = self.cand_ids[i] >= 0

        def r6(x):  # float64 before rounding: float32 would print as 0.12345699965953827
            return np.round(x.astype(np.float64), 6).tolist()

        out = {
            "query_id": int(self.query[i]),
            "score": float(self.score[i]),
            "propensity": float(self.propensity[i]),
            "candidate_ids": self.cand_ids[i][m].tolist(),
            "candidate_scores": r6(self.cand_scores[i][m]),
            "candidate_propensities": r6(self.cand_prop[i][m]),
            "explored": not bool(self.greedy[i]),
        }
        if self.source_ago is not None and self.source_ago[i] >= 0:
            out["source_visits_ago"] = int(self.source_ago[i])
            if self.source_event is not None and self.source_event[i]:
                out["source_event_id"] = self.source_event[i]
        if self.margin is not None and np.isfinite(self.margin[i]):
            out["margin"] = round(float(self.margin[i]), 6)
        return out


def explore(
    logits: np.ndarray,
    mask: np.ndarray,
    epsilon: float,
    temperature: float,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(choice column [B], propensities [B,C], softmax scores [B,C]) of the epsilon-mixture of
    the greedy policy and softmax(logits / temperature); vectorised over the batch."""
    B, C = logits.shape
    lg = np.where(mask, logits, -np.inf)
    probs = softmax_masked(lg)
    soft = probs if temperature == 1.0 else softmax_masked(lg / max(temperature, 1e-6))
    top = np.argmax(lg, axis=1)
    prop = epsilon * soft
    prop[np.arange(B), top] += 1.0 - epsilon
    u = rng.random(B) * prop.sum(1)
    col = np.minimum((np.cumsum(prop, 1) < u[:, None]).sum(1), C - 1)
    col = np.where(mask[np.arange(B), col], col, top)
    return col, prop.astype(np.float32), probs.astype(np.float32)


def state_arrays(state) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z float32[D], query ids int64[k], scores float32[k]) of one UserState."""
    return (
        np.asarray(state.z, np.float32).reshape(-1),
        np.asarray(state.query_ids, np.int64).reshape(-1),
        np.asarray(state.scores, np.float32).reshape(-1),
    )


def state_shown(state) -> int:
    """The query id shown to the user at a stored visit (UserState.shown; -1: none, unknown, or
    a state of a format that did not record it)."""
    try:
        return int(getattr(state, "shown", -1))
    except (TypeError, ValueError):
        return -1


def _resolve(path: Path) -> tuple[Path, Path | None, str | None]:
    """(version dir, registry root or None, version id or None) for a dir or a registry root."""
    if (path / "CURRENT").exists():
        from engine.registry import Registry, RegistryError

        try:
            reg = Registry(path)
            version = reg.current()
        except RegistryError as e:
            raise PolicyFileError(str(e)) from e
        if version is None:
            raise PolicyFileError(f"{path}: the registry has no promoted version")
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
    # "compiled" (logit_kernel, the fast path), "onnx" (ONNX Runtime on the exported graph) or
    # "numpy" (scoring.candidate_logits, the reference)
    backend: str = "compiled"
    fallbacks: int = 0  # events answered by the cold-start rule because of bad state
    _session: Any = field(default=None, repr=False)  # onnxruntime.InferenceSession or None
    _kw: tuple | None = field(default=None, repr=False)  # logit_kernel.kernel_weights
    _next_check: float = field(default=0.0, repr=False)
    refused: dict[str, str] = field(default_factory=dict, repr=False)  # version -> reason
    _ttl: tuple = field(default=(None, 0.0), repr=False)  # (manifest, its ttl_s)

    @classmethod
    def load(
        cls, path: str | Path, reload_every_s: float = 5.0, backend: str = "compiled"
    ) -> GruPolicy:
        """Load and verify a policy (version dir or registry root); PolicyFileError if corrupt.

        backend "compiled" scores with one compiled call per batch (`logit_kernel`); "onnx"
        with ONNX Runtime (numpy if the version has no model.onnx); "numpy" with the pure-numpy
        forward pass. All three give the same logits to float32 rounding.
        """
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        vdir, root, version = _resolve(Path(path))
        weights, manifest, onnx_bytes = load_policy(vdir)
        version = version or manifest.get("version") or vdir.name
        log.info("GRU policy %s loaded from %s", version, vdir)
        pol = cls(
            weights=weights,
            manifest=manifest,
            path=vdir,
            root=root,
            version=version,
            reload_every_s=reload_every_s,
            backend=backend,
            _session=_make_session(onnx_bytes, backend, vdir),
            _kw=_kernel_weights(weights, backend),
            _next_check=time.monotonic() + reload_every_s,
        )
        pol.warm()
        return pol

    def warm(self) -> None:
        """Compile (or load from numba's cache) every kernel serving uses, on one synthetic
        two-visit window, before the first real event: on a fresh install they compile for
        ~10-20 s, which on a consumer's poll thread would outlast its max.poll.interval."""
        k = min(10, self.n_labels)
        ids, sc = np.arange(k), np.linspace(1.0, 0.1, k, dtype=np.float32)
        z = np.zeros(self.feature_dim, np.float16)
        a, b = (UserState(f"warm-{i}", 1.0 + i, 0, 0, z, ids, sc) for i in range(2))
        self.serve_batch([[a]], [b], rng=np.random.default_rng(0))

    @property
    def K(self) -> int:
        return int(self.manifest["config"]["K"])

    @property
    def topk(self) -> int | None:
        """Predicted queries per page it was trained on (None: a version that did not say)."""
        cfg = self.manifest.get("config", {})
        k = cfg.get("topk", self.manifest.get("train", {}).get("config", {}).get("topk"))
        return None if k is None else int(k)

    @property
    def ttl_s(self) -> float:
        """States older than this before the visit are out of its window (as in training);
        read once per manifest (it is asked per event)."""
        if self._ttl[0] is not self.manifest:
            cfg = self.manifest.get("config", {})
            t = cfg.get("ttl_s", self.manifest.get("train", {}).get("config", {}).get("ttl_s"))
            self._ttl = (self.manifest, WINDOW.ttl_s if t is None else float(t))
        return self._ttl[1]

    @property
    def label_space(self) -> str | None:
        """Fingerprint of the label space of the engine it was trained on
        (engine.manifest.label_space); None for a version that did not record it."""
        ls = self.manifest.get("engine_label_space")
        return str(ls) if ls else None

    @property
    def feature_dim(self) -> int:
        cl = cluster_lookup(self.weights)
        n = 0 if cl is None else len(cl.kappa)
        return page_feature_dim(int(self.weights["gru.w_ih"].shape[1]), n)

    @property
    def n_labels(self) -> int:
        return int(self.weights["query_table"].shape[0])

    # ---- hot reload ----------------------------------------------------------------------
    def maybe_reload(self, force: bool = False) -> bool:
        """Swap in a newly promoted version of the registry root; True if it changed.

        The stream's rule (stream.registry_watch, which the stream uses instead of this): a
        version that fails to load is refused once (logged, in `refused`), never retried."""
        if self.root is None:
            return False
        now = time.monotonic()
        if not force and now < self._next_check:
            return False
        self._next_check = now + self.reload_every_s
        try:
            vdir, _, version = _resolve(self.root)
        except (PolicyFileError, OSError) as e:
            log.error("GRU policy registry unreadable, keeping %s: %s", self.version, e)
            return False
        if version == self.version or version in self.refused:
            return False
        try:
            weights, manifest, onnx_bytes = load_policy(vdir)
            sess = _make_session(onnx_bytes, self.backend, vdir)
            kw = _kernel_weights(weights, self.backend)
        except (PolicyFileError, OSError) as e:
            self.refused[str(version)] = str(e)
            log.error(
                "GRU policy %s refused (not retried), keeping %s: %s", version, self.version, e
            )
            return False
        self.weights, self.manifest, self.path, self.version = weights, manifest, vdir, version
        self._session, self._kw = sess, kw
        log.info("GRU policy hot-reloaded: now %s", version)
        return True

    # ---- scoring -------------------------------------------------------------------------
    def _clean(self, history: Sequence, current) -> tuple | None:
        """(z, ids, scores, ts, event ids) of the usable window (<= K states, current last), or
        None if the current page itself is unusable (-> cold-start rule)."""
        D = self.feature_dim
        window = serving_window(history, current, self.K, self.ttl_s)
        zs, ids, scs, tss, eids, shown = [], [], [], [], [], []
        for s in window:  # at most K states: only attribute and length checks per state
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
            eids.append(str(getattr(s, "event_id", "")))
            shown.append(state_shown(s))
        try:
            I = np.array(ids, np.int64)
            S = np.array(scs, np.float32)
        except ValueError:  # states with different k: pad to the longest
            k = max(len(x) for x in ids)
            I = np.full((len(ids), k), -1, np.int64)
            S = np.zeros((len(ids), k), np.float32)
            for r, (i, sc) in enumerate(zip(ids, scs, strict=True)):
                I[r, : len(i)] = i
                S[r, : len(sc)] = sc
        I[(I < 0) | (I >= self.n_labels)] = -1
        sh = np.array(shown, np.int64)
        sh[(sh < 0) | (sh >= self.n_labels)] = -1
        Z, T = np.array(zs, np.float32), np.array(tss, np.float64)
        # a state with a NaN or infinite feature or a score no predictor gives (a corrupt record)
        # is dropped like one of the wrong size (NaN and inf survive the feature sums)
        ok = np.isfinite(Z.sum(1)) & _sane(S).all(1)
        if not ok.all():
            if not ok[-1]:
                return None
            keep = np.flatnonzero(ok)
            Z, I, S, T, sh = Z[keep], I[keep], S[keep], T[keep], sh[keep]
            eids = [eids[j] for j in keep]
        return Z, I, S, T, eids, sh

    @staticmethod
    def _top_of(state) -> tuple[int, float]:
        try:
            _, ids, sc = state_arrays(state)
        except (AttributeError, TypeError, ValueError):
            return NO_QUERY, 0.0
        if ids.size == 0:
            return NO_QUERY, 0.0
        if sc.shape != ids.shape:
            return int(ids[0]), 0.0
        fin = _sane(sc)  # a corrupt score ranks nothing, is never reported
        j = int(np.argmax(np.where(fin, sc, -np.inf))) if fin.any() else 0
        return int(ids[j]), float(sc[j]) if fin[j] else 0.0

    def rank_batch(
        self, histories: Sequence[Sequence], currents: Sequence
    ) -> list[tuple[np.ndarray, np.ndarray] | None]:
        """Per event: (candidate ids, probabilities) best first, or None for the cold-start rule."""
        self.maybe_reload()
        out: list = [None] * len(currents)
        rows, seqs = [], []
        for b, (hist, cur) in enumerate(zip(histories, currents, strict=True)):
            if not hist:
                continue
            arr = self._clean(hist, cur)
            if arr is None or not (arr[1][-1] >= 0).any():
                self.fallbacks += 1
                continue
            if len(arr[0]) == 1:  # no usable history left: the cold-start rule
                continue
            rows.append(b)
            seqs.append(arr)
        if not seqs:
            return out
        batch = self._window_batch(seqs)[0]
        probs = softmax_masked(self.logits(batch))
        order = np.argsort(-probs, axis=1, kind="stable")
        n_c = batch.cand_mask.sum(1)
        for r, b in enumerate(rows):
            o = order[r, : n_c[r]]
            out[b] = (batch.cand_ids[r, o], probs[r, o])
        return out

    def logits(self, batch: EventBatch) -> np.ndarray:
        """Candidate logits [B,C] (-inf on padding) by the policy's backend."""
        if self._kw is not None:
            return logit_kernel.candidate_logits(
                self._kw, batch.z, batch.state_mask, batch.cand_ids, batch.cand_mask, batch.feats
            )
        if self._session is None:
            return candidate_logits(self.weights, batch)
        B, K, _ = batch.z.shape
        n = batch.state_mask.sum(1)
        T = int(n.max())
        if (n == T).all():
            z = batch.z[:, K - T :]
        else:  # right-aligned -> left-aligned rows for the GRU op's sequence_lens
            idx = (np.arange(T)[None, :] + (K - n)[:, None]) % K
            z = batch.z[np.arange(B)[:, None], idx]
        out = self._session.run(
            None,
            {
                "z": np.ascontiguousarray(z.transpose(1, 0, 2)),
                "seq_lens": n.astype(np.int32),
                "cand": np.where(batch.cand_mask, batch.cand_ids, 0),
                "feats": batch.feats,
            },
        )[0]
        return np.where(batch.cand_mask, out, -np.inf).astype(np.float32)

    def choose_batch(
        self, histories: Sequence[Sequence], currents: Sequence
    ) -> list[tuple[int, float]]:
        """One (query id, score) per event; score = the policy's probability of that query."""
        ranked = self.rank_batch(histories, currents)
        res = []
        for r, cur in zip(ranked, currents, strict=True):
            if r is None or r[0].size == 0:
                res.append(self._top_of(cur))
            else:
                res.append((int(r[0][0]), float(r[1][0])))
        return res

    def serve_batch(
        self,
        histories: Sequence[Sequence],
        currents: Sequence,
        epsilon: float = EPSILON,
        temperature: float = TEMPERATURE,
        rng: np.random.Generator | None = None,
    ) -> Served:
        """Serve one query per event with exploration over the candidates the policy ranks
        (the window's union; the current page's queries for cold-start events, ranked by their
        Astec score), returning what a log needs to learn from it (`Served`)."""
        self.maybe_reload()
        rng = rng if rng is not None else np.random.default_rng()
        n = len(currents)
        rows, seqs = [], []
        cold_ids: list[np.ndarray | None] = [None] * n
        cold_sc: list[np.ndarray] = [np.zeros(0, np.float32)] * n
        for b, (hist, cur) in enumerate(zip(histories, currents, strict=True)):
            arr = self._clean(hist, cur) if hist else None
            if hist and arr is None:
                self.fallbacks += 1
            if arr is not None and len(arr[0]) > 1 and (arr[1][-1] >= 0).any():
                rows.append(b)
                seqs.append(arr)
                continue
            try:
                _, i, sc = state_arrays(cur)
                ok = (i >= 0) & (i < self.n_labels) & _sane(sc) if sc.shape == i.shape else i < -1
            except (AttributeError, TypeError, ValueError):
                i, sc, ok = np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, bool)
            cold_ids[b], cold_sc[b] = i[ok], sc[ok]
        if seqs:
            batch, ids, scores, smask = self._window_batch(seqs)
        if seqs and len(rows) == n:  # every event has a window: nothing to merge (batch 1's case)
            cand, logit, mask, none = batch.cand_ids, self.logits(batch), batch.cand_mask, None
            top = page_top(ids[:, -1], scores[:, -1])
        else:
            C = max(
                [batch.cand_ids.shape[1] if seqs else 1]
                + [len(x) for x in cold_ids if x is not None]
            )
            cand = np.full((n, C), -1, np.int64)
            logit = np.full((n, C), -np.inf, np.float32)
            top = np.full(n, -1, np.int64)  # the page's own top query (explain.margins)
            if seqs:
                r = np.asarray(rows)
                cand[r, : batch.cand_ids.shape[1]] = batch.cand_ids
                logit[r, : batch.cand_ids.shape[1]] = self.logits(batch)
                top[r] = page_top(ids[:, -1], scores[:, -1])
            for b, ci in enumerate(cold_ids):  # cold rows: at most top-k copies
                if ci is not None and len(ci):
                    cand[b, : len(ci)] = ci
                    logit[b, : len(ci)] = cold_sc[b] * 8.0  # Astec scores as log-odds
                    top[b] = ci[int(np.argmax(cold_sc[b]))]
            mask = cand >= 0
            none = ~mask.any(1)
            mask[none, 0] = True  # keep the maths finite; these rows show nothing
            logit[none, 0] = 0.0
        # policy.explore and the logged arrays in one compiled pass (serve_kernels)
        col, greedy, p_col, q_col, cand_o, cand_s, cand_p, margin = serve_rows(
            logit, mask, cand, float(epsilon), float(temperature), rng.random(n), top
        )
        q = cand[np.arange(n), col]
        if none is not None:
            q[none] = NO_QUERY
            p_col = np.where(none, np.float32(0.0), p_col)
            q_col = np.where(none, np.float32(1.0), q_col)
        ago = np.where(q >= 0, 0, -1)  # cold rows: the current page's own queries
        src = [str(getattr(c, "event_id", "")) for c in currents]
        if seqs:
            a = sources(ids, smask, q[np.asarray(rows)])
            for j, b in enumerate(rows):  # the source state's event id (its window slot)
                ago[b] = a[j]
                eids = seqs[j][4]
                src[b] = eids[len(eids) - 1 - a[j]] if a[j] >= 0 else ""
        return Served(
            query=q,
            score=p_col,
            propensity=q_col,
            greedy=greedy,
            cand_ids=cand_o,
            cand_scores=cand_s,
            cand_prop=cand_p,
            source_ago=ago,
            source_event=src,
            margin=margin,
        )

    def _window_batch(self, seqs: list[tuple]) -> tuple:
        """(EventBatch, ids, scores, state mask) of the events' cleaned windows (`_clean`)."""
        z, ids, scores, smask, ts = pad_states([a[:4] for a in seqs], self.K)
        batch = build_batch(
            z,
            ids,
            scores,
            smask,
            self.weights["log_pop"],
            ts,
            self.weights["sim_table"],
            self.weights["sim_norm"],
            cluster_lookup(self.weights),
            pad_shown([a[5] for a in seqs], self.K),
        )
        return batch, ids, scores, smask

    def choose(self, history: Sequence, current) -> tuple[int, float]:
        """The query to send to the ads pipeline for this visit (history oldest first)."""
        if not history:
            return self._top_of(current)
        return self.choose_batch([history], [current])[0]


def _sane(scores: np.ndarray) -> np.ndarray:
    """bool, per score: one a predictor can give (not NaN, |s| <= MAX_ABS_SCORE)."""
    return np.abs(scores) <= MAX_ABS_SCORE


def _kernel_weights(weights: dict, backend: str) -> tuple | None:
    return logit_kernel.kernel_weights(weights) if backend == "compiled" else None


def _make_session(onnx_bytes: bytes | None, backend: str, vdir: Path):
    if backend != "onnx" or onnx_bytes is None:
        return None
    from personalization.onnx_graph import session

    try:
        return session(onnx_bytes)
    except Exception as e:  # onnxruntime raises its own exception types for bad graphs
        raise PolicyFileError(f"{vdir / 'model.onnx'}: ONNX Runtime refused the graph ({e})") from e
