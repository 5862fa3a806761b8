"""Integrity manifest of an exported predictor directory (``manifest.json``).

A predictor is loaded by stream consumers that must never run a half-written or tampered model,
so every file of the directory is listed with its size and sha256 (and, for ``.npy`` arrays, its
shape and dtype). `verify_manifest` checks all of them before anything is used and raises a
`ManifestError` naming the offending file; nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "astec-predictor"
FORMAT_VERSION = 1
_CHUNK = 1 << 20


class ManifestError(ValueError):
    """A predictor directory is missing, truncated, tampered with or of an unknown format."""


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (constant memory on large tables)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def label_space(names) -> str:
    """Fingerprint of an engine's label space: sha256 of its label texts in id order (each
    length-prefixed). Two engines with one fingerprint map every label id to the same query; a
    reordered, added, removed or renamed label changes it. A policy trained on one engine's ids
    records it, and the stream serves the policy only with an engine of the same fingerprint."""
    h = hashlib.sha256()
    for n in names:
        b = str(n).encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.hexdigest()


def label_space_of(predictor) -> str:
    """The label-space fingerprint of a loaded predictor: its manifest's `label_space` (written
    by the export), else computed from its label names (a predictor exported before it was
    recorded); "" for an object without label names."""
    data = getattr(getattr(predictor, "manifest", None), "data", None) or {}
    if data.get("label_space"):
        return str(data["label_space"])
    names = getattr(predictor, "label_names", None)
    return label_space(names) if names is not None else ""


def npy_header(path: Path) -> tuple[list[int], str, int]:
    """(shape, dtype str, header length in bytes) of an .npy file without reading its data."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        if fortran:
            raise ManifestError(f"{path}: Fortran-ordered arrays are not supported")
        return list(shape), dtype.str, f.tell()


def describe_file(root: Path, rel: str) -> dict[str, Any]:
    """Manifest entry for one file: bytes + sha256, plus shape/dtype for .npy arrays."""
    path = root / rel
    entry: dict[str, Any] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    if rel.endswith(".npy"):
        shape, dtype, _ = npy_header(path)
        entry["shape"], entry["dtype"] = shape, dtype
    return entry


def write_manifest(root: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file under `root` (except the manifest) and write ``manifest.json`` last.

    Writing it last (via a temporary file + rename) means a directory whose export was
    interrupted has no manifest and is refused by `verify_manifest`.
    """
    root = Path(root)
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST_NAME and not p.name.endswith(".tmp")
    )
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **meta,
        "files": {rel: describe_file(root, rel) for rel in rels},
    }
    tmp = root / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, root / MANIFEST_NAME)
    return manifest


@dataclass
class Manifest:
    """A verified manifest: the JSON content and the directory it vouches for."""

    root: Path
    data: dict[str, Any]
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def path(self, rel: str) -> Path:
        """Path of a file the manifest lists; refuses files it does not vouch for."""
        if rel not in self.files:
            raise ManifestError(
                f"{self.root / MANIFEST_NAME}: no entry for '{rel}' "
                "(the predictor is incomplete or from another format version)"
            )
        return self.root / rel

    def load_npy(self, rel: str, mmap: bool = True) -> np.ndarray:
        """Load a listed .npy array (memory-mapped read-only by default), never with pickle."""
        path = self.path(rel)
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        want = self.files[rel]
        if list(arr.shape) != list(want.get("shape", arr.shape)) or arr.dtype.str != want.get(
            "dtype", arr.dtype.str
        ):
            raise ManifestError(
                f"{path}: array is {arr.dtype.str}{list(arr.shape)}, manifest "
                f"says {want.get('dtype')}{want.get('shape')}"
            )
        # a plain ndarray view of the mapping: same lazily paged memory, but indexing an
        # np.memmap subclass costs ~10 us a call on the predictor's hot path
        return arr.view(np.ndarray) if isinstance(arr, np.memmap) else arr

    def load_json(self, rel: str) -> Any:
        path = self.path(rel)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: line {e.lineno}: invalid JSON: {e.msg}") from e


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Parse ``manifest.json`` and check its format fields (no file hashing)."""
    root = Path(root)
    mpath = root / MANIFEST_NAME
    if not root.is_dir():
        raise ManifestError(f"{root}: predictor directory does not exist")
    if not mpath.is_file():
        raise ManifestError(
            f"{mpath}: missing (not an exported predictor, or the export was interrupted)"
        )
    try:
        data = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        line = getattr(e, "lineno", "?")
        raise ManifestError(f"{mpath}: line {line}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ManifestError(
            f"{mpath}: field 'format' is {data.get('format')!r} (expected {FORMAT_NAME!r})"
            if isinstance(data, dict)
            else f"{mpath}: top level must be a JSON object"
        )
    if data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{mpath}: field 'format_version' is {data.get('format_version')!r};"
            f" this code reads version {FORMAT_VERSION}"
        )
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        raise ManifestError(f"{mpath}: field 'files' is missing or empty")
    for rel, entry in files.items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("bytes"), int)
        ):
            raise ManifestError(f"{mpath}: files['{rel}'] needs 'bytes' (int) and 'sha256'")
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ManifestError(f"{mpath}: files['{rel}'] escapes the predictor directory")
    return data


def verify_manifest(root: str | os.PathLike, check_hashes: bool = True) -> Manifest:
    """Check every listed file exists, has its recorded size and sha256, before any is used.

    Raises `ManifestError` naming the first bad file: missing, truncated (fewer bytes than
    recorded), grown, or tampered (same size, different sha256).
    """
    root = Path(root)
    data = read_manifest(root)
    files: dict[str, dict[str, Any]] = data["files"]
    for rel, entry in files.items():
        path = root / rel
        if not path.is_file():
            raise ManifestError(f"{path}: missing (listed in {MANIFEST_NAME})")
        size = path.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "has grown"
            raise ManifestError(f"{path}: {what}: {size} bytes, manifest says {entry['bytes']}")
    if check_hashes:
        for rel, entry in files.items():
            path = root / rel
            digest = sha256_file(path)
            if digest != entry["sha256"]:
                raise ManifestError(
                    f"{path}: sha256 {digest[:16]}... does not match the "
                    f"manifest's {entry['sha256'][:16]}... (file was modified)"
                )
    return Manifest(root=root, data=data, files=files)
