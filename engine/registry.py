"""Model versions on disk with one atomic "current" pointer.

Layout under a root (the engine's MODELS_DIR, or the GRU's own root; the code is the same):

    ROOT/CURRENT                   {"version": "<id>"}  (written to a temp file, then os.replace)
    ROOT/versions/<id>/            a complete version; version.json is written last, before the
                                   staging directory is renamed into place
    ROOT/versions/.staging-<id>/   a version being built; never promoted, removed on cleanup

A version only becomes visible by an atomic rename of its finished staging directory, and the
pointer only moves by an atomic os.replace, so a writer killed at any point leaves CURRENT and every
complete version untouched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

POINTER = "CURRENT"
VERSIONS = "versions"
META = "version.json"
STAGING_PREFIX = ".staging-"


class RegistryError(RuntimeError):
    """A registry file is missing or malformed (the message names the file)."""


class RegistryLocked(RegistryError):
    """Another writer holds the registry lock."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON next to `path`, fsync it, then os.replace it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def new_version_id(now: float | None = None) -> str:
    """Sortable id: UTC time to the microsecond plus a random suffix (no clashes between hosts)."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    return f"{stamp}.{int((now % 1) * 1e6):06d}Z-{secrets.token_hex(2)}"


@dataclass
class Staging:
    """A version under construction: write files into `path`, then `Registry.commit` it."""

    version: str
    path: Path


@dataclass
class Registry:
    """Versions of one kind of model (engine, GRU, ...) under `root`; keeps the newest `keep`."""

    root: Path
    keep: int = 5

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")

    @property
    def versions_dir(self) -> Path:
        return self.root / VERSIONS

    @property
    def pointer_path(self) -> Path:
        return self.root / POINTER

    def path(self, version: str) -> Path:
        return self.versions_dir / version

    # ---- reading -------------------------------------------------------------------------
    def current(self) -> str | None:
        """The promoted version id, or None before the first promotion."""
        p = self.pointer_path
        if not p.exists():
            return None
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
            version = obj["version"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise RegistryError(f'{p}: expected JSON {{"version": "<id>"}}: {e}') from e
        if not isinstance(version, str) or not (self.path(version) / META).is_file():
            raise RegistryError(
                f"{p}: points at {version!r}, which is not a complete version "
                f"under {self.versions_dir}"
            )
        return version

    def current_path(self) -> Path | None:
        v = self.current()
        return None if v is None else self.path(v)

    def versions(self) -> list[str]:
        """Complete versions, oldest first (ids sort by creation time)."""
        if not self.versions_dir.is_dir():
            return []
        return sorted(
            d.name
            for d in self.versions_dir.iterdir()
            if d.is_dir() and not d.name.startswith(".") and (d / META).is_file()
        )

    def meta(self, version: str) -> dict:
        p = self.path(version) / META
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise RegistryError(f"{p}: no such version") from e
        except json.JSONDecodeError as e:
            raise RegistryError(f"{p}: invalid JSON: {e}") from e

    def history(self) -> Iterator[dict]:
        for v in self.versions():
            yield self.meta(v)

    # ---- writing -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, wait: bool = True) -> Iterator[None]:
        """Exclusive writer lock (flock on ROOT/.lock); the kernel drops it if the holder dies."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError as e:
                raise RegistryLocked(f"{self.root / '.lock'}: another writer holds the lock") from e
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def stage(self, version: str | None = None) -> Staging:
        """Create an empty staging directory for a new version."""
        version = version or new_version_id()
        if self.path(version).exists():
            raise RegistryError(f"{self.path(version)}: version already exists")
        path = self.versions_dir / f"{STAGING_PREFIX}{version}"
        path.mkdir(parents=True, exist_ok=False)
        return Staging(version=version, path=path)

    def commit(self, staging: Staging, meta: dict | None = None) -> Path:
        """Write version.json into the staging dir, then rename it into place (atomic)."""
        info = dict(meta or {})
        info.update(version=staging.version, created=info.get("created", time.time()))
        write_json_atomic(staging.path / META, info)
        final = self.path(staging.version)
        os.rename(staging.path, final)
        _fsync_dir(self.versions_dir)
        return final

    def update_meta(self, version: str, **fields: Any) -> dict:
        """Merge fields into a complete version's version.json (atomic rewrite)."""
        info = self.meta(version)
        info.update(fields)
        write_json_atomic(self.path(version) / META, info)
        return info

    def promote(self, version: str) -> None:
        """Point CURRENT at a complete version: one os.replace of a freshly written file."""
        if not (self.path(version) / META).is_file():
            raise RegistryError(
                f"{self.path(version)}: not a complete version; refusing to promote"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.pointer_path, {"version": version, "promoted": time.time()})
        log.info("promoted %s under %s", version, self.root)

    def prune(self, keep: int | None = None) -> list[str]:
        """Delete the oldest complete versions beyond `keep`; never the current one."""
        keep = self.keep if keep is None else keep
        current = self.current()
        versions = self.versions()
        doomed = [v for v in versions[:-keep] if v != current] if len(versions) > keep else []
        for v in doomed:
            # Rename first so a kill mid-delete never leaves a half-deleted "complete" version.
            trash = self.versions_dir / f"{STAGING_PREFIX}deleted-{v}"
            os.rename(self.path(v), trash)
            shutil.rmtree(trash, ignore_errors=True)
        return doomed

    def cleanup_staging(self, older_than_s: float = 0.0) -> list[str]:
        """Remove staging directories left by killed or failed builds (call under `lock`)."""
        if not self.versions_dir.is_dir():
            return []
        now, removed = time.time(), []
        for d in self.versions_dir.iterdir():
            if d.name.startswith(STAGING_PREFIX) and now - d.stat().st_mtime >= older_than_s:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
        return removed
