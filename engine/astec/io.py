"""Model-directory integrity: a manifest of every file's size, sha256 and array shapes.

`write_model_manifest` is called last when saving (via a temporary file + rename), so a directory
whose save was interrupted has no manifest and `verify_model_dir` refuses it, naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from safetensors.numpy import load_file, save_file

from engine.manifest import sha256_file

MANIFEST = "manifest.json"
FORMAT = "astec-model"
VERSION = 1


class ModelDirError(ValueError):
    """A model directory is missing, truncated, tampered with or of an unknown format."""


def save_tensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(path))


def load_tensors(path: Path, shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    try:
        out = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for corrupt headers
        raise ModelDirError(f"{path}: unreadable safetensors file ({e})") from None
    for k, shape in (shapes or {}).items():
        if k not in out:
            raise ModelDirError(f"{path}: tensor {k!r} missing")
        if list(out[k].shape) != list(shape):
            raise ModelDirError(
                f"{path}: tensor {k!r} has shape {list(out[k].shape)}, expected {list(shape)}"
            )
    return out


def save_csr(path: Path, M: sp.csr_matrix) -> None:
    M = sp.csr_matrix(M, dtype=np.float32)
    np.savez(
        path,
        indptr=M.indptr.astype(np.int64),
        indices=M.indices.astype(np.int32),
        data=M.data,
        shape=np.asarray(M.shape, np.int64),
    )


def load_csr(path: Path) -> sp.csr_matrix:
    with np.load(path, allow_pickle=False) as z:
        shape = tuple(int(x) for x in z["shape"])
        M = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=shape)
    M.check_format(full_check=True)
    return M


def write_model_manifest(root: Path, meta: dict) -> dict:
    root = Path(root)
    files = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == MANIFEST or p.name.endswith(".tmp"):
            continue
        rel = p.relative_to(root).as_posix()
        entry = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        if p.suffix == ".npy":
            a = np.load(p, mmap_mode="r", allow_pickle=False)
            entry["shape"], entry["dtype"] = list(a.shape), a.dtype.str
        files[rel] = entry
    manifest = {"format": FORMAT, "format_version": VERSION, **meta, "files": files}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, root / MANIFEST)
    return manifest


def verify_model_dir(root: Path, check_hashes: bool = True) -> dict:
    """Check the manifest and every file it lists; raise ModelDirError naming the first bad file."""
    root = Path(root)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise ModelDirError(f"{root}: model directory does not exist")
    if not mpath.is_file():
        raise ModelDirError(
            f"{mpath}: missing (not an Astec model directory, or saving was interrupted)"
        )
    try:
        m = json.loads(mpath.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ModelDirError(f"{mpath}: field 'format' is not {FORMAT!r}")
    if m.get("format_version") != VERSION:
        raise ModelDirError(
            f"{mpath}: format_version {m.get('format_version')!r}, this code reads {VERSION}"
        )
    files = m.get("files")
    if not isinstance(files, dict) or not files:
        raise ModelDirError(f"{mpath}: field 'files' missing or empty")
    for rel, entry in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ModelDirError(f"{mpath}: files[{rel!r}] escapes the model directory")
        p = root / rel
        if not p.is_file():
            raise ModelDirError(f"{p}: missing (listed in {MANIFEST})")
        size = p.stat().st_size
        if size != entry.get("bytes"):
            what = "truncated" if size < entry.get("bytes", 0) else "has grown"
            raise ModelDirError(f"{p}: {what}: {size} bytes, manifest says {entry.get('bytes')}")
        if check_hashes and sha256_file(p) != entry.get("sha256"):
            raise ModelDirError(f"{p}: sha256 does not match the manifest (file was modified)")
    return m
