"""`astec bench peers`: Astec and the peers that install as wheels, same data, one table.

PECOS XR-Linear runs in its own environment (bench/pecos_peer.py, made on first use or by
`make peers-pecos`): the worker hands it the same TF-IDF features as npz files, and its peak RSS
is the larger of the worker's and PECOS' process'.

Every method runs in its own subprocess (a fresh interpreter), so its peak RSS is measured alone
(os.wait4's ru_maxrss) and one method's memory never inflates another's. Peers get the same
TF-IDF features from engine.text (words + word pairs by default, --peer-ngrams; Astec uses its
config's n-grams). Metrics: engine.ranking_metrics with propensities from the training labels
(engine.ranking_metrics' A, B unless --propensity A,B). A worker gets its job (PeerJob) as JSON.
--rounds N runs the methods N times alternated and reports medians (`summarize_rounds`).
Training time is wall seconds and CPU seconds (every thread of the worker): a shared machine's
stolen time slows the first, not the second.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click

from bench.subprocesses import run_worker
from engine.astec.config import DEVICES, TrainingParams
from engine.cli_options import config_option, default_of
from engine.ranking_metrics import PROPENSITY_A, PROPENSITY_B

METHODS = ("astec", "astec-3", "parabel", "bonsai", "napkinxc-plt", "pecos")


def _load(train, test, labels, cfg):
    from engine.formats import load_dataset
    from engine.text import TfidfVectorizer

    tr = load_dataset(train, labels)
    te = load_dataset(test, labels)
    L = max(tr.num_labels, te.num_labels)
    import scipy.sparse as sp

    def pad(Y):
        Y = sp.csr_matrix(Y)
        return sp.csr_matrix((Y.data, Y.indices, Y.indptr), shape=(Y.shape[0], L))

    Ytr, Yte = pad(tr.Y), pad(te.Y)
    if tr.texts is not None:
        vec = TfidfVectorizer(
            min_df=cfg.features.min_df,
            word_ngrams=cfg.features.word_ngrams,
            char_ngrams=tuple(cfg.features.char_ngrams) if cfg.features.char_ngrams else None,
        )
        Xtr = vec.fit_transform(tr.texts)
        Xte = vec.transform(te.texts)
        return tr.texts, te.texts, Xtr, Xte, Ytr, Yte, tr.label_names
    Xte = sp.csr_matrix(te.X)
    Xtr = sp.csr_matrix(tr.X)
    F = max(Xtr.shape[1], Xte.shape[1])
    Xtr = sp.csr_matrix((Xtr.data, Xtr.indices, Xtr.indptr), shape=(Xtr.shape[0], F))
    Xte = sp.csr_matrix((Xte.data, Xte.indices, Xte.indptr), shape=(Xte.shape[0], F))
    return Xtr, Xte, Xtr, Xte, Ytr, Yte, tr.label_names


def _module_seconds(learner_log: dict) -> dict:
    """{module: seconds} of one learner, the sparse ranker's refit on all points apart."""
    out = {}
    for m, v in learner_log["modules"].items():
        out[m] = v.get("seconds")
        if v.get("refit_seconds") is not None:
            out[f"{m}_refit"] = v["refit_seconds"]
    return out


def train_ratios(rows: list[dict], key: str = "train_s") -> dict:
    """Each method's training time (`key`: wall or CPU seconds) over the fastest peer's (peers:
    the non-Astec methods; with none of them in the run, the fastest method's). Failed rows and
    rows without `key` are left out."""
    ok = [r for r in rows if "error" not in r and r.get(key) is not None]
    peers = [r[key] for r in ok if not r["method"].startswith("astec")] or [r[key] for r in ok]
    if not peers:
        return {}
    base = max(min(peers), 1e-9)
    return {r["method"]: round(r[key] / base, 1) for r in ok}


_METRICS = ("P@1", "P@3", "P@5", "nDCG@5", "PSP@1", "PSP@3", "PSP@5")


