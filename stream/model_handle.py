"""The predictor a consumer uses, with hot reload from the model registry between batches.

`--model PATH` is either a predictor directory (fixed) or a registry root holding CURRENT
(`{"version": "<id>"}`) and versions/<id>/predictor/. Between batches the consumer calls
`maybe_reload()`: when CURRENT names another version it loads that predictor; if loading fails
the version is refused (logged, counted, not retried until CURRENT changes) and the old one kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)


def load_predictor(path: str | Path, threads: int = 1) -> Any:
    """engine.predictor.Predictor.load(path, threads) (imported lazily: it is not small)."""
    from engine.predictor import Predictor

    return Predictor.load(str(path), threads=threads)


def _is_registry(path: Path) -> bool:
    return (path / "CURRENT").is_file() or (path / "versions").is_dir()


def check_model(path: str | Path) -> None:
    """Raise (naming the file) unless `path` is an exported predictor or a registry whose promoted
    version holds one: the supervisor checks once, so a wrong --model is one clear error rather
    than workers restarting on it until they give up. Files are checked for presence and size;
    each worker verifies their hashes when it loads them."""
    from engine.manifest import verify_manifest

    p = Path(path)
    if _is_registry(p):
        from engine.registry import Registry

        registry = Registry(p)
        version = registry.current()
        if version is None:
            raise FileNotFoundError(f"{p / 'CURRENT'}: no promoted model version yet")
        p = registry.path(version) / "predictor"
    verify_manifest(p, check_hashes=False)


@dataclass
class ModelHandle:
    path: Path
    loader: Callable[[Path], Any] = load_predictor
    check_every_s: float = 1.0
    predictor: Any = None
    version: str = ""
    refused: dict = field(default_factory=dict)  # version -> reason
    reloads: int = 0
    _next_check: float = 0.0

    @classmethod
    def open(
        cls,
        path: str | Path,
        loader: Callable[[Path], Any] = load_predictor,
        check_every_s: float = 1.0,
    ) -> "ModelHandle":
        h = cls(Path(path), loader, check_every_s)
        if _is_registry(h.path):
            version = h._current()
            if version is None:
                raise FileNotFoundError(f"{h.path / 'CURRENT'}: no promoted model version yet")
            h.predictor, h.version = h._load_version(version), version
        else:
            h.predictor = loader(h.path)
            h.version = str(getattr(h.predictor, "version", "") or h.path.name)
        h._next_check = time.monotonic() + check_every_s
        return h

    @property
    def is_registry(self) -> bool:
        return _is_registry(self.path)

    def _current(self) -> str | None:
        from engine.registry import Registry

        return Registry(self.path).current()

    def _load_version(self, version: str) -> Any:
        from engine.registry import Registry

        return self.loader(Registry(self.path).path(version) / "predictor")

    def maybe_reload(self, force: bool = False) -> bool:
        """Switch to a newly promoted version; True when switched. Never raises for a bad model."""
        if not self.is_registry:
            return False
        now = time.monotonic()
        if not force and now < self._next_check:
            return False
        self._next_check = now + self.check_every_s
        try:
            version = self._current()
        except Exception as exc:  # noqa: BLE001 - a torn/malformed pointer keeps the old model
            log.error("model registry %s unreadable, keeping %s: %s", self.path, self.version, exc)
            return False
        if version is None or version == self.version or version in self.refused:
            return False
        try:
            predictor = self._load_version(version)
        except Exception as exc:  # noqa: BLE001 - any load failure refuses the version
            self.refused[version] = f"{type(exc).__name__}: {exc}"
            log.error("model version %s refused, keeping %s: %s", version, self.version, exc)
            return False
        log.warning("model hot-reloaded: %s -> %s", self.version, version)
        self.predictor, self.version = predictor, version
        self.reloads += 1
        return True
