"""`astec stream run`: N worker processes in one consumer group, restarted if they crash.

SIGTERM/SIGINT to the supervisor is forwarded to every worker (each finishes its batch, commits
and leaves the group); a worker that dies abnormally (e.g. kill -9) is restarted with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator
from multiprocessing.context import SpawnProcess

from stream.settings import Settings
from stream.worker import worker_main

log = logging.getLogger(__name__)


@contextlib.contextmanager
def blas_threads(threads: int) -> Iterator[None]:
    """The BLAS thread variables a spawned child inherits, set only while it starts (never left
    in the supervisor's own environment). One BLAS thread per worker unless told otherwise: on a
    busy box OpenBLAS' own threads spin against the other workers (a 8x300 @ 300x300 product went
    from 0.1 ms to 16 ms); the child's numpy reads them when it loads, so they must be there
    before the spawn."""
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    old = {v: os.environ.get(v) for v in names}
    os.environ.update(dict.fromkeys(names, str(threads)))
    try:
        yield
    finally:
        for v, val in old.items():
            if val is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = val


def run_workers(
    settings: Settings,
    model_path: str,
    policy: str,
    policy_model: str | None,
    n_workers: int,
    threads: int = 1,
    restart: bool = True,
) -> int:
    """Supervise n_workers processes until SIGTERM/SIGINT; returns the number of restarts.

    Worker i serves Prometheus metrics on settings.ops.metrics_port + i (0: none)."""
    ctx = mp.get_context("spawn")
    host = socket.gethostname()
    stopping = False
    restarts = 0

    def start(i: int) -> SpawnProcess:
        cid = f"{host}-w{i}-{int(time.time() * 1000) % 10**8}"
        port = settings.ops.metrics_port + i if settings.ops.metrics_port else 0
        # the slot's transactional id outlives a worker's crash, so its restarted successor
        # fences it and aborts the transaction it left open; the supervisor's pid keeps two
        # supervisors of one group on one host apart
        txn_id = f"{settings.consumer.group}-{host}-{os.getpid()}-w{i}"
        # the slot's static group membership: a worker restarted within the session timeout
        # gets the slot's partitions back without moving anything
        instance_id = f"{host}-{os.getpid()}-w{i}"
        p = ctx.Process(
            target=worker_main,
            name=cid,
            daemon=False,
            kwargs={
                "settings": settings,
                "model_path": model_path,
                "policy_name": policy,
                "policy_model": policy_model,
                "consumer_id": cid,
                "metrics_port": port,
                "threads": threads,
                "transactional_id": txn_id,
                "instance_id": instance_id,
            },
        )
        with blas_threads(threads):
            p.start()
        log.info("started worker %s pid %s", cid, p.pid)
        return p

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = {i: start(i) for i in range(n_workers)}
    backoff = dict.fromkeys(procs, 0.5)
    try:
        while not stopping:
            time.sleep(0.2)
            for i, p in list(procs.items()):
                if p.is_alive() or p.exitcode is None:
                    continue
                if p.exitcode == 0 or not restart:
                    log.info("worker %s exited (%s)", p.name, p.exitcode)
                    del procs[i]
                    continue
                log.warning(
                    "worker %s died (exit %s); restarting in %.1fs", p.name, p.exitcode, backoff[i]
                )
                time.sleep(backoff[i])
                backoff[i] = min(backoff[i] * 2, 10.0)
                procs[i] = start(i)
                restarts += 1
            if not procs:
                break
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()  # SIGTERM: graceful stop in the worker
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                log.error("worker %s did not stop in 30s; killing", p.name)
                p.kill()
                p.join()
        for sig, h in old.items():
            signal.signal(sig, h)
    return restarts
