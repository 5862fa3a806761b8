"""`astec bench predict`: latency, throughput, load time and memory of the CPU predictor, measured
side by side with the torch model path and the omikuji / napkinXC / PECOS XR-Linear peers on the
same texts.

Every system runs in its own fresh subprocess pinned to one thread (OMP/BLAS/torch/hnswlib/ORT),
so load time and resident memory are that system's alone; the timings alternate between the
systems in short rounds, so a busy shared machine slows all of them alike and the ratios are
like for like.
Tokenisation / TF-IDF vectorisation is inside every timed call (the peers use the predictor's
own vectoriser, loaded from the predictor directory). PECOS' worker runs this same module in
PECOS' own environment (bench/pecos_peer.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from engine.cli_options import renamed_option

SYSTEMS = ("predictor", "predictor-onnx", "torch", "omikuji", "napkinxc", "pecos")
PEERS = ("omikuji", "napkinxc", "pecos")
BATCHES = (1, 32, 256)
_ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "RAYON_NUM_THREADS": "1",
}


# ---- measurement helpers (used inside workers) ------------------------------------------------
def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _summary(ms: np.ndarray) -> dict:
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 4),
        "p90_ms": round(float(np.percentile(ms, 90)), 4),
        "p99_ms": round(float(np.percentile(ms, 99)), 4),
        "mean_ms": round(float(ms.mean()), 4),
        "n": int(ms.size),
    }


def _parity(a, sa, b, sb) -> dict:
    """Agreement of two systems' top-k ids / scores on the same texts."""
    same5 = np.mean([set(x[:5]) == set(y[:5]) for x, y in zip(a, b, strict=True)])
    eq = a == b
    return {
        "top5_same_set": round(float(same5), 5),
        "top10_identical": round(float(eq.all(axis=1).mean()), 5),
        "max_abs_score_diff_same_label": float(np.abs(sa - sb)[eq].max()) if eq.any() else None,
    }


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---- systems (each returns load + one/batch callables) ----------------------------------------
def _sys_predictor(args: dict, backend: str):
    from engine.predictor import Predictor

    p = Predictor.load(args["predictor"], threads=1, backend=backend)
    k = args["k"]
    if backend == "numpy":

        def one(t):
            return p.predict_one(t, k)

    else:  # predict_one always runs the compiled kernels: onnx takes the batch path

        def one(t):
            return p.predict([t], k)

    def batch(ts):  # a batch of one takes the single-text path, as a consumer would
        return p.predict(ts, k) if len(ts) != 1 else tuple(a[None] for a in p.predict_one(ts[0], k))

    return one, batch, _dir_bytes(args["predictor"])


def _sys_torch(args: dict):
    import torch

    torch.set_num_threads(1)
    from engine.astec import Astec

    m = Astec.load(args["model"])
    m.config.training.threads = 1
    match_search(m, Path(args["predictor"]))
    k = args["k"]
    return (lambda t: m.predict([t], k)), (lambda ts: m.predict(ts, k)), _dir_bytes(args["model"])


def match_search(model, predictor_dir: Path) -> None:
    """Give the torch model the predictor's search sizes (k and ef per index), gamma = 1 where
    the export left the sparse ranker out and no label-name match where it left that out, so the
    two are compared on the same work and parity measures the export, not the profile."""
    cfg = json.loads((predictor_dir / "predictor.json").read_text())
    if not cfg.get("label_text_weight", 0.0):
        model.label_text = None  # exported with --no-label-text (or trained without)
    for lr, lc in zip(model.learners, cfg["learners"], strict=True):
        if not lc.get("sparse_ranker"):
            lr.gamma = 1.0
        sc = lc["shortlist"]
        lr.search = (int(sc["knn"]), int(sc["kmu"]))
        lr.index.points.ef_search = int(sc["points_index"].get("ef", 100))
        lr.index.centres.ef_search = int(sc["centres_index"].get("ef", 100))


def _peer_vectorizer(args: dict):
    from engine.text import TfidfVectorizer

    return TfidfVectorizer.load(Path(args["predictor"]) / "vectorizer" / "tfidf.json")


def _sys_omikuji(args: dict):
    import omikuji

    vec = _peer_vectorizer(args)
    model = omikuji.Model.load(args["peer_dir"] + "/omikuji")
    k = args["k"]

    def one(t):
        i, v = vec.transform_one(t)
        return model.predict(list(zip(i.tolist(), v.tolist(), strict=True)), top_k=k)

    def batch(ts):
        return [one(t) for t in ts]  # omikuji's Python API predicts one point per call

    return one, batch, _dir_bytes(args["peer_dir"] + "/omikuji")


