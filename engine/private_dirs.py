"""Directories only their owner can read (0700): the model registry, the click log and the
local services' data keep tokens, passwords and users' clicks there."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def private_dir(path: Path, top: Path | None = None) -> Path:
    """Create directory `path` 0700, or set an existing one of ours to 0700 (someone else's is
    left as it is); chmod right after mkdir, so no umask narrows or widens it. With `top` (an
    ancestor of path, e.g. a log directory the operator names) every directory from top down
    to path is made so too, but an existing top is left as it is (the operator's own choice).
    Directories above top (or above path) are created with default permissions. Returns path."""
    first = path if top is None else top
    first.parent.mkdir(parents=True, exist_ok=True)
    parts = path.relative_to(first).parts
    for d in [first] + [first.joinpath(*parts[: i + 1]) for i in range(len(parts))]:
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:  # already there (or another writer made it just now)
            if top is not None and d == top:
                continue
        with contextlib.suppress(PermissionError):  # someone else's directory: leave it
            os.chmod(d, 0o700)
    return path