def summarize_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per method over alternated rounds (each a list of rows as one round prints them,
    with "train_ratio" set): metrics, seconds and the ratio are medians over the method's
    rounds (the ratio each round's own: the machine's speed drifts less within a round than
    across rounds), peak RSS the largest, each round's seconds and ratio kept beside them. A
    method failing in every round keeps its first error; "failed_rounds" counts the others."""
    import numpy as np

    def med(xs):
        return float(np.median(xs))

    out = []
    for m in dict.fromkeys(r["method"] for rs in rounds for r in rs):
        mine = [r for rs in rounds for r in rs if r["method"] == m]
        ok = [r for r in mine if "error" not in r]
        if not ok:
            out.append({"method": m, "error": mine[0]["error"], "failed_rounds": len(mine)})
            continue
        row = {"method": m, **{k: round(med([r[k] for r in ok]), 2) for k in _METRICS}}
        row["train_s"] = round(med([r["train_s"] for r in ok]), 1)
        cpu = [r["train_cpu_s"] for r in ok if r.get("train_cpu_s") is not None]
        if cpu:
            row["train_cpu_s"] = round(med(cpu), 1)
        row["predict_s"] = round(med([r["predict_s"] for r in ok]), 1)
        row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in ok)
        ratios = [r["train_ratio"] for r in ok if "train_ratio" in r]
        if ratios:
            row["train_ratio"] = round(med(ratios), 1)
        cpu_ratios = [r["cpu_ratio"] for r in ok if "cpu_ratio" in r]
        if cpu_ratios:
            row["cpu_ratio"] = round(med(cpu_ratios), 1)
        row["rounds"] = len(ok)
        row["train_s_rounds"] = [r["train_s"] for r in ok]
        row["train_ratio_rounds"] = ratios
        if cpu:
            row["train_cpu_s_rounds"] = cpu
            row["cpu_ratio_rounds"] = cpu_ratios
        if len(ok) < len(mine):
            row["failed_rounds"] = len(mine) - len(ok)
        logs = [r["modules_s"] for r in ok if r.get("modules_s")]
        if logs:  # each learner's modules as the first log names them, over the logs that have them
            row["modules_s"] = {}
            for j in logs[0]:
                per: dict = {}
                for k in logs[0][j]:
                    xs = [lg[j][k] for lg in logs if lg.get(j, {}).get(k) is not None]
                    if xs:
                        per[k] = round(med(xs), 3)
                row["modules_s"][j] = per
        out.append(row)
    return out


@dataclass
class PeerJob:
    """One method's run in a worker subprocess, passed by name as JSON (the worker's argv[1])."""

    method: str
    train: str
    test: str
    labels: str | None
    config: str | None  # AstecConfig JSON file
    out_json: str  # where the worker writes timings (and out_json + ".ids.npy" its top-k ids)
    k: int
    threads: int  # the method's threads (Astec: training.threads; peers: their n_threads)
    peer_ngrams: int  # word n-grams of the peers' features
    device: str | None = None  # Astec's training.device (None: the config's)
    save_dir: str | None = None  # keep the trained Astec model as save_dir/method


def _worker(job: PeerJob) -> None:
    """Train + predict one method in this process; write timings and top-k ids to job.out_json."""
    import numpy as np
    import scipy.sparse as sp

    from engine.astec import Astec, AstecConfig

    method, k, threads = job.method, job.k, job.threads
    cfg = AstecConfig.load(job.config) if job.config else AstecConfig()
    cfg.training.threads = threads
    if job.device is not None:
        cfg.training.device = job.device
    if not method.startswith("astec"):
        cfg.features.word_ngrams = job.peer_ngrams
    tr_in, te_in, Xtr, Xte, Ytr, _, names = _load(job.train, job.test, job.labels, cfg)
    t0, c0 = time.time(), time.process_time()  # CPU seconds of every thread of this process
    pred_s = None
    if method.startswith("astec"):
        learners = 3 if method == "astec-3" else 1
        model = Astec.train(tr_in, Ytr, cfg, label_names=names, learners=learners, progress=False)
        train_s, train_cpu_s = time.time() - t0, time.process_time() - c0
        if job.save_dir:  # --save-models: keep it for export / bench (not timed)
            model.save(Path(job.save_dir) / method)
        t1 = time.time()
        ids, _ = model.predict(te_in, k=k)
        extra = {
            "train_log": {
                j: _module_seconds(lg) for j, lg in enumerate(model.train_log["learners"])
            }
        }
    elif method in ("parabel", "bonsai"):
        import omikuji

        from engine.formats import write_xc_sparse

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "train.txt")
            write_xc_sparse(path, Xtr, Ytr)
            hp = (
                omikuji.Model.default_hyper_param()
            )  # defaults = Parabel (k=2, balanced, depth 20, 3 trees)
            if method == "bonsai":
                hp.cluster_k, hp.cluster_balanced, hp.max_depth = 100, False, 3
            t0, c0 = time.time(), time.process_time()  # writing the file is not training
            model = omikuji.Model.train_on_data(path, hp, n_threads=threads)
        train_s, train_cpu_s = time.time() - t0, time.process_time() - c0
        t1 = time.time()
        Xte = sp.csr_matrix(Xte)
        ids = np.full((Xte.shape[0], k), -1, np.int64)
        for i in range(Xte.shape[0]):
            a, b = Xte.indptr[i], Xte.indptr[i + 1]
            pred = model.predict(
                list(zip(Xte.indices[a:b].tolist(), Xte.data[a:b].tolist(), strict=True)), top_k=k
            )
            ids[i, : len(pred)] = [p[0] for p in pred]
        extra = {}
    elif method == "napkinxc-plt":
        from napkinxc.models import PLT

        with tempfile.TemporaryDirectory() as tmp:
            Ylist = [row.indices.tolist() for row in sp.csr_matrix(Ytr)]
            model = PLT(os.path.join(tmp, "plt"), threads=threads, seed=0)
            model.fit(sp.csr_matrix(Xtr, dtype=np.float32), Ylist)
            train_s, train_cpu_s = time.time() - t0, time.process_time() - c0
            t1 = time.time()
            preds = model.predict(sp.csr_matrix(Xte, dtype=np.float32), top_k=k)
        ids = np.full((Xte.shape[0], k), -1, np.int64)
        for i, p in enumerate(preds):
            ids[i, : len(p)] = p[:k]
        extra = {}
    elif method == "pecos":
        from bench import pecos_peer

        out, ids, _ = pecos_peer.fit_predict(Xtr, Ytr, Xte, k, threads)
        train_s, train_cpu_s, pred_s = out["train_s"], out["train_cpu_s"], out["predict_s"]
        extra = {}
    else:
        raise ValueError(method)
    if pred_s is None:
        pred_s = time.time() - t1
    np.save(job.out_json + ".ids.npy", ids)
    Path(job.out_json).write_text(
        json.dumps({"train_s": train_s, "train_cpu_s": train_cpu_s, "predict_s": pred_s, **extra})
    )


def _run(job: PeerJob) -> dict:
    """Run `job` in a fresh interpreter; its timings, top-k ids and peak RSS (os.wait4)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = dataclasses.replace(job, out_json=os.path.join(tmp, "r.json"))
        spec = Path(tmp, "job.json")
        spec.write_text(json.dumps(dataclasses.asdict(job)))
        cmd = [sys.executable, "-m", "bench.engine_peers", str(spec)]
        # omikuji prints a progress line per example: to a file, whose tail explains a failure
        with open(os.path.join(tmp, "log.txt"), "wb") as logf:
            status, ru = run_worker(
                cmd, cwd=str(Path(__file__).resolve().parents[1]), stdout=logf, stderr=logf
            )
        if status != 0 or not os.path.exists(job.out_json):
            tail = Path(tmp, "log.txt").read_bytes()[-2000:].decode("utf-8", "replace")
            return {
                "method": job.method,
                "error": f"exit status {status}: {tail.strip().splitlines()[-1:]}",
            }
        import numpy as np

        r = json.loads(Path(job.out_json).read_text())
        r["ids"] = np.load(job.out_json + ".ids.npy")
        r["peak_rss_mb"] = ru.ru_maxrss / 1024.0
        r["method"] = job.method
        return r