def _sys_napkinxc(args: dict):
    import scipy.sparse as sp
    from napkinxc.models import PLT

    vec = _peer_vectorizer(args)
    model = PLT(args["peer_dir"] + "/napkinxc")
    model.load()
    k = args["k"]
    V = vec.num_features

    def one(t):
        i, v = vec.transform_one(t)
        X = sp.csr_matrix((v, i, np.array([0, i.size])), shape=(1, V))
        return model.predict_proba(X, top_k=k)

    def batch(ts):
        return model.predict_proba(vec.transform(ts), top_k=k)

    return one, batch, _dir_bytes(args["peer_dir"] + "/napkinxc")


def _sys_pecos(args: dict):
    import scipy.sparse as sp

    from bench.pecos_worker import load, topk_pairs

    vec = _peer_vectorizer(args)
    model = load(args["peer_dir"] + "/pecos")
    k = args["k"]
    V = vec.num_features

    def one(t):
        i, v = vec.transform_one(t)
        X = sp.csr_matrix((v.astype(np.float32), i, np.array([0, i.size])), shape=(1, V))
        return topk_pairs(model.predict(X, only_topk=k, threads=1), k)[0]

    def batch(ts):
        X = vec.transform(ts).astype(np.float32)
        return topk_pairs(model.predict(X, only_topk=k, threads=1), k)

    return one, batch, _dir_bytes(args["peer_dir"] + "/pecos")


def _ids_of(system: str, out, n: int, k: int) -> np.ndarray:
    """Top-k label ids [n, k] (-1 pads) from any system's batch output."""
    if system in ("predictor", "predictor-onnx", "torch"):
        return np.asarray(out[0])
    ids = np.full((n, k), -1, np.int64)
    for r, row in enumerate(out):
        lab = [int(p[0]) for p in row][:k]
        ids[r, : len(lab)] = lab
    return ids


def _import_libraries(system: str) -> None:
    import engine.text  # every system tokenises with it

    if system.startswith("predictor"):
        import engine.predictor

        if system == "predictor-onnx":
            import onnxruntime  # noqa: F401
    elif system == "torch":
        import engine.astec.model  # noqa: F401  (torch with it)
    elif system == "omikuji":
        import omikuji  # noqa: F401
    elif system == "napkinxc":
        import napkinxc.models  # noqa: F401
    elif system == "pecos":
        import pecos.xmc.xlinear.model  # type: ignore[import-not-found]  # noqa: F401


def serve(args: dict) -> None:
    """Worker loop: load one system, then answer timing commands (JSON lines on stdin/stdout).

    The parent keeps every system's worker alive and alternates short rounds between them, so
    the load of a shared machine falls on all systems alike and the ratios stay fair.
    """
    from engine.formats import read_text_tsv

    # replies go to the original stdout; anything native libraries print goes to stderr
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    system = args["system"]
    texts, _ = read_text_tsv(args["input"])
    texts = texts[: args["n"]]
    _import_libraries(system)  # library code is not the model's memory: measure after it
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    if system in ("predictor", "predictor-onnx"):
        one, batch, files = _sys_predictor(args, "numpy" if system == "predictor" else "onnx")
    elif system == "torch":
        one, batch, files = _sys_torch(args)
    elif system == "omikuji":
        one, batch, files = _sys_omikuji(args)
    elif system == "napkinxc":
        one, batch, files = _sys_napkinxc(args)
    elif system == "pecos":
        one, batch, files = _sys_pecos(args)
    else:
        raise ValueError(f"unknown system {system!r}")
    load_s = time.perf_counter() - t0
    rss_loaded = _rss_mb()
    for t in texts[: args["warmup"]]:
        one(t)
    batch(texts[:256])
    reply(
        {
            "system": system,
            "load_s": round(load_s, 3),
            "files_mb": round(files / 2**20, 2),
            "rss0": rss0,
            "rss_loaded": rss_loaded,
            "files": files,
        }
    )
    clock, cpu = time.perf_counter, time.process_time  # wall, and CPU time of all its threads
    for line in sys.stdin:
        cmd = json.loads(line)
        part = texts[cmd.get("start", 0) : cmd.get("end", len(texts))]
        if cmd["cmd"] == "latency":
            ts, cs = [], []
            for t in part:
                c0 = cpu()
                a = clock()
                one(t)
                ts.append((clock() - a) * 1e3)
                cs.append((cpu() - c0) * 1e3)
            reply({"ms": ts, "cpu_ms": cs})
        elif cmd["cmd"] == "throughput":
            b = cmd["batch"]
            c0 = cpu()
            a = clock()
            for i in range(0, len(part), b):
                batch(part[i : i + b])
            reply({"seconds": clock() - a, "cpu_seconds": cpu() - c0, "texts": len(part)})
        elif cmd["cmd"] == "finish":
            out = batch(texts)
            np.save(
                args["ids_out"], _ids_of(system, out, len(texts), args["k"]), allow_pickle=False
            )
            if system in ("predictor", "predictor-onnx", "torch"):
                np.save(args["scores_out"], np.asarray(out[1], np.float32), allow_pickle=False)
            if system == "predictor":  # the single-text path too: its parity is reported apart
                ones = [one(t) for t in texts]
                np.save(args["one_ids_out"], np.stack([o[0] for o in ones]), allow_pickle=False)
                np.save(
                    args["one_scores_out"],
                    np.stack([o[1] for o in ones]).astype(np.float32),
                    allow_pickle=False,
                )
            reply({"rss": _rss_mb()})
            return


