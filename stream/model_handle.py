"""The predictor a consumer uses, with hot reload from the model registry between batches.

`--model PATH` is a predictor directory or a registry version holding one (fixed), or a registry
root holding CURRENT (`{"version": "<id>"}`) and versions/<id>/predictor/ (followed). Between
batches the consumer calls `maybe_reload()`, which follows CURRENT by the one rule of
stream.registry_watch (a version that fails to load is refused once, logged and counted, and the
old predictor kept). With `background=True` (the stream workers) the new version is loaded and
warmed on the watcher's own thread and `maybe_reload()` only swaps it in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream.registry_watch import RegistryWatcher, is_registry


def load_predictor(path: str | Path, threads: int = 1) -> Any:
    """engine.predictor.Predictor.load(path, threads) (imported lazily: it is not small)."""
    from engine.predictor import Predictor

    return Predictor.load(str(path), threads=threads)


def check_model(path: str | Path) -> None:
    """Raise (naming the file) unless `path` is an exported predictor, a registry version holding
    one, or a registry whose promoted version does (engine.model_paths: a trained model is
    refused with the export command to run): the supervisor checks once, so a wrong --model is
    one clear error rather than workers restarting on it until they give up. Files are checked
    for presence and size; each worker verifies their hashes when it loads them."""
    from engine.manifest import verify_manifest
    from engine.model_paths import ModelPathError, require

    p = Path(path)
    if is_registry(p) and not (p / "CURRENT").is_file():
        raise ModelPathError(f"{p / 'CURRENT'}: no promoted model version yet")
    verify_manifest(require(p, "predictor").path, check_hashes=False)


@dataclass
class ModelHandle:
    """The predictor in use; from a registry root it follows CURRENT (stream.registry_watch)."""

    path: Path
    predictor: Any
    version: str
    watcher: RegistryWatcher | None = None  # None: a fixed predictor directory
    _space: tuple[Any, str] = (None, "")  # (predictor, its label space), computed once each

    @property
    def label_space(self) -> str:
        """engine.manifest.label_space_of the predictor in use (what a GRU policy must match,
        and what the states written now are tagged with)."""
        if self._space[0] is not self.predictor:
            from engine.manifest import label_space_of

            self._space = (self.predictor, label_space_of(self.predictor))
        return self._space[1]

    @classmethod
    def open(
        cls,
        path: str | Path,
        loader: Callable[[Path], Any] = load_predictor,
        check_every_s: float = 1.0,
        background: bool = False,
    ) -> ModelHandle:
        p = Path(path)
        if not is_registry(p):  # a predictor, or a registry version holding one: fixed
            version = ""
            if (p / "version.json").is_file():
                from engine.model_paths import require

                mp = require(p, "predictor")
                p, version = mp.path, mp.version or ""
            predictor = loader(p)
            version = version or str(getattr(predictor, "version", "") or p.name)
            return cls(p, predictor, version)
        watcher = RegistryWatcher(
            p, lambda vdir: loader(vdir / "predictor"), "model", check_every_s
        )
        predictor = watcher.open()
        if background:
            watcher.start()
        return cls(p, predictor, watcher.version, watcher)

    def close(self) -> None:
        """Stop the background loader, if any (a daemon thread: it never holds the exit)."""
        if self.watcher is not None:
            self.watcher.stop()

    @property
    def refused(self) -> dict[str, str]:
        """Versions refused so far (version -> reason)."""
        return self.watcher.refused if self.watcher else {}

    @property
    def reloads(self) -> int:
        return self.watcher.reloads if self.watcher else 0

    def maybe_reload(self, force: bool = False) -> bool:
        """Switch to a newly promoted version; True when switched. Never raises for a bad model."""
        if self.watcher is None:
            return False
        predictor = self.watcher.poll(force)
        if predictor is None:
            return False
        self.predictor, self.version = predictor, self.watcher.version
        return True
