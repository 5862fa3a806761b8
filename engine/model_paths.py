"""One notion of "a model" for every command: a registry root, one of its versions, a trained
model directory or an exported predictor, resolved to the directory a command can load.

Users hold whichever the last command printed (`astec retrain` a registry, `astec train --out` a
model, `astec export` a predictor); refusing all but one of them, with a message that did not say
which was wanted, was the most common first error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["model", "predictor"]

KINDS_HELP = (
    "a model registry (the directory holding CURRENT), one of its versions (versions/ID), a "
    "trained model directory (`astec train --out`) or an exported predictor (`astec export`)"
)


class ModelPathError(ValueError):
    """The path is none of the things a model can be, or lacks the kind a command needs."""


@dataclass(frozen=True)
class ModelPath:
    path: Path  # the directory to load
    kind: Kind
    version: str | None  # the registry version, when the path came through a registry


def kind_of(d: Path) -> Kind | None:
    """What the directory D holds: an exported predictor, a trained model, or neither."""
    if (d / "manifest.json").is_file() and (d / "predictor.json").is_file():
        return "predictor"
    if (d / "manifest.json").is_file() and (d / "config.json").is_file():
        return "model"
    return None


def resolve_model(path: str | Path, prefer: Kind = "predictor") -> ModelPath:
    """The loadable directory PATH names; a registry or version yields PREFER when it has both."""
    p = Path(path)
    if not p.exists():
        raise ModelPathError(f"{p}: no such directory; give {KINDS_HELP}")
    version = None
    if (p / "CURRENT").is_file():
        from engine.registry import Registry, RegistryError

        try:
            cur = Registry(p).current_path()
        except RegistryError as e:
            raise ModelPathError(str(e)) from None
        if cur is None:
            raise ModelPathError(f"{p}: the registry has no promoted version yet")
        p, version = cur, cur.name
    if (p / "version.json").is_file():
        version = version or p.name
        other: Kind = "model" if prefer == "predictor" else "predictor"
        for want in (prefer, other):
            if kind_of(p / want) == want:
                return ModelPath(p / want, want, version)
        raise ModelPathError(
            f"{p}: a registry version with no exported predictor (predictor/manifest.json) and "
            "no trained model (model/manifest.json)"
        )
    found = kind_of(p)
    if found is None:
        raise ModelPathError(
            f"{p}: not a model (no CURRENT, version.json or manifest.json in it); give {KINDS_HELP}"
        )
    return ModelPath(p, found, version)


def _what(mp: ModelPath) -> str:
    at = f" (registry version {mp.version})" if mp.version else ""
    what = "an exported predictor" if mp.kind == "predictor" else "a trained model"
    return f"{mp.path} is {what}{at}"


def require(path: str | Path, kind: Kind) -> ModelPath:
    """resolve_model(PATH) when it yields KIND, else one error saying what PATH holds and how to
    get the KIND a command needs (a trained model is exported; a predictor cannot be turned back
    into a model)."""
    mp = resolve_model(path, prefer=kind)
    if mp.kind == kind:
        return mp
    if kind == "predictor":
        raise ModelPathError(
            f"{_what(mp)}, not an exported predictor: export it with "
            f"`astec export --model {mp.path} --out DIR` and give DIR, or give a registry "
            "(`astec retrain` exports every version)"
        )
    raise ModelPathError(
        f"{_what(mp)}, not a trained model: this command needs the model `astec train --out` "
        "wrote (or a registry version holding one); a predictor cannot be turned back into one"
    )
