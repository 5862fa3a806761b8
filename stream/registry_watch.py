"""One hot-reload rule for every artefact the stream serves from a registry (the engine predictor,
the GRU policy).

A registry root holds CURRENT (`{"version": "<id>"}`) and versions/<id>/. Between batches the
worker polls: at most every `check_every_s` the watcher reads CURRENT, and when it names another
version, loads it. A version whose load or compatibility check fails is refused: one error log
line, counted in `refused` (published as the consumer metric `refused_versions`), the old
artefact kept, and never tried again (a registry version is immutable; promoting another one is
the way forward). An unreadable CURRENT keeps the old artefact too, logged once per distinct
error rather than on every poll.

In the background mode (`start()`, the stream workers' model) a thread of the watcher's own
checks CURRENT and loads (and warms) a new version, and `poll()` on the worker's thread only
takes what is ready: hashing the files and compiling kernels never hold the poll loop (a 10 s
max.poll.interval, and an open transaction in exactly-once mode), and the worker swaps between
batches.
"""

from __future__ import annotations

import logging
import threading
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
    _latest: str = ""  # the newest version loaded (served, or ready to be taken)
    _ready: tuple | None = None  # (version, artefact) loaded in the background, not yet taken
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _loading: threading.Lock = field(default_factory=threading.Lock)  # one _check at a time

    def open(self) -> Any:
        """The promoted version's artefact, loaded now; raises if there is none or it fails (at
        start a bad artefact is an error, not something to keep serving around)."""
        from engine.registry import Registry

        registry = Registry(self.root)
        version = registry.current()
        if version is None:
            raise FileNotFoundError(f"{self.root / 'CURRENT'}: no promoted {self.what} version yet")
        artefact = self.load(registry.path(version))
        self.version = self._latest = version
        self._next_check = time.monotonic() + self.check_every_s
        return artefact

    def start(self) -> None:
        """Check and load in a daemon thread from now on (poll() then only takes the result)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"astec-{self.what}-reload", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.check_every_s):
            loaded = self._check()
            if loaded is not None:
                with self._lock:
                    self._ready = loaded

    def poll(self, force: bool = False) -> Any | None:
        """The newly promoted version's artefact once it loaded (self.version moves to it), else
        None. Never raises for a bad version or an unreadable CURRENT. In the background mode
        it returns what the watcher's thread has loaded, without waiting (force: check now)."""
        if self._thread is None or force:
            now = time.monotonic()
            if not force and now < self._next_check:
                return None
            self._next_check = now + self.check_every_s
            loaded = self._check()
        else:
            with self._lock:
                loaded, self._ready = self._ready, None
        if loaded is None:
            return None
        version, artefact = loaded
        log.warning("%s hot-reloaded: %s -> %s", self.what, self.version, version)
        self.version = version
        self.reloads += 1
        return artefact

    def _check(self) -> tuple[str, Any] | None:
        """(version, artefact) of a newly promoted version that loaded, else None."""
        with self._loading:
            return self._check_now()

    def _check_now(self) -> tuple[str, Any] | None:
        from engine.registry import Registry

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
        if version is None or version == self._latest or version in self.refused:
            return None
        try:
            artefact = self.load(registry.path(version))
        except Exception as exc:  # noqa: BLE001 - any load or check failure refuses the version
            self.refused[version] = f"{type(exc).__name__}: {exc}"
            log.error(
                "%s version %s refused (not retried), keeping %s: %s",
                self.what,
                version,
                self._latest,
                self.refused[version],
            )
            return None
        self._latest = version
        return version, artefact
