"""How the consumer picks ONE query per page view: `top1` or the personalization GRU.

A policy has `name`, `needs_history` (whether the consumer fetches the user's earlier states)
and `choose_batch(histories, currents, ids, scores) -> (query ids int64[n], scores float32[n],
propensities float32[n])`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Top1Policy:
    """The current page's best predicted query (deterministic: propensity 1); -1 if it has none."""

    name: str = "top1"
    needs_history: bool = False
    version: str = "top1"

    def choose_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray):
        best = np.argmax(np.where(ids >= 0, scores, -np.inf), axis=1)   # -1 = padding
        rows = np.arange(ids.shape[0])
        return ids[rows, best], scores[rows, best].astype(np.float32), np.ones(len(rows), np.float32)

    def maybe_reload(self) -> bool:
        return False


@dataclass
class GruStreamPolicy:
    """personalization.policy.GruPolicy over the user's last K states (hot-reloads itself)."""

    gru: Any
    name: str = "gru"
    needs_history: bool = True

    @property
    def version(self) -> str:
        return str(self.gru.version)

    def choose_batch(self, histories, currents, ids: np.ndarray, scores: np.ndarray):
        chosen = self.gru.choose_batch(histories, currents)
        q = np.array([c[0] for c in chosen], np.int64)
        s = np.array([c[1] for c in chosen], np.float32)
        # events the GRU could not score (NO_QUERY) fall back to the page's top query
        bad = q < 0
        if bad.any():
            q[bad], s[bad], _ = Top1Policy().choose_batch(None, None, ids[bad], scores[bad])
        return q, s, np.ones(len(q), np.float32)   # argmax: a deterministic choice

    def maybe_reload(self) -> bool:
        return bool(self.gru.maybe_reload())


def make_policy(name: str, model_dir: str | Path | None = None):
    """`top1`, or `gru` loaded from model_dir (a policy version dir or a registry root)."""
    if name == "top1":
        return Top1Policy()
    if name == "gru":
        if not model_dir:
            raise ValueError("--policy gru needs --policy-model DIR (a GRU policy or its registry)")
        from personalization.policy import GruPolicy
        return GruStreamPolicy(GruPolicy.load(model_dir))
    raise ValueError(f"unknown policy {name!r}: expected top1 or gru")
