"""How the consumer picks ONE query per page view: `top1` or the personalization GRU.

A policy has `name`, `needs_history` (whether the consumer fetches the user's earlier states),
`serve_batch(histories, currents, ids, scores) -> personalization.policy.Served` (the shown query,
its propensity, and every candidate the policy ranked with its score and propensity: what the
ad-query message must log for the trainer) and `choose_batch(...) -> (query ids int64[n],
scores float32[n], propensities float32[n])`, the first three fields of the same draw.

A GRU policy serves only beside an engine of the label space it was trained on (the fingerprint
both manifests record, engine.manifest.label_space): its weights and the stored states name
queries by label id, and an engine whose ids moved would make it show other queries' ads. While
they differ (a new engine promoted under a running policy, or a policy trained on another
engine promoted) every event gets the page's top query: one error line per (policy, engine)
pair, the policy counted in `refused` (the consumer metric `refused_versions`) and its events in
`incoherent_events`, until a policy trained on the served engine is promoted.

The GRU policy explores (epsilon-mixture of its greedy choice and its softmax over the window's
candidates; personalization.policy.EPSILON / TEMPERATURE by default): a policy that only ever
shows its argmax logs nothing a successor can be evaluated or trained on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stream.registry_watch import RegistryWatcher, is_registry
from stream.settings import ConfigError, Settings

if TYPE_CHECKING:
    from personalization.policy import Served

log = logging.getLogger(__name__)


class Policy(Protocol):
    """What the worker's choose stage needs of a policy (Top1Policy, GruStreamPolicy)."""

    @property
    def name(self) -> str: ...

    @property
    def needs_history(self) -> bool:
        """Whether the state stage must fetch the user's earlier states for it."""
        ...

    @property
    def version(self) -> str: ...

    @property
    def refused(self) -> dict[str, str]:
        """Versions refused by its hot reload (version -> reason); empty if it has none."""
        ...

    def serve_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray) -> Served: ...

    def maybe_reload(self) -> bool: ...


@dataclass
class Top1Policy:
    """The current page's best predicted query (deterministic: propensity 1); -1 if it has none."""

    name: str = "top1"
    needs_history: bool = False
    version: str = "top1"

    def choose_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray):
        best = np.argmax(np.where(ids >= 0, scores, -np.inf), axis=1)  # -1 = padding
        rows = np.arange(ids.shape[0])
        return (
            ids[rows, best],
            scores[rows, best].astype(np.float32),
            np.ones(len(rows), np.float32),
        )

    def serve_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray):
        """Deterministic: the page's top-k are the candidates, the top one has propensity 1."""
        from personalization.policy import Served

        ids = np.asarray(ids, np.int64)
        q, s, prop = self.choose_batch(histories, currents, ids, scores)
        sc = np.where(ids >= 0, np.asarray(scores, np.float32), 0.0).astype(np.float32)
        cp = ((ids == q[:, None]) & (ids >= 0)).astype(np.float32)
        return Served(
            query=q,
            score=s,
            propensity=prop,
            greedy=np.ones(len(q), bool),
            cand_ids=ids,
            cand_scores=sc,
            cand_prop=cp,
            source_ago=np.where(q >= 0, 0, -1),  # always this page, by its own top query
            source_event=[str(getattr(c, "event_id", "")) for c in currents or [None] * len(q)],
            margin=np.where(q >= 0, 0.0, np.nan).astype(np.float32),
        )

    @property
    def refused(self) -> dict[str, str]:
        return {}

    def maybe_reload(self) -> bool:
        return False


