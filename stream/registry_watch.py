"""One hot-reload rule for every artefact the stream serves from a registry (the engine predictor,
the GRU policy).

A registry root holds CURRENT (`{"version": "<id>"}`) and versions/<id>/. Between batches the
worker polls: at most every `check_every_s` the watcher reads CURRENT, and when it names another
version, loads it. A version whose load or compatibility check fails is refused: one error log
line, counted in `refused` (published as the consumer metric `refused_versions`), the old
artefact kept, and never tried again (a registry version is immutable; promoting another one is
the way forward). An unreadable CURRENT keeps the old artefact too, logged once per distinct
error rather than on every poll.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def is_registry(path: Path) -> bool:
    """A registry root (CURRENT or versions/), as opposed to one fixed artefact directory."""
    return (path / "CURRENT").is_file() or (path / "versions").is_dir()


@dataclass
class RegistryWatcher:
    """The version of `what` (named in log lines) served from the registry at `root`.

    `load` turns a version directory into the artefact, raising to refuse it."""

    root: Path
    load: Callable[[Path], Any]
    what: str
    check_every_s: float = 1.0
    version: str = ""
    refused: dict[str, str] = field(default_factory=dict)  # version -> reason
    reloads: int = 0
    _next_check: float = 0.0
    _unreadable: str = ""  # the last CURRENT error logged

    def open(self) -> Any:
        """The promoted version's artefact, loaded now; raises if there is none or it fails (at
        start a bad artefact is an error, not something to keep serving around)."""
        from engine.registry import Registry

        registry = Registry(self.root)
        version = registry.current()
        if version is None:
            raise FileNotFoundError(f"{self.root / 'CURRENT'}: no promoted {self.what} version yet")
        artefact = self.load(registry.path(version))
        self.version = version
        self._next_check = time.monotonic() + self.check_every_s
        return artefact

    def poll(self, force: bool = False) -> Any | None:
        """The newly promoted version's artefact once it loaded (self.version moves to it), else
        None. Never raises for a bad version or an unreadable CURRENT."""
        from engine.registry import Registry

        now = time.monotonic()
        if not force and now < self._next_check:
            return None
        self._next_check = now + self.check_every_s
        registry = Registry(self.root)
        try:
            version = registry.current()
        except Exception as exc:  # noqa: BLE001 - a torn/malformed pointer keeps the old one
            if str(exc) != self._unreadable:
                self._unreadable = str(exc)
                log.error(
                    "%s registry %s unreadable, keeping %s: %s",
                    self.what,
                    self.root,
                    self.version,
                    exc,
                )
            return None
        self._unreadable = ""
        if version is None or version == self.version or version in self.refused:
            return None
        try:
            artefact = self.load(registry.path(version))
        except Exception as exc:  # noqa: BLE001 - any load or check failure refuses the version
            self.refused[version] = f"{type(exc).__name__}: {exc}"
            log.error(
                "%s version %s refused (not retried), keeping %s: %s",
                self.what,
                version,
                self.version,
                self.refused[version],
            )
            return None
        log.warning("%s hot-reloaded: %s -> %s", self.what, self.version, version)
        self.version = version
        self.reloads += 1
        return artefact
