"""PECOS XR-Linear as a peer of `astec bench peers` and `astec bench predict`, in its own venv.

libpecos 1.2.8 declares torch, transformers, peft and datasets (for its X-Transformer) and caps
numpy below 2 and scipy below 1.14: installed into the project's environment it would downgrade
both. XR-Linear itself needs numpy, scipy and scikit-learn only, so it gets its own environment,
.venv-pecos/ at the repository root (ASTEC_PECOS_VENV moves it), made once by `make peers-pecos`
or by the first bench that needs it: libpecos without its declared dependencies, beside the
numpy / scipy / scikit-learn it runs on and the small libraries the benches' workers import
(click, psutil, tqdm). The project's code reaches it only through a subprocess
(bench/pecos_worker.py, or bench/engine_predict.py's serving loop) and files: CSR npz in, npy
and JSON out, no pickle.

    python -m bench.pecos_peer        # make the environment (what `make peers-pecos` runs)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from bench.subprocesses import run_worker

REPO = Path(__file__).resolve().parents[1]
PECOS = "libpecos==1.2.8"
# what XR-Linear runs on (numpy < 2 and scipy < 1.14 are libpecos' own caps) and what the
# benches' workers import there (bench.engine_predict's serving loop: click, psutil; engine.text)
REQUIREMENTS = (
    "numpy==1.26.4",
    "scipy==1.13.1",
    "scikit-learn==1.5.2",
    "click>=8.1",
    "psutil>=5.9",
    "tqdm>=4.66",
)
ENV_VAR = "ASTEC_PECOS_VENV"


class PecosEnvError(RuntimeError):
    """PECOS' environment could not be made (the message holds pip's last lines)."""


def env_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or REPO / ".venv-pecos")


def _stamp(d: Path) -> Path:
    """Written last: an environment without it is incomplete (or of other requirements)."""
    key = hashlib.sha1("\n".join((PECOS, *REQUIREMENTS)).encode()).hexdigest()[:12]
    return d / f".installed-{key}"


def ready() -> bool:
    """Whether the environment is made (for the requirements above)."""
    return _stamp(env_dir()).exists()


def env_python(echo: Callable[[str], object] = print) -> Path:
    """The environment's python, making the environment first when it is missing (about a
    minute: ~80 MB of wheels); echo reports that. Safe when two benches start at once."""
    d = env_dir()
    py = d / "bin" / "python"
    if _stamp(d).exists():
        return py
    d.parent.mkdir(parents=True, exist_ok=True)
    with open(d.parent / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _stamp(d).exists():  # another bench made it while this one waited
            return py
        echo(
            f"making PECOS XR-Linear's own environment in {d} (once; about a minute): "
            f"{PECOS} without its X-Transformer dependencies, {', '.join(REQUIREMENTS)}"
        )
        for old in d.glob(".installed-*") if d.exists() else ():
            old.unlink()
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(d)],
            [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *REQUIREMENTS],
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-deps",
                PECOS,
            ],
            [str(py), "-c", "import pecos.xmc.xlinear.train, pecos.xmc.xlinear.model"],
        ]
        for cmd in steps:
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                tail = (res.stdout + res.stderr).strip().splitlines()[-5:]
                raise PecosEnvError(
                    f"making {d} failed at `{' '.join(cmd[1:4])} ...` "
                    f"(exit {res.returncode}): {' | '.join(tail)}"
                )
        _stamp(d).touch()
        echo(f"PECOS environment ready: {py}")
    return py


def worker_env() -> dict:
    """The environment variables of a process in PECOS' venv: the repository on its path (the
    worker imports bench and engine from it, not from an installed copy)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}


def _save_csr(path: Path, M) -> str:
    M = sp.csr_matrix(M, dtype=np.float32)
    M.sort_indices()
    sp.save_npz(path, M, compressed=False)
    return str(path)


def run(job: dict, work: Path, echo: Callable[[str], object] = print) -> tuple[dict, float]:
    """Run bench.pecos_worker on `job` in PECOS' venv; (its JSON reply, its peak RSS in MB)."""
    py = env_python(echo)
    job = {**job, "out_json": str(work / "pecos.json")}
    spec = work / "pecos-job.json"
    spec.write_text(json.dumps(job))
    log = work / "pecos.log"
    with open(log, "wb") as f:
        status, ru = run_worker(
            [str(py), "-m", "bench.pecos_worker", str(spec)],
            cwd=str(REPO),
            env=worker_env(),
            stdout=f,
            stderr=f,
        )
    if status != 0 or not Path(job["out_json"]).exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"PECOS worker failed (wait status {status}): {' | '.join(tail)}")
    return json.loads(Path(job["out_json"]).read_text()), ru.ru_maxrss / 1024.0


def fit_predict(Xtr, Ytr, Xte, k: int, threads: int, echo: Callable[[str], object] = print):
    """Train XR-Linear on (Xtr, Ytr) with its CLI defaults and predict Xte's top k: (timings
    {train_s, train_cpu_s, predict_s}, ids [n, k] with -1 pads, the worker's peak RSS MB)."""
    with tempfile.TemporaryDirectory(prefix="astec-pecos-") as tmp:
        w = Path(tmp)
        job = {
            "x": _save_csr(w / "X.npz", Xtr),
            "y": _save_csr(w / "Y.npz", Ytr),
            "model": str(w / "model"),
            "threads": int(threads),
            "test_x": _save_csr(w / "Xte.npz", Xte),
            "k": int(k),
            "ids_out": str(w / "ids.npy"),
        }
        out, rss = run(job, w, echo)
        return out, np.load(w / "ids.npy", allow_pickle=False), rss


def train_model(X, Y, model_dir: Path, threads: int, echo: Callable[[str], object] = print):
    """Train XR-Linear on (X, Y) into model_dir (its saved form: JSON and npz); its timings."""
    with tempfile.TemporaryDirectory(prefix="astec-pecos-") as tmp:
        w = Path(tmp)
        job = {
            "x": _save_csr(w / "X.npz", X),
            "y": _save_csr(w / "Y.npz", Y),
            "model": str(model_dir),
            "threads": int(threads),
        }
        return run(job, w, echo)[0]


if __name__ == "__main__":
    try:
        env_python()
    except PecosEnvError as e:
        sys.exit(str(e))