@dataclass
class GruStreamPolicy:
    """personalization.policy.GruPolicy over the user's last K states; from a registry root its
    `watcher` swaps in newly promoted versions (stream.registry_watch's rule)."""

    gru: Any
    name: str = "gru"
    needs_history: bool = True
    epsilon: float | None = None  # None: personalization.policy.EPSILON
    temperature: float | None = None  # None: personalization.policy.TEMPERATURE
    seed: int | None = None
    watcher: RegistryWatcher | None = None  # None: a fixed version directory
    engine: Any = None  # the served engine (stream.model_handle.ModelHandle); None: unchecked
    incoherent_events: int = 0  # events answered with the page's top query: label spaces differ
    _rng: Any = field(default=None, repr=False)
    _mismatch: str = field(default="", repr=False)  # why the policy is off now ("" = serving)
    _said: tuple = field(default=(), repr=False)  # the (policy, engine) pair last logged

    @property
    def version(self) -> str:
        return str(self.gru.version)

    def coherence(self) -> str:
        """Why the policy may not serve beside the engine in use, or "" when it may (logged
        once per (policy version, engine version) pair, at error level; back at info level)."""
        if self.engine is None:
            return ""
        want, have = getattr(self.gru, "label_space", None), self.engine.label_space
        pair = (self.version, str(self.engine.version))
        why = ""
        if (want is None or not have) and pair != self._said:
            log.warning(
                "GRU policy %s or engine %s records no label space: served unchecked "
                "(retrain the policy with `astec personalize train` to record it)",
                *pair,
            )
        elif want is not None and have and want != have:
            why = (
                f"GRU policy {pair[0]} was trained on engine "
                f"{self.gru.manifest.get('engine_version') or '?'} (label space {want[:12]}), "
                f"the served engine {pair[1]} has label space {have[:12]}: serving each page's "
                f"top query until a policy trained on engine {pair[1]} is promoted "
                f"(astec personalize train --models <its registry>)"
            )
            if pair != self._said:
                log.error("%s", why)
        elif self._mismatch:
            log.info("GRU policy %s matches engine %s: serving it again", *pair)
        self._said, self._mismatch = pair, why
        return why

    def serve_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray):
        """One exploring draw per event over the candidates the GRU ranks (`Served`); the
        page's top query for every event while the policy and the engine disagree on the label
        space (`coherence`)."""
        from personalization import policy as P

        if self.coherence():
            self.incoherent_events += len(currents)
            return Top1Policy().serve_batch(None, currents, np.asarray(ids, np.int64), scores)
        if self._rng is None:
            self._rng = np.random.default_rng(self.seed)
        sv = self.gru.serve_batch(
            histories,
            currents,
            P.EPSILON if self.epsilon is None else self.epsilon,
            P.TEMPERATURE if self.temperature is None else self.temperature,
            self._rng,
        )
        # events the GRU could not score (NO_QUERY) fall back to the page's top query
        bad = np.flatnonzero(sv.query < 0)
        if len(bad):
            ids = np.asarray(ids, np.int64)
            fb = Top1Policy().serve_batch(None, None, ids[bad], scores[bad])
            sv.query[bad], sv.score[bad], sv.propensity[bad] = fb.query, fb.score, fb.propensity
            sv.greedy[bad] = True
            if sv.source_ago is not None and sv.margin is not None:
                sv.source_ago[bad], sv.margin[bad] = fb.source_ago, fb.margin
            w = min(ids.shape[1], sv.cand_ids.shape[1])
            for arr, src in (
                (sv.cand_ids, fb.cand_ids),
                (sv.cand_scores, fb.cand_scores),
                (sv.cand_prop, fb.cand_prop),
            ):
                arr[bad] = -1 if arr is sv.cand_ids else 0
                arr[bad, :w] = src[:, :w]
        return sv

    def choose_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray):
        sv = self.serve_batch(histories, currents, ids, scores)
        return sv.query, sv.score, sv.propensity

    @property
    def refused(self) -> dict[str, str]:
        """Versions its hot reload refused, and the one in hand while it is off because its
        label space is not the engine's."""
        out = dict(self.watcher.refused) if self.watcher else {}
        if self._mismatch:
            out[self.version] = self._mismatch
        return out

    def maybe_reload(self) -> bool:
        if self.watcher is None:
            return False
        gru = self.watcher.poll()
        if gru is None:
            return False
        self.gru = gru
        return True


class PolicyMismatch(ConfigError):
    """A GRU policy's window does not fit the stream's settings (the message says how to fix)."""


def check_window(settings: Settings, k: int, topk: int | None, where: str) -> None:
    """Raise PolicyMismatch unless the policy at `where` (k states per window, trained on topk
    queries per page) fits the stream: Redis keeps state_k states per user, so a window of more
    would never fill; and the policy's features count queries among each page's top_k, so it
    must see as many as it was trained on (topk None: a version that did not record it)."""
    if k > settings.state.k:
        raise PolicyMismatch(
            f"{where}: the GRU policy reads K={k} states per user but the stream keeps "
            f"state_k={settings.state.k}: set state_k >= {k} (config file or ASTEC_STATE_K) "
            f"or train the policy with --K {settings.state.k} or less"
        )
    if topk is not None and topk != settings.prediction.top_k:
        raise PolicyMismatch(
            f"{where}: the GRU policy was trained on topk={topk} queries per page but the "
            f"stream predicts top_k={settings.prediction.top_k}: set top_k = {topk} (config file "
            f"or ASTEC_TOP_K) or train the policy with --topk {settings.prediction.top_k}"
        )


def load_gru(path: Path, settings: Settings | None = None) -> Any:
    """personalization.policy.GruPolicy of one version directory (its own reload off: the
    stream's watcher reloads), refused (PolicyMismatch) if its window does not fit `settings`."""
    from personalization.policy import GruPolicy

    gru = GruPolicy.load(path)
    if settings is not None:
        check_window(settings, gru.K, gru.topk, str(path))
    return gru


def make_policy(
    name: str,
    model_dir: str | Path | None = None,
    epsilon: float | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    settings: Settings | None = None,
    check_every_s: float = 5.0,
    engine: Any = None,
) -> Policy:
    """`top1`, or `gru` loaded from model_dir (a policy version dir, or a registry root whose
    CURRENT is followed every `check_every_s`), serving with exploration `epsilon` /
    `temperature` (None: the defaults; epsilon 0 = greedy). With `settings`, a GRU version whose
    window does not fit them raises PolicyMismatch at start and is refused on reload. With
    `engine` (the served ModelHandle), the GRU serves only while its label space is the
    engine's (GruStreamPolicy.coherence)."""
    if name == "top1":
        return Top1Policy()
    if name == "gru":
        if not model_dir:
            raise ValueError("--policy gru needs --policy-model DIR (a GRU policy or its registry)")
        path = Path(model_dir)
        if not is_registry(path):
            return GruStreamPolicy(
                load_gru(path, settings),
                epsilon=epsilon,
                temperature=temperature,
                seed=seed,
                engine=engine,
            )
        watcher = RegistryWatcher(
            path, lambda vdir: load_gru(vdir, settings), "GRU policy", check_every_s
        )
        return GruStreamPolicy(
            watcher.open(),
            epsilon=epsilon,
            temperature=temperature,
            seed=seed,
            watcher=watcher,
            engine=engine,
        )
    raise ValueError(f"unknown policy {name!r}: expected top1 or gru")