# absolute paths: each method runs in a worker started from the repository's root
_IN_FILE = click.Path(exists=True, dir_okay=False, resolve_path=True)


@click.command("peers")
@click.option("--train", "train_path", required=True, type=_IN_FILE)
@click.option("--test", "test_path", required=True, type=_IN_FILE)
@click.option("--labels", "labels_path", type=_IN_FILE, default=None)
@click.option(
    "--config",
    "config_path",
    type=_IN_FILE,
    default=None,
    help="AstecConfig JSON for Astec (its n-gram settings also shape the peers' features).",
)
@click.option(
    "--methods",
    default="astec,parabel,bonsai,napkinxc-plt",
    show_default=True,
    help=f"Comma-separated subset of {','.join(METHODS)}.",
)
@click.option(
    "--threads",
    type=click.IntRange(0, 256),
    default=default_of(TrainingParams, "threads"),
    show_default=True,
    help="Threads for the peers (omikuji, napkinXC) and for Astec unless its config sets "
    "training.threads; 0 = every core this process may use.",
)
@config_option(TrainingParams, "device", "--device", type=click.Choice(DEVICES))
@click.option(
    "--peer-ngrams",
    type=click.IntRange(1, 2),
    default=2,
    show_default=True,
    help="Word n-grams of the peers' TF-IDF features (2 = words + word pairs).",
)
@click.option(
    "--propensity",
    default=f"{PROPENSITY_A},{PROPENSITY_B}",
    show_default=True,
    help="A,B of the propensity model.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1, 20),
    default=1,
    show_default=True,
    help="Run the methods this many times, alternated (A B A B ...), and report medians: the "
    "training-time ratio as the median of each round's own ratio. Shared or throttled machines "
    "drift in speed by tens of percent within minutes; one run each is one sample of that.",
)
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write the table as JSON.",
)
@click.option(
    "--save-models",
    type=click.Path(file_okay=False, resolve_path=True),
    default=None,
    help="Save the trained Astec models as DIR/astec, DIR/astec-3 (saving is not timed), "
    "e.g. to export and `astec bench predict` the very model measured here (with --rounds: "
    "the first round's).",
)
def peers(
    train_path,
    test_path,
    labels_path,
    config_path,
    methods,
    threads,
    device,
    peer_ngrams,
    propensity,
    rounds,
    json_out,
    save_models,
):
    """Train Astec and the peers (PECOS XR-Linear in its own environment, made on first use)
    on the same data; print P@k, nDCG@5, PSP@k, training time (wall and CPU seconds, each over
    the fastest peer's), peak RSS, and the fastest and the most accurate peer."""
    from engine.astec import AstecConfig
    from engine.astec.config import resolve_threads
    from engine.formats import load_dataset
    from engine.ranking_metrics import inv_propensity

    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    bad = [m for m in wanted if m not in METHODS]
    if bad:
        raise click.BadParameter(
            f"unknown method(s) {bad}; choose from {METHODS}", param_hint="--methods"
        )
    if "pecos" in wanted:  # made once, before any timing, with a line saying so
        from bench import pecos_peer

        try:
            pecos_peer.env_python(echo=lambda msg: click.echo(msg, err=True))
        except pecos_peer.PecosEnvError as e:
            raise click.ClickException(str(e)) from None
    A, B = (float(x) for x in propensity.split(","))
    tr = load_dataset(train_path, labels_path)
    te = load_dataset(test_path, labels_path)
    L = max(tr.num_labels, te.num_labels)
    import scipy.sparse as sp

    Yte = sp.csr_matrix((te.Y.data, te.Y.indices, te.Y.indptr), shape=(te.Y.shape[0], L))
    ip = inv_propensity(tr.Y, A=A, B=B, num_labels=L)
    cfg = AstecConfig.load(config_path) if config_path else AstecConfig()
    threads = resolve_threads(threads)
    astec_threads = cfg.training.threads if cfg.training.threads > 0 else threads
    per_round: list[list[dict]] = []
    for rnd in range(rounds):
        rows = _run_round(
            wanted,
            rnd,
            rounds,
            PeerJob(
                method="",
                train=str(train_path),
                test=str(test_path),
                labels=labels_path,
                config=config_path,
                out_json="",  # _run chooses it
                k=5,
                threads=threads,
                peer_ngrams=peer_ngrams,
                device=device,
                save_dir=save_models if rnd == 0 else None,
            ),
            astec_threads,
            Yte,
            ip,
        )
        for key, name in (("train_s", "train_ratio"), ("train_cpu_s", "cpu_ratio")):
            ratios = train_ratios(rows, key)
            for r in rows:
                if r["method"] in ratios:
                    r[name] = ratios[r["method"]]
        per_round.append(rows)
    rows = per_round[0] if rounds == 1 else summarize_rounds(per_round)
    _print_table(rows, rounds)
    if json_out:
        Path(json_out).write_text(json.dumps(rows, indent=1))


