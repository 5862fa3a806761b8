"""Astec (DeepXML, WSDM'21) on CPU: four modules, re-ranker, ensembles. See docs/model-format.md.

Both names import on first use, after the OpenMP wait policy is chosen: `AstecConfig` without torch
(the CLI reads its defaults at start-up), `Astec` with it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any


def _oversubscribed() -> bool:
    """The 1-minute load average already exceeds the cores this process may run on."""
    from .config import available_cores  # torch-free

    try:
        return os.getloadavg()[0] > available_cores()
    except (AttributeError, OSError):
        return False


# torch's OpenMP threads spin a while before they sleep when waiting for each other. On a
# machine whose cores other processes share, that spinning steals the cores the other thread
# needs; on a machine of its own, passive waiting makes every small op wake a sleeping thread
# and is slower. So passive only when the machine is already oversubscribed. Read when the
# OpenMP runtime starts, i.e. only if torch is not imported yet; a user's own setting wins.
if _oversubscribed():
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
