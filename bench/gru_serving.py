"""`astec bench gru`: what the GRU policy costs a consumer per event, on full K windows.

Wall-clock figures (mean, p50, p99) include time the process waited for a shared CPU;
`cpu_us` is the process CPU time per event (what the consumer pays on a busy host).

States are synthetic but shaped like the stream's (float16 z of the policy's D, top-k ids of
the policy's label space, descending scores, visits 40 s apart) and every query id is distinct,
so each event has the maximum K*k candidates: the worst case for the scorer.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import click
import numpy as np

from personalization.policy import BACKENDS, GruPolicy
from personalization.state import UserState


def synthetic_windows(
    n: int, K: int, D: int, L: int, k: int, seed: int = 0
) -> list[tuple[list[UserState], UserState]]:
    """n (history of K-1 states, current state) pairs with distinct query ids per window;
    each earlier state showed its page's first query (what the stream marks)."""
    rng = np.random.default_rng(seed)
    z = rng.random((n, K, D)).astype(np.float16)
    ids = np.stack([rng.choice(L, K * k, replace=L < K * k) for _ in range(n)]).reshape(n, K, k)
    sc = -np.sort(-rng.random((n, K, k)).astype(np.float32), axis=2)
    out = []
    for i in range(n):
        st = [
            UserState(
                f"e{i}-{t}",
                1.7e9 + 40.0 * t,
                1,
                2,
                z[i, t],
                ids[i, t],
                sc[i, t],
                shown=int(ids[i, t, 0]) if t < K - 1 else -1,
            )
            for t in range(K)
        ]
        out.append((st[:-1], st[-1]))
    return out


def run_bench(
    policy_dir,
    events: int = 5000,
    topk: int = 10,
    batches=(1, 64, 256),
    backends=BACKENDS,
    seed: int = 0,
) -> dict:
    """Per-event cost (microseconds) of choose() and choose_batch() for each backend."""
    res: dict[str, Any] = {
        "K": None,
        "topk": topk,
        "events": events,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "results": [],
    }
    for backend in backends:
        pol = GruPolicy.load(policy_dir, backend=backend)
        res["K"] = pol.K
        wins = synthetic_windows(events, pol.K, pol.feature_dim, pol.n_labels, topk, seed)
        hist = [w[0] for w in wins]
        cur = [w[1] for w in wins]
        for _ in range(50):  # warm-up (ONNX Runtime allocations, caches; load() compiled)
            pol.choose(hist[0], cur[0])
        for B in batches:  # every batch size's path run once before timing
            pol.serve_batch(hist[:B], cur[:B])
        for B in batches:
            c0 = time.process_time()
            if B == 1:
                lat = np.empty(events)
                for i in range(events):
                    t = time.perf_counter()
                    pol.choose(hist[i], cur[i])
                    lat[i] = time.perf_counter() - t
                cpu = time.process_time() - c0
                res["results"].append(
                    {
                        "backend": backend,
                        "batch": 1,
                        "mean_us": round(float(lat.mean() * 1e6), 1),
                        "p50_us": round(float(np.percentile(lat, 50) * 1e6), 1),
                        "p99_us": round(float(np.percentile(lat, 99) * 1e6), 1),
                        "cpu_us": round(cpu / events * 1e6, 1),
                    }
                )
            else:
                t = time.perf_counter()
                for a in range(0, events, B):
                    pol.choose_batch(hist[a : a + B], cur[a : a + B])
                dt = time.perf_counter() - t
                cpu = time.process_time() - c0
                res["results"].append(
                    {
                        "backend": backend,
                        "batch": B,
                        "mean_us": round(dt / events * 1e6, 1),
                        "cpu_us": round(cpu / events * 1e6, 1),
                    }
                )
            # the same events served with exploration (serve_batch: the greedy choice plus
            # the epsilon-softmax draw, propensities and the logged candidate arrays)
            rng = np.random.default_rng(seed)
            c0 = time.process_time()
            t = time.perf_counter()
            for a in range(0, events, B):
                pol.serve_batch(hist[a : a + B], cur[a : a + B], rng=rng)
            dt = time.perf_counter() - t
            cpu = time.process_time() - c0
            res["results"].append(
                {
                    "backend": backend,
                    "batch": B,
                    "explore": True,
                    "mean_us": round(dt / events * 1e6, 1),
                    "cpu_us": round(cpu / events * 1e6, 1),
                }
            )
    return res


@click.command("gru")
@click.option(
    "--policy",
    "policy_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    required=True,
    help="GRU policy version dir or registry root.",
)
@click.option("--events", type=click.IntRange(100, 10_000_000), default=5000, show_default=True)
@click.option("--topk", type=click.IntRange(1, 100), default=10, show_default=True)
@click.option(
    "--batch",
    "batches",
    default="1,64,256",
    show_default=True,
    help="Comma-separated choose_batch sizes to time (1 = choose()).",
)
@click.option(
    "--backend",
    type=click.Choice(list(BACKENDS)),
    multiple=True,
    default=BACKENDS,
    show_default=True,
    help="How the policy computes its logits (GruPolicy.load); the default times all three.",
)
@click.option("--seed", type=int, default=0, show_default=True)
def bench_gru(policy_dir, events, topk, batches, backend, seed):
    """Serving cost per event of the GRU policy at its K (full windows, p50/p99 and mean)."""
    res = run_bench(
        policy_dir,
        events=events,
        topk=topk,
        batches=[int(x) for x in batches.split(",") if x.strip()],
        backends=list(backend),
        seed=seed,
    )
    click.echo(json.dumps(res, indent=1))