class _Worker:
    """A system's serving subprocess (one thread, its own memory), in `python`'s environment."""

    def __init__(self, args: dict, env: dict, log: Path, python: str = sys.executable):
        self.system = args["system"]
        self.log = log
        with open(log, "w") as err:  # a file, not a pipe: a chatty worker never blocks
            self.proc = subprocess.Popen(
                [python, "-m", "bench.engine_predict", json.dumps(args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        if self.proc.stdin is None or self.proc.stdout is None:  # both are PIPE above
            raise RuntimeError(f"{self.system} worker has no pipes")
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.stdout.readline()
        if not line:
            err = self.log.read_text(errors="replace").strip().splitlines()
            raise RuntimeError(f"{self.system} worker failed: {err[-1:] or 'no output'}")
        return json.loads(line)

    def ask(self, cmd: dict) -> dict:
        self.stdin.write(json.dumps(cmd) + "\n")
        self.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# ---- peers' training (parent process, not timed) ----------------------------------------------
@contextlib.contextmanager
def _stdout_to_stderr():
    """Native libraries (omikuji, napkinXC) print to fd 1; keep stdout for the JSON report."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def train_peers(
    predictor: str, train: str, peer_dir: Path, systems: list[str], threads: int
) -> dict:
    """Train omikuji (Parabel-style defaults), napkinXC PLT and PECOS XR-Linear (its CLI
    defaults, in its own environment) on the predictor's TF-IDF features."""
    from engine.formats import read_text_tsv
    from engine.text import TfidfVectorizer

    vec = TfidfVectorizer.load(Path(predictor) / "vectorizer" / "tfidf.json")
    cfg = json.loads((Path(predictor) / "predictor.json").read_text())
    L = int(cfg["num_labels"])
    texts, Y = read_text_tsv(train, num_labels=L)
    X = vec.transform(texts, progress=True)
    info = {}
    if "omikuji" in systems and not (peer_dir / "omikuji").exists():
        import omikuji

        t0 = time.time()
        from engine.formats import write_xc_sparse

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "train.txt")
            write_xc_sparse(path, X, Y)
            model = omikuji.Model.train_on_data(
                path, omikuji.Model.default_hyper_param(), n_threads=threads
            )
        shutil.rmtree(peer_dir / "omikuji.tmp", ignore_errors=True)
        model.save(str(peer_dir / "omikuji.tmp"))
        os.replace(peer_dir / "omikuji.tmp", peer_dir / "omikuji")  # only complete peers are reused
        info["omikuji_train_s"] = round(time.time() - t0, 1)
    if "napkinxc" in systems and not (peer_dir / "napkinxc").exists():
        from napkinxc.models import PLT

        t0 = time.time()
        shutil.rmtree(peer_dir / "napkinxc.tmp", ignore_errors=True)
        model = PLT(str(peer_dir / "napkinxc.tmp"), threads=threads, seed=0)
        ylists = [Y.indices[Y.indptr[r] : Y.indptr[r + 1]].tolist() for r in range(Y.shape[0])]
        model.fit(X, ylists)
        os.replace(peer_dir / "napkinxc.tmp", peer_dir / "napkinxc")
        info["napkinxc_train_s"] = round(time.time() - t0, 1)
    if "pecos" in systems and not (peer_dir / "pecos").exists():
        from bench import pecos_peer

        shutil.rmtree(peer_dir / "pecos.tmp", ignore_errors=True)
        out = pecos_peer.train_model(X, Y, peer_dir / "pecos.tmp", threads)
        os.replace(peer_dir / "pecos.tmp", peer_dir / "pecos")
        info["pecos_train_s"] = round(out["train_s"], 1)
    return info


def _p_at(Y, ids: np.ndarray, ks=(1, 5)) -> dict:
    out = {}
    for k in ks:
        top = ids[:, :k]
        hit = 0
        rows = np.repeat(np.arange(ids.shape[0]), k)
        flat = top.ravel()
        ok = flat >= 0
        hit = np.asarray(Y[rows[ok], flat[ok]]).sum()
        out[f"P@{k}"] = round(100.0 * float(hit) / (ids.shape[0] * k), 2)
    return out


def run_bench(
    predictor: str,
    input_path: str,
    model: str | None,
    train: str | None,
    systems: list[str],
    n: int,
    n_latency: int,
    k: int,
    peer_dir: str | None,
    threads_train: int = 2,
    rounds: int = 10,
) -> dict:
    """Run every system in its own subprocess and gather figures + ratios to the predictor."""
    with tempfile.TemporaryDirectory(prefix="astec-bench-predict-") as tmp:
        return _run_bench(
            Path(tmp),
            predictor,
            input_path,
            model,
            train,
            systems,
            n,
            n_latency,
            k,
            peer_dir,
            threads_train,
            rounds,
        )


def _run_bench(
    work: Path,
    predictor: str,
    input_path: str,
    model: str | None,
    train: str | None,
    systems: list[str],
    n: int,
    n_latency: int,
    k: int,
    peer_dir: str | None,
    threads_train: int = 2,
    rounds: int = 10,
) -> dict:
    """Run every system in its own subprocess and gather figures + ratios to the predictor."""
    from engine.formats import read_text_tsv
    from engine.manifest import verify_manifest

    man = verify_manifest(predictor)
    if model is None:
        src = man.data.get("source_model", {}).get("path")
        model = src if src and Path(src).is_dir() else None
    pdir = Path(peer_dir) if peer_dir else work / "peers"
    pdir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "predictor": str(predictor),
        "version": man.data.get("version"),
        "input": str(input_path),
        "texts": n,
        "latency_texts": n_latency,
        "k": k,
        "threads": 1,
        "cpu_count": os.cpu_count(),
        "systems": {},
        "skipped": {},
    }
    try:
        import psutil

        report["load_average_1m"] = round(psutil.getloadavg()[0], 2)
    except Exception:  # noqa: BLE001 - the load average is informative only
        pass
    pecos_python = sys.executable
    if "pecos" in systems:  # its own environment, made once (with a line saying so)
        from bench import pecos_peer

        try:
            pecos_python = str(pecos_peer.env_python(echo=lambda m: print(m, file=sys.stderr)))
        except pecos_peer.PecosEnvError as e:
            report["skipped"]["pecos"] = str(e)
            systems = [s for s in systems if s != "pecos"]
    peers = [s for s in systems if s in PEERS]
    if peers:
        if train is None:
            for s in peers:
                report["skipped"][s] = "needs --train TRAIN.tsv to train the peer"
            systems = [s for s in systems if s not in peers]
        else:
            with _stdout_to_stderr():
                report["peer_training"] = train_peers(predictor, train, pdir, peers, threads_train)
    if "torch" in systems and model is None:
        report["skipped"]["torch"] = "no --model and the manifest's source model is not on disk"
        systems = [s for s in systems if s != "torch"]
    env = {**os.environ, **_ONE_THREAD}
    workers: dict[str, _Worker] = {}
    try:
        for s in systems:  # loaded one after another: load times are not contended
            args = {
                "system": s,
                "predictor": str(predictor),
                "model": model,
                "input": input_path,
                "n": n,
                "warmup": min(200, n_latency),
                "k": k,
                "peer_dir": str(pdir),
                "ids_out": str(work / f"{s}.ids.npy"),
                "scores_out": str(work / f"{s}.scores.npy"),
                "one_ids_out": str(work / f"{s}.one_ids.npy"),
                "one_scores_out": str(work / f"{s}.one_scores.npy"),
            }
            try:
                if s == "pecos":
                    workers[s] = _Worker(
                        args, pecos_peer.worker_env() | _ONE_THREAD, work / f"{s}.log", pecos_python
                    )
                else:
                    workers[s] = _Worker(args, env, work / f"{s}.log")
            except RuntimeError as e:
                report["skipped"][s] = str(e)
        lat: dict[str, list[float]] = {s: [] for s in workers}
        lat_cpu: dict[str, list[float]] = {s: [] for s in workers}
        step = max(1, n_latency // rounds)
        for a in range(0, n_latency, step):  # interleaved rounds
            for s, w in workers.items():
                r = w.ask({"cmd": "latency", "start": a, "end": min(a + step, n_latency)})
                lat[s].extend(r["ms"])
                lat_cpu[s].extend(r["cpu_ms"])
        thr: dict[str, dict[str, float]] = {s: {} for s in workers}
        thr_cpu: dict[str, dict[str, float]] = {s: {} for s in workers}
        for b in BATCHES:
            tot = {s: [0.0, 0.0, 0] for s in workers}
            chunk = max(b, (n // rounds) // b * b)
            for a in range(0, n, chunk):
                for s, w in workers.items():
                    r = w.ask(
                        {"cmd": "throughput", "batch": b, "start": a, "end": min(a + chunk, n)}
                    )
                    tot[s][0] += r["seconds"]
                    tot[s][1] += r["cpu_seconds"]
                    tot[s][2] += r["texts"]
            for s in workers:
                thr[s][str(b)] = round(tot[s][2] / max(tot[s][0], 1e-9), 1)
                thr_cpu[s][str(b)] = round(tot[s][2] / max(tot[s][1], 1e-9), 1)
        for s, w in workers.items():
            rss = w.ask({"cmd": "finish"})["rss"]
            r = w.ready
            report["systems"][s] = {
                "system": s,
                "load_s": r["load_s"],
                "files_mb": r["files_mb"],
                "latency_one_text": _summary(np.asarray(lat[s])),
                "latency_one_text_cpu": _summary(np.asarray(lat_cpu[s])),
                "throughput_texts_per_s": thr[s],
                "throughput_texts_per_cpu_s": thr_cpu[s],
                "rss_mb": {
                    "libraries": round(r["rss0"], 1),
                    "after_load": round(r["rss_loaded"], 1),
                    "after_run": round(rss, 1),
                    "model": round(rss - r["rss0"], 1),
                },
                "memory_over_files": round((rss - r["rss0"]) / max(r["files"] / 2**20, 1e-9), 3),
            }
    finally:
        for w in workers.values():
            w.close()
    # accuracy and parity on the same texts
    _, Y = read_text_tsv(input_path, num_labels=int(man.data["shapes"]["num_labels"]))
    Y = Y[:n].tocsr()
    for s in report["systems"]:
        ids = np.load(work / f"{s}.ids.npy")
        report["systems"][s]["accuracy"] = _p_at(Y, ids)
    if "predictor" in report["systems"] and "torch" in report["systems"]:
        b, sb = np.load(work / "torch.ids.npy"), np.load(work / "torch.scores.npy")
        report["parity_vs_torch"] = _parity(
            np.load(work / "predictor.ids.npy"), np.load(work / "predictor.scores.npy"), b, sb
        )
        report["parity_vs_torch"]["single_text_path"] = _parity(
            np.load(work / "predictor.one_ids.npy"),
            np.load(work / "predictor.one_scores.npy"),
            b,
            sb,
        )
    base = report["systems"].get("predictor")
    if base:
        for s, r in report["systems"].items():
            if s == "predictor":
                continue
            r["ratio_to_predictor"] = {
                "p50_latency": round(
                    r["latency_one_text"]["p50_ms"] / base["latency_one_text"]["p50_ms"], 2
                ),
                "p50_latency_cpu": round(
                    r["latency_one_text_cpu"]["p50_ms"]
                    / max(base["latency_one_text_cpu"]["p50_ms"], 1e-9),
                    2,
                ),
                "p99_latency": round(
                    r["latency_one_text"]["p99_ms"] / base["latency_one_text"]["p99_ms"], 2
                ),
                **{
                    f"throughput_b{b}": round(
                        r["throughput_texts_per_s"][str(b)]
                        / base["throughput_texts_per_s"][str(b)],
                        3,
                    )
                    for b in BATCHES
                },
                "rss_model": round(r["rss_mb"]["model"] / max(base["rss_mb"]["model"], 1e-9), 2),
            }
        one, cl = base["latency_one_text"], base["latency_one_text_cpu"]
        report["targets"] = {
            "p50_le_0.25ms": one["p50_ms"] <= 0.25,
            "p99_le_1ms": one["p99_ms"] <= 1.0,
            "ge_5000_texts_per_s_b256": base["throughput_texts_per_s"]["256"] >= 5000,
            "memory_le_2x_files": base["memory_over_files"] <= 2.0,
            "cpu_time_p50_le_0.25ms": cl["p50_ms"] <= 0.25,
            "cpu_time_p99_le_1ms": cl["p99_ms"] <= 1.0,
            "ge_5000_texts_per_cpu_s_b256": base["throughput_texts_per_cpu_s"]["256"] >= 5000,
        }
        leaders = peer_leaders(report["systems"])
        if leaders:
            report["peers"] = leaders
            fast = leaders["fastest_p50"]
            report["targets"]["p50_le_fastest_peer"] = fast["predictor_over_peer_p50"] <= 1.0
            report["targets"]["p99_le_fastest_peer"] = fast["predictor_over_peer_p99"] <= 1.0
    return report


def peer_leaders(systems: dict) -> dict:
    """The fastest peer at one text (p50) and the most accurate peer (P@1, then P@5) of a
    report's systems, with the predictor's p50 / p99 over the fastest one's; {} without a peer
    or the predictor."""
    peers = {s: r for s, r in systems.items() if s in PEERS}
    base = systems.get("predictor")
    if not peers or base is None:
        return {}
    fs = min(peers, key=lambda s: peers[s]["latency_one_text"]["p50_ms"])
    acc = max(peers, key=lambda s: (peers[s]["accuracy"]["P@1"], peers[s]["accuracy"]["P@5"]))
    one, peer = base["latency_one_text"], peers[fs]["latency_one_text"]
    return {
        "fastest_p50": {
            "system": fs,
            "p50_ms": peer["p50_ms"],
            "p99_ms": peer["p99_ms"],
            "predictor_over_peer_p50": round(one["p50_ms"] / max(peer["p50_ms"], 1e-9), 3),
            "predictor_over_peer_p99": round(one["p99_ms"] / max(peer["p99_ms"], 1e-9), 3),
        },
        "most_accurate": {
            "system": acc,
            **peers[acc]["accuracy"],
            "predictor": base["accuracy"],
        },
    }


@click.command("predict")
@click.option(
    "--predictor",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Predictor directory from `astec export`.",
)
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Texts to predict (text TSV; the labels give P@k).",
)
@click.option(
    "--model",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Torch model dir for the side-by-side (default: the manifest's source model).",
)
@click.option(
    "--train",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Training TSV for the omikuji / napkinXC peers (skipped without it).",
)
@click.option(
    "--systems",
    default=",".join(SYSTEMS),
    show_default=True,
    help="Comma-separated subset of: " + ", ".join(SYSTEMS),
)
@click.option("--n", type=int, default=4096, show_default=True, help="Texts for throughput.")
@click.option(
    "--n-latency",
    type=int,
    default=2000,
    show_default=True,
    help="Texts timed one by one for p50/p99.",
)
@renamed_option(
    "--top-k", "--k", "k", type=int, default=10, show_default=True, help="Labels per text."
)
@click.option(
    "--peer-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where trained peers are kept (reused when present).",
)
@renamed_option(
    "--json-out",
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the JSON report here.",
)
def bench_predict(
    predictor, input_path, model, train, systems, n, n_latency, k, peer_dir, json_out
):
    """Latency p50/p99 (one text, one thread, tokenisation included), throughput at batch 1/32/256,
    load time and resident memory of the predictor, the torch model and the peers, side by side.
    Prints JSON."""
    chosen = [s.strip() for s in systems.split(",") if s.strip()]
    bad = sorted(set(chosen) - set(SYSTEMS))
    if bad:
        raise click.BadParameter(f"unknown system(s) {bad}; choose from {list(SYSTEMS)}")
    report = run_bench(
        predictor, input_path, model, train, chosen, n, min(n_latency, n), k, peer_dir
    )
    text = json.dumps(report, indent=1)
    if json_out:
        Path(json_out).write_text(text + "\n")
    click.echo(text)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