def _run_round(
    wanted: list[str], rnd: int, rounds: int, base: PeerJob, astec_threads: int, Yte, ip
) -> list[dict]:
    """One run of each wanted method, in order: its metrics, seconds and peak RSS (or error)."""
    from engine.ranking_metrics import evaluate

    rows = []
    for m in wanted:
        tag = f" (round {rnd + 1} of {rounds})" if rounds > 1 else ""
        click.echo(f"running {m}{tag} ...", err=True)
        job = dataclasses.replace(
            base, method=m, threads=astec_threads if m.startswith("astec") else base.threads
        )
        r = _run(job)
        if "error" in r:
            click.echo(f"  {m}: failed ({r['error']})", err=True)
            rows.append({"method": m, "error": r["error"]})
            continue
        met = evaluate(Yte, r["ids"], ip, ks=(1, 3, 5))
        row = {
            "method": m,
            **{key: round(met[key], 2) for key in _METRICS},
            "train_s": round(r["train_s"], 1),
            "train_cpu_s": round(r["train_cpu_s"], 1),
            "predict_s": round(r["predict_s"], 1),
            "peak_rss_mb": round(r["peak_rss_mb"]),
        }
        if "train_log" in r:
            row["modules_s"] = r["train_log"]
        rows.append(row)
        click.echo(f"  {json.dumps(row)}", err=True)
    return rows


