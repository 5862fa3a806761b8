"""Astec (DeepXML, WSDM'21) on CPU: four modules, re-ranker, ensembles. See docs/model-format.md."""

import os

# torch's OpenMP threads spin while they wait for each other; on a machine whose cores other
# processes share, that spinning stole the cores the other thread needed (one 8,000-point
# epoch under load 13: Module I 20.9 -> 1.7 s, Module IV 14.6 -> 3.0 s with passive waiting;
# docs/engine-training.md). Read when the OpenMP runtime starts, i.e. only if torch is not
# imported yet; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .config import AstecConfig  # noqa: E402
from .model import Astec  # noqa: E402

__all__ = ["Astec", "AstecConfig"]
