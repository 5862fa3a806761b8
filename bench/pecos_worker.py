"""PECOS XR-Linear's side of the benchmarks: runs inside .venv-pecos (bench/pecos_peer.py makes
it), never in the project's environment.

Imports numpy, scipy and pecos only, and talks through files: CSR npz in (scipy's save_npz, read
by pecos' own loader, which refuses pickles), npy and JSON out. Training is PECOS' command line
code path (pecos.xmc.xlinear.train: parse_arguments + do_train) with its defaults: PIFA label
features, hierarchical k-means (16 splits, leaves of at most 100 labels), L2R_L2LOSS_SVC_DUAL,
weights below 0.1 dropped, beam 10 at prediction.

    python -m bench.pecos_worker JOB.json
JOB: {"x": train X npz, "y": train Y npz, "model": folder, "threads": n,
      "test_x": npz or null, "k": top k, "ids_out": npy, "out_json": timings}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp


def train(x_path: str, y_path: str, model_dir: str, threads: int) -> tuple[float, float]:
    """Train with the CLI's own code and defaults; (wall s, CPU s of every thread), including
    reading the npz files and writing the model, as the command line does."""
    from pecos.xmc.xlinear import train as cli  # type: ignore[import-not-found]

    args = cli.parse_arguments().parse_args(
        ["-x", x_path, "-y", y_path, "-m", model_dir, "-n", str(threads), "--verbose-level", "0"]
    )
    t0, c0 = time.time(), time.process_time()
    cli.do_train(args)
    return time.time() - t0, time.process_time() - c0


def load(model_dir: str):
    """The trained XLinearModel, for prediction only."""
    from pecos.xmc.xlinear.model import XLinearModel  # type: ignore[import-not-found]

    return XLinearModel.load(model_dir, is_predict_only=True)


def topk_ids(P: sp.csr_matrix, k: int) -> np.ndarray:
    """Top-k label ids [n, k] (-1 pads) of a CSR score matrix, best first, ties to the lower id."""
    P = sp.csr_matrix(P)
    n = P.shape[0]
    ids = np.full((n, k), -1, np.int64)
    if P.nnz == 0 or k == 0:
        return ids
    rows = np.repeat(np.arange(n), np.diff(P.indptr))
    order = np.lexsort((P.indices, -P.data, rows))
    r, c = rows[order], P.indices[order]
    rank = np.arange(r.size) - np.searchsorted(r, r)
    keep = rank < k
    ids[r[keep], rank[keep]] = c[keep]
    return ids


def topk_pairs(P: sp.csr_matrix, k: int) -> list[list[tuple[int, float]]]:
    """Each row's top-k (label, score) pairs, best first: the peers' prediction shape."""
    P = sp.csr_matrix(P)
    out = []
    for i in range(P.shape[0]):
        a, b = P.indptr[i], P.indptr[i + 1]
        idx, val = P.indices[a:b], P.data[a:b]
        order = np.lexsort((idx, -val))[:k]
        out.append(list(zip(idx[order].tolist(), val[order].tolist(), strict=True)))
    return out


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out: dict = {}
    if job.get("x"):
        out["train_s"], out["train_cpu_s"] = train(
            job["x"], job["y"], job["model"], int(job["threads"])
        )
    if job.get("test_x"):
        model = load(job["model"])
        X = sp.load_npz(job["test_x"]).tocsr().astype(np.float32)
        t0 = time.time()
        P = model.predict(X, only_topk=int(job["k"]), threads=int(job["threads"]))
        ids = topk_ids(P, int(job["k"]))
        out["predict_s"] = time.time() - t0
        np.save(job["ids_out"], ids, allow_pickle=False)
    Path(job["out_json"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
