"""Astec (DeepXML, WSDM'21) on CPU: four modules, re-ranker, ensembles. See docs/model-format.md.

Both names import on first use, after OMP_WAIT_POLICY is set: `AstecConfig` without torch
(the CLI reads its defaults at start-up), `Astec` with it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# torch's OpenMP threads spin while they wait for each other; on a machine whose cores other
# processes share, that spinning stole the cores the other thread needed (one 8,000-point
# epoch under load 13: Module I 20.9 -> 1.7 s, Module IV 14.6 -> 3.0 s with passive waiting;
# docs/engine-training.md). Read when the OpenMP runtime starts, i.e. only if torch is not
# imported yet; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if TYPE_CHECKING:
    from .config import AstecConfig
    from .model import Astec

__all__ = ["Astec", "AstecConfig"]


def __getattr__(name: str) -> Any:
    if name == "AstecConfig":
        from .config import AstecConfig

        return AstecConfig
    if name == "Astec":
        from .model import Astec

        return Astec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
