"""Model versions on disk with one atomic "current" pointer.

Layout under a root (the engine's MODELS_DIR, or the GRU's own root; the code is the same):

    ROOT/CURRENT                   {"version": "<id>"}  (written to a temp file, then os.replace)
    ROOT/versions/<id>/            a complete version; version.json is written last, before the
                                   staging directory is renamed into place
    ROOT/versions/.staging-<id>/   a version being built; never promoted, removed on cleanup

A version only becomes visible by an atomic rename of its finished staging directory, and the
pointer only moves by an atomic os.replace, so a writer killed at any point leaves CURRENT and every
complete version untouched. Models are trained on users' behaviour: the registry's own files are
created 0600 and its directories 0700 whatever the umask, and a committed version's whole tree
is set so (whoever wrote the files in it). CURRENT may only name a complete version directly
under versions/: `../x`, an absolute path or a missing version is refused with a RegistryError
naming the file.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.private_dirs import private_dir

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


def _private_tree(root: Path) -> None:
    """Directories 0700 and files 0600 under `root` (symlinks are left as they are)."""
    os.chmod(root, 0o700)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o600)


def _private_open(path: Path, flags: int) -> int:
    """os.open with mode 0600 set by fchmod, so the umask changes nothing."""
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return fd


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON (0600) next to `path`, fsync it, then os.replace it over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")
    fd = _private_open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
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

    def _check_name(self, version: Any, where: Path) -> str:
        """`version` if it can name a version directory directly under versions/, else a
        RegistryError naming `where` (a path, `..`, a hidden or staging name, not a string)."""
        if (
            not isinstance(version, str)
            or version in ("", ".", "..")
            or version.startswith(".")
            or any(c in version for c in "/\\\0")
            or Path(version).is_absolute()
        ):
            raise RegistryError(
                f"{where}: version {version!r} is not a version name (a directory directly "
                f"under {self.versions_dir}); refusing it"
            )
        return version

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
        self._check_name(version, p)
        if not (self.path(version) / META).is_file():
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
        p = self.path(self._check_name(version, self.versions_dir)) / META
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
        private_dir(self.root)
        with os.fdopen(_private_open(self.root / ".lock", os.O_WRONLY | os.O_CREAT), "a") as f:
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
        version = self._check_name(version or new_version_id(), self.versions_dir)
        if self.path(version).exists():
            raise RegistryError(f"{self.path(version)}: version already exists")
        private_dir(self.root)
        private_dir(self.versions_dir)
        path = self.versions_dir / f"{STAGING_PREFIX}{version}"
        path.mkdir(mode=0o700)
        os.chmod(path, 0o700)
        return Staging(version=version, path=path)

    def commit(self, staging: Staging, meta: dict | None = None) -> Path:
        """Write version.json into the staging dir, make its tree private (0700 / 0600), then
        rename it into place (atomic)."""
        info = dict(meta or {})
        info.update(version=staging.version, created=info.get("created", time.time()))
        write_json_atomic(staging.path / META, info)
        _private_tree(staging.path)
        final = self.path(staging.version)
        os.rename(staging.path, final)
        _fsync_dir(self.versions_dir)
        return final

    def promote(self, version: str) -> None:
        """Point CURRENT at a complete version: one os.replace of a freshly written file."""
        self._check_name(version, self.pointer_path)
        if not (self.path(version) / META).is_file():
            raise RegistryError(
                f"{self.path(version)}: not a complete version; refusing to promote"
            )
        private_dir(self.root)
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