def _print_table(rows: list[dict], rounds: int) -> None:
    """The markdown table (with each round's seconds and ratio where there are rounds) and
    Astec's seconds per module."""
    if rounds > 1:
        click.echo(f"medians of {rounds} rounds, the methods alternated in each")
    cols = [
        *_METRICS,
        "train_s",
        "train_ratio",
        "train_cpu_s",
        "cpu_ratio",
        "peak_rss_mb",
    ]
    if rounds > 1:
        cols[cols.index("train_cpu_s") : cols.index("train_cpu_s")] = [
            "train_s_rounds",
            "train_ratio_rounds",
        ]
    head = (
        "| method | "
        + " | ".join(
            c.replace("peak_rss_mb", "peak RSS MB")
            .replace("train_ratio_rounds", "ratio per round")
            .replace("train_s_rounds", "train s per round")
            .replace("train_ratio", "train / fastest peer")
            .replace("train_cpu_s", "train CPU s")
            .replace("cpu_ratio", "CPU / fastest peer")
            .replace("train_s", "train s")
            for c in cols
        )
        + " |"
    )
    click.echo(head)
    click.echo("|" + "---|" * (len(cols) + 1))
    for r in rows:
        if "error" in r:
            click.echo(f"| {r['method']} | failed: {r['error']} |")
        else:
            click.echo(
                f"| {r['method']} | " + " | ".join(_cell(r.get(c, "-")) for c in cols) + " |"
            )
    for line in peer_leaders(rows):
        click.echo(line)
    for r in rows:
        for j, mods in (r.get("modules_s") or {}).items():
            click.echo(
                f"{r['method']} learner {j} seconds per module"
                + (" (medians)" if rounds > 1 else "")
                + ": "
                + ", ".join(
                    f"{k} {v:.1f}" if isinstance(v, int | float) else f"{k} {v}"
                    for k, v in mods.items()
                )
            )


def peer_leaders(rows: list[dict]) -> list[str]:
    """Lines naming the fastest peer to train (wall seconds) and the most accurate peers (P@1,
    PSP@5), with each Astec row's figures against them; none without a peer in the table."""
    ok = [r for r in rows if "error" not in r]
    peers = [r for r in ok if not r["method"].startswith("astec")]
    if not peers:
        return []
    ours = [r for r in ok if r["method"].startswith("astec")]
    fast = min(peers, key=lambda r: r["train_s"])
    lines = [
        f"fastest peer: {fast['method']} ({fast['train_s']} s to train)"
        + "".join(
            f"; {r['method']} {r['train_s']} s = {r['train_s'] / max(fast['train_s'], 1e-9):.1f}x"
            for r in ours
        )
    ]
    for metric in ("P@1", "PSP@5"):
        best = max(peers, key=lambda r: r[metric])
        lines.append(
            f"most accurate peer by {metric}: {best['method']} ({best[metric]})"
            + "".join(
                f"; {r['method']} {r[metric]} ({r[metric] - best[metric]:+.2f})" for r in ours
            )
        )
    return lines


def _cell(v) -> str:
    return " / ".join(str(x) for x in v) if isinstance(v, list) else str(v)


if __name__ == "__main__":
    _worker(PeerJob(**json.loads(Path(sys.argv[1]).read_text())))
