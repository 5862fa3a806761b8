"""Astec (DeepXML, WSDM'21) on CPU: four modules, re-ranker, ensembles. See docs/model-format.md."""
from .config import AstecConfig
from .model import Astec

__all__ = ["Astec", "AstecConfig"]
