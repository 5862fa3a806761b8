"""On-disk GRU policy: `weights.safetensors` + `manifest.json` (format, sizes, sha256).

The manifest pins every file's sha256 so a truncated or tampered model is refused at load with
an error naming the file, instead of serving garbage. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from engine.manifest import sha256_file
from personalization.features import FEATURE_NAMES, FIT_KEY, FeatureFit, cluster_lookup
from personalization.scoring import WEIGHT_SHAPES

FORMAT = "astec-gru-policy/3"  # 3: a feature of what the user was shown at earlier visits
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
ONNX = "model.onnx"


class PolicyFileError(ValueError):
    """A policy directory that is missing, corrupt or of another format."""


def save_policy(
    out_dir: str | Path, weights: dict[str, np.ndarray], config: dict, meta: dict | None = None
) -> Path:
    """Write weights + manifest into out_dir (created); returns the manifest path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    missing = [k for k in WEIGHT_SHAPES if k not in weights]
    if missing:
        raise ValueError(f"policy weights lack {missing}")
    fit = weights.get(FIT_KEY)  # the fitted feature constants go in the manifest, as JSON
    weights = {k: v for k, v in weights.items() if not k.startswith("_")}
    save_file(
        {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}, str(out / WEIGHTS)
    )
    from personalization.onnx_graph import build_onnx

    (out / ONNX).write_bytes(build_onnx(weights))
    manifest = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "feature_names": list(FEATURE_NAMES),
        "n_labels": int(weights["query_table"].shape[0]),
        "feature_dim": int(weights["gru.w_ih"].shape[1]),
        "files": {name: sha256_file(out / name) for name in (WEIGHTS, ONNX)},
        **(meta or {}),
    }
    if fit is not None:
        manifest["feature_fit"] = FeatureFit.from_array(fit).to_json()
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, out / MANIFEST)
    return out / MANIFEST


def load_policy(model_dir: str | Path) -> tuple[dict[str, np.ndarray], dict, bytes | None]:
    """Verified (weights, manifest, ONNX bytes or None) of a policy directory.

    Every file the manifest lists is checked against its sha256; PolicyFileError names the file.
    """
    d = Path(model_dir)
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise PolicyFileError(f"{mpath}: no GRU policy manifest here")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PolicyFileError(f"{mpath}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PolicyFileError(f"{mpath}: field 'format' is {got!r}, expected {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise PolicyFileError(f"{mpath}: field 'files' must list {WEIGHTS} with its sha256")
    for name, want in files.items():
        fpath = d / name
        if "/" in name or not fpath.is_file():
            raise PolicyFileError(f"{fpath}: missing (listed in {mpath})")
        digest = sha256_file(fpath)
        if digest != want:
            raise PolicyFileError(
                f"{fpath}: sha256 {digest[:16]}… does not match the manifest's "
                f"{str(want)[:16]}… (corrupt or replaced file)"
            )
    wpath = d / WEIGHTS
    try:
        weights = load_file(str(wpath))
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise PolicyFileError(f"{wpath}: unreadable safetensors file ({e})") from e
    missing = [k for k in WEIGHT_SHAPES if k not in weights]
    if missing:
        raise PolicyFileError(f"{wpath}: tensors {missing} missing")
    H3, _D = weights["gru.w_ih"].shape
    H = weights["gru.w_hh"].shape[1]
    Q = weights["user.w"].shape[0]
    if (
        H3 != 3 * H
        or weights["query_table"].shape[1] != Q
        or weights["mlp.w1"].shape[1] != len(FEATURE_NAMES) + Q
    ):
        raise PolicyFileError(
            f"{wpath}: tensor shapes are inconsistent "
            f"(w_ih {weights['gru.w_ih'].shape}, w_hh "
            f"{weights['gru.w_hh'].shape}, mlp.w1 {weights['mlp.w1'].shape})"
        )
    if list(manifest.get("feature_names", [])) != list(FEATURE_NAMES):
        raise PolicyFileError(
            f"{mpath}: field 'feature_names' differs from this code's "
            f"{list(FEATURE_NAMES)}; retrain the policy"
        )
    weights = {k: np.ascontiguousarray(v, np.float32) for k, v in weights.items()}
    try:  # the fitted constants (none in an older policy: its defaults) and the clusters
        weights[FIT_KEY] = FeatureFit.from_json(manifest.get("feature_fit")).to_array()
    except ValueError as e:
        raise PolicyFileError(f"{mpath}: {e}") from e
    try:  # the intent filter's clusters and per-cluster factors must agree
        cluster_lookup(weights)
    except ValueError as e:
        raise PolicyFileError(f"{wpath}: {e}") from e
    onnx_bytes = (d / ONNX).read_bytes() if ONNX in files else None
    return weights, manifest, onnx_bytes
