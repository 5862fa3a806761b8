"""`astec bench stream`: end-to-end events/s and event -> ad latency of `astec stream run`.

Runs the real thing: Apache Kafka and Redis (fresh loopback ones by default), `astec stream run
--workers W` as a subprocess, a producer of page views and a read-committed reader of
`ad-queries` in this process. For each --delivery mode (exactly-once and at-least-once can run
side by side in one command), two phases, each on its own fresh topics, consumer group and
workers:
  1. saturation: --events page views sent as fast as possible; throughput = events / (last ad
     query received - first view sent);
  2. paced: views at each --rate (default 50% of the saturation throughput) for --paced-seconds;
     latency = ad query received - page view ts (p50/p95/p99), plus the worker-side part
     (ad query produced - page view ts), and the p99 of the phase's first and last quarter
     (a tail that grows within a phase shows there).
Before any mode is measured, each mode runs one unreported saturation pass of --warmup-events
and then --warmup-seconds paced at the highest --rate (its own topics and workers): a fresh
broker's JVM spends its first seconds of each new kind of load compiling (0.95 of a core for
~6 s, against ~0.4 warm; the small batches of a paced stream take other paths than a
saturating one's and compile again, ~10 s at 1,000 events/s). Without the pass the mode measured
first ran on a cold broker (saturation depended on the order of the modes), and the first
paced phase's first quarter on a broker still compiling (its p99 2-4x the last quarter's).
Where the time goes comes from the workers' own stage timers (decode, predict, Redis, policy,
Kafka produce+ack) published to Redis, per event and as shares of the workers' wall time.
Everything shares the machine's cores, the load generator included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from itertools import pairwise
from pathlib import Path
from typing import Any

import click
import numpy as np

from bench.stream_fault import FAULT_AT_S, FAULTS, LeaderKill
from bench.stream_load import CLIENTS, AdReader, default_client, make_load_producer
from infra.services import read_info
from stream.cli_stream import checked_model
from stream.consumer_metrics import STAGES, read_all
from stream.schemas import encode
from stream.settings import Settings, load_settings, settings_env
from stream.state_store import connect
from stream.topics import ensure_topics

ROOT = Path(__file__).resolve().parent.parent


def _stage_totals(settings: Settings) -> dict[str, float]:
    ms = read_all(connect(settings.redis.url.reveal()), settings.redis.key_prefix)
    out = {st: sum(float(m.get(f"{st}_s", 0)) for m in ms) for st in STAGES}
    out["events"] = sum(int(m.get("events", 0)) for m in ms)
    out["batches"] = sum(int(m.get("batches", 0)) for m in ms)
    return out


def _breakdown(before: dict, after: dict, wall_s: float, workers: int) -> dict:
    n = max(1, after["events"] - before["events"])
    per = {st: (after[st] - before[st]) for st in STAGES}
    busy = sum(per.values())
    out = {f"{st}_us_per_event": round(v / n * 1e6, 1) for st, v in per.items()}
    out.update({f"{st}_share": round(v / (wall_s * workers), 3) for st, v in per.items()})
    out["idle_or_poll_share"] = round(1 - busy / (wall_s * workers), 3)
    out["events_per_batch"] = round(n / max(1, after["batches"] - before["batches"]), 1)
    return out


class _CpuMeter:
    """CPU cores used during a phase by each party on the box: the broker and Redis (when their
    PIDs are known), the workers (the supervisor's process tree) and this load generator.

    Sampled every `every_s` too, so a phase also reports its first and last quarter (a broker
    whose cost grows with its log shows there) and each service's peak RSS."""

    def __init__(self, service_pids: dict[str, int], supervisor_pid: int, every_s: float = 1.0):
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in service_pids.items()}
        self.sup = psutil.Process(supervisor_pid)
        self.me = psutil.Process()
        self.every_s = every_s
        self._last: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        import psutil

        def cpu(p, name=""):
            try:
                t = p.cpu_times()
            except psutil.Error:  # ended (a killed node): its last reading, not a drop to 0
                return self._last.get(name, 0.0)
            self._last[name] = t.user + t.system
            return self._last[name]

        out = {name: cpu(p, name) for name, p in self.procs.items()}
        out["workers"] = sum(cpu(c) for c in [self.sup, *self.sup.children(recursive=True)])
        out["load_generator"] = cpu(self.me)
        out["t"] = time.monotonic()
        for name, p in self.procs.items():
            try:
                rss = p.memory_info().rss / 2**20
            except psutil.Error:
                continue
            self.rss_mb[name] = max(self.rss_mb.get(name, 0.0), rss)
        return out

    @staticmethod
    def _cores(a: dict, b: dict) -> dict[str, float]:
        wall = max(b["t"] - a["t"], 1e-9)
        out = {f"{k}_cores": round((b[k] - a.get(k, 0.0)) / wall, 3) for k in b if k != "t"}
        out["total_cores"] = round(sum(out.values()), 3)
        return out

    def start(self) -> None:
        self.rss_mb: dict[str, float] = {}
        self.samples = [self._now()]
        self._stop = threading.Event()

        def loop():
            while not self._stop.wait(self.every_s):
                self.samples.append(self._now())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.samples.append(self._now())
        out: dict[str, Any] = {**self._cores(self.samples[0], self.samples[-1])}
        n = len(self.samples)
        if n >= 9:  # at least two samples per quarter
            q = n // 4
            out["first_quarter"] = self._cores(self.samples[0], self.samples[q])
            out["last_quarter"] = self._cores(self.samples[n - 1 - q], self.samples[-1])
        self.per_second = [self._cores(a, b) for a, b in pairwise(self.samples)]
        out["peak_rss_mb"] = {k: round(v, 1) for k, v in self.rss_mb.items()}
        return out


def _send(
    producer, settings: Settings, titles: list[str], ids: list[str], users: int, rate: float | None
) -> float:
    t0 = time.monotonic()
    for i, eid in enumerate(ids):
        uid = f"bu{i % users}"
        producer.send(
            settings.topics.page_views,
            uid.encode(),
            encode(
                "page_view",
                {
                    "event_id": eid,
                    "user_id": uid,
                    "ts": time.time(),
                    "url": f"https://bench/{i}",
                    "title": titles[i % len(titles)],
                },
            ),
        )
        if rate:
            ahead = (i + 1) / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    producer.flush()
    return time.monotonic() - t0


def _pct(x: np.ndarray) -> dict:
    p = np.percentile(x, [50, 95, 99]) if x.size else [float("nan")] * 3
    return {
        "p50": round(float(p[0]), 2),
        "p95": round(float(p[1]), 2),
        "p99": round(float(p[2]), 2),
    }


def _answerable(titles: list[str], model: str, no_evidence: str) -> tuple[list[str], int]:
    """(the titles the workers answer, how many were left out): with `no_evidence` "skip" a
    title holding no word the model knows gets no ad, and a phase would wait for it forever."""
    if no_evidence != "skip":
        return titles, 0
    from stream.live_sim import known_words

    known = np.asarray(known_words(model)(titles), bool)
    kept = [t for t, k in zip(titles, known, strict=True) if k]
    if not kept:
        raise click.ClickException("no title holds a word the model knows: nothing to answer")
    return kept, len(titles) - len(kept)


def _read_titles(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        titles = [line.split("\t", 1)[0].strip() for line in f]
    titles = [t for t in titles if t]
    if not titles:
        raise click.ClickException(f"{path}: no titles")
    return titles


class _Pipeline:
    """`astec stream run` on fresh topics, group and Redis prefix, with its ad reader.

    Every phase gets its own, so no phase reads what an earlier one left (group offsets,
    state, a consumer lag to catch up on).
    """

    def __init__(
        self,
        settings: Settings,
        model: str,
        workers: int,
        batch_max: int,
        wlog,
        titles: list[str],
        users: int,
        service_pids: dict[str, int],
        load_client: str,
        delivery: str,
    ):
        tag = uuid.uuid4().hex[:8]
        self.s = settings.replace(
            topic_page_views=f"bench-pv-{tag}",
            topic_ad_queries=f"bench-aq-{tag}",
            topic_ad_clicks=f"bench-ac-{tag}",
            topic_dead_letters=f"bench-dl-{tag}",
            consumer_group=f"bench-{tag}",
            redis_key_prefix=f"bench-{tag}",
            metrics_interval_s=0.5,
            batch_max=batch_max,
            delivery=delivery,
        )
        self.model, self.workers, self.wlog = model, workers, wlog
        self.titles, self.users = titles, users
        self.service_pids = service_pids
        self.load_client = load_client

    def __enter__(self):
        s = self.s
        ensure_topics(s)
        self.sup = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infra.cli",
                "stream",
                "run",
                "--workers",
                str(self.workers),
                "--model",
                self.model,
            ],
            cwd=ROOT,
            stdout=self.wlog,
            stderr=subprocess.STDOUT,
            env={**os.environ, **settings_env(s), "ASTEC_LOG_LEVEL": "30"},
        )
        self.reader = AdReader(s, self.load_client)
        self.reader.start()
        self.producer = make_load_producer(self.load_client, s)
        self.cpu = _CpuMeter(self.service_pids, self.sup.pid)
        t_start = time.monotonic()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ms = read_all(connect(s.redis.url.reveal()), s.redis.key_prefix)
                # every worker owns a partition (where there are enough): a rebalance still
                # under way would otherwise move partitions, and hold their events, in the
                # first seconds of the phase
                owners = sum(int(m["partitions"]) > 0 for m in ms)
                if (
                    len(ms) >= self.workers
                    and owners >= min(self.workers, s.topics.partitions)
                    and sum(int(m["partitions"]) for m in ms) >= s.topics.partitions
                ):
                    break
                if self.sup.poll() is not None:
                    raise click.ClickException(f"`astec stream run` exited; log {self.wlog.name}")
                time.sleep(0.2)
            else:
                raise click.ClickException(f"workers did not join the group; log {self.wlog.name}")
            # worker start + group join until every partition is owned
            # (4.3-5.7 s at 4-32 partitions)
            self.join_s = round(time.monotonic() - t_start, 2)
            warm = [f"warm-{i}" for i in range(500)]
            _send(self.producer, s, self.titles, warm, self.users, None)
            self.reader.wait(warm, 60)
            time.sleep(1.0)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        self.producer.close(timeout=10)
        self.sup.send_signal(signal.SIGTERM)
        try:
            self.sup.wait(60)
        except subprocess.TimeoutExpired:
            self.sup.kill()
        self.reader.stop_event.set()
        self.reader.join(10)
        return False


def _service_pids(info) -> dict[str, int]:
    """{party: pid} of the services a run meters (a Redis topology's nodes are not metered)."""
    if info is None:
        return {}
    pids = {"broker": info.kafka.pid}
    if info.redis is not None:
        pids["redis"] = info.redis.pid
    pids.update({f"broker{i}": p.pid for i, p in enumerate(info.kafka_nodes, start=2)})
    return pids


def _quarters(arr: np.ndarray, e2a: np.ndarray) -> dict:
    """p99 of the first and last quarter of a phase's events, in send order."""
    if e2a.size < 8:
        return {}
    order = np.argsort(arr[:, 1])
    q = e2a.size // 4
    return {
        "first_quarter_p99": round(float(np.percentile(e2a[order[:q]], 99)), 2),
        "last_quarter_p99": round(float(np.percentile(e2a[order[-q:]], 99)), 2),
    }


def run_bench(
    settings: Settings,
    model: str,
    titles: list[str],
    events: int,
    workers: int,
    rates: list[float],
    paced_seconds: float,
    users: int,
    batch_max: int,
    service_pids: dict[str, int] | None = None,
    trace: str | None = None,
    load_client: str | None = None,
    deliveries: list[str] | None = None,
    log=click.echo,
    wait_replicas: list[int] | None = None,
    warmup_events: int = 0,
    fault: str = "none",
    fault_at_s: float = FAULT_AT_S,
    warmup_seconds: float = 0.0,
) -> dict:
    load0 = os.getloadavg()[0]  # the box is shared: say how busy it was
    load_client = load_client or default_client()
    # kept after the run (delete=False): the report names it
    with tempfile.NamedTemporaryFile(
        prefix="astec-bench-workers-", suffix=".log", delete=False
    ) as wlog:
        traces: list[dict] = []
        runs = []
        paced_warmup = max(rates) if rates and warmup_seconds > 0 else None
        for delivery in dict.fromkeys(deliveries or [settings.delivery]):
            if warmup_events > 0 or paced_warmup:
                with _Pipeline(
                    settings,
                    model,
                    workers,
                    batch_max,
                    wlog,
                    titles,
                    users,
                    service_pids or {},
                    load_client,
                    delivery,
                ) as p:
                    if warmup_events > 0:
                        ids = [f"warmup-{i}" for i in range(warmup_events)]
                        t0 = time.time()
                        _send(p.producer, p.s, titles, ids, users, None)
                        p.reader.wait(ids, 600)
                        log(
                            f"[{delivery}] warm-up: {warmup_events} events in "
                            f"{time.time() - t0:.1f}s (not reported)"
                        )
                    if paced_warmup:
                        n = max(1, int(paced_warmup * warmup_seconds))
                        ids = [f"warmup-paced-{i}" for i in range(n)]
                        _send(p.producer, p.s, titles, ids, users, paced_warmup)
                        p.reader.wait(ids, 120)
                        log(
                            f"[{delivery}] warm-up: {warmup_seconds:g}s paced at "
                            f"{paced_warmup:g}/s (not reported)"
                        )
        for delivery, wait in [
            (d, w)
            for d in deliveries or [settings.delivery]
            for w in wait_replicas or [settings.redis.wait_replicas]
        ]:
            runs.append(
                _run_mode(
                    settings.replace(redis_wait_replicas=wait),
                    model,
                    titles,
                    events,
                    workers,
                    rates,
                    paced_seconds,
                    users,
                    batch_max,
                    service_pids or {},
                    load_client,
                    delivery,
                    wlog,
                    traces,
                    log,
                    fault,
                    fault_at_s,
                )
            )
    if trace:
        Path(trace).write_text(json.dumps({"paced": traces}) + "\n")
    return {
        "workers": workers,
        "partitions": settings.topics.partitions,
        "batch_max": batch_max,
        "poll_timeout_ms": settings.consumer.poll_timeout_ms,
        "consumer_retry_backoff_ms": settings.consumer.retry_backoff_ms,
        "consumer_client": settings.consumer.client,
        "producer_client": settings.producer.client,
        "model": model,
        "cpu_count": os.cpu_count(),
        "warmup_events": warmup_events,
        "warmup_seconds": warmup_seconds,
        "fault": fault,
        "load_client": load_client,
        "loadavg_1m_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "runs": runs,
        "worker_log": wlog.name,
    }


def _run_mode(
    settings,
    model,
    titles,
    events,
    workers,
    rates,
    paced_seconds,
    users,
    batch_max,
    service_pids,
    load_client,
    delivery,
    wlog,
    traces,
    log,
    fault,
    fault_at_s,
) -> dict:
    """Saturation, then each paced rate, with the workers in one delivery mode and one
    redis_wait_replicas; a fault (bench/stream_fault.py) hits each paced phase."""
    mode = f"{delivery}, redis_wait_replicas {settings.redis.wait_replicas}"

    def pipeline() -> _Pipeline:
        return _Pipeline(
            settings,
            model,
            workers,
            batch_max,
            wlog,
            titles,
            users,
            service_pids,
            load_client,
            delivery,
        )

    duplicates = 0
    # phase 1: saturation
    with pipeline() as p:
        s, reader = p.s, p.reader
        log(f"[{mode}] {workers} workers joined; saturation with {events} events")
        ids = [f"sat-{i}" for i in range(events)]
        before = _stage_totals(s)
        p.cpu.start()
        t_first = time.time()
        send_s = _send(p.producer, s, titles, ids, users, None)
        ok = reader.wait(ids, 600)
        cpu = p.cpu.stop()
        t_last = max(reader.arrivals[e][0] for e in ids if e in reader.arrivals)
        time.sleep(1.0)
        after = _stage_totals(s)
        wall = t_last - t_first
        got = sum(e in reader.arrivals for e in ids)
        sat = {
            "events": events,
            "answered": got,
            "complete": ok,
            "send_s": round(send_s, 2),
            "wall_s": round(wall, 2),
            "events_per_s": round(got / wall, 1),
            "where_time_goes": _breakdown(before, after, wall, workers),
            "cpu": cpu,
            "join_s": p.join_s,
        }
        duplicates += reader.duplicates
    log(f"[{mode}] saturation: {sat['events_per_s']} events/s ({got}/{events} in {wall:.1f}s)")

    # phase 2: paced below saturation, one run per rate, each on fresh topics
    paced = []
    for k, r in enumerate(rates or [round(0.5 * sat["events_per_s"])]):
        with pipeline() as p:
            s, reader = p.s, p.reader
            n2 = max(100, int(r * paced_seconds))
            ids2 = [f"paced{k}-{i}" for i in range(n2)]
            before = _stage_totals(s)
            p.cpu.start()
            kill = None
            if fault == "kill-leader":
                kill = LeaderKill(s.services_dir, s, fault_at_s)
                kill.start()
            t0 = time.time()
            try:
                send_s = _send(p.producer, s, titles, ids2, users, r)
                # a crash holds some answers until leaders move and the workers retry
                ok2 = reader.wait(ids2, 120 if kill is None else 300)
                cpu = p.cpu.stop()
                wall2 = time.time() - t0
            finally:
                if kill is not None:  # the next phase starts on a whole cluster
                    kill.restore()
                    if service_pids:  # the restarted node's new process is metered
                        service_pids.update(_service_pids(read_info(s.services_dir)))
            time.sleep(1.0)
            after = _stage_totals(s)
            arr = np.array([reader.arrivals[e] for e in ids2 if e in reader.arrivals])
            duplicates += reader.duplicates
            dup2 = reader.duplicates
            traces.append(
                {
                    "delivery": delivery,
                    "redis_wait_replicas": settings.redis.wait_replicas,
                    "rate": r,
                    "columns": ["event_ts", "ad_ts", "received_ts"],
                    "events": arr[:, [1, 2, 0]].round(4).tolist() if arr.size else [],
                    "cores_per_second": p.cpu.per_second,
                }
            )
        e2a = (arr[:, 0] - arr[:, 1]) * 1000 if arr.size else np.zeros(0)
        worker_side = (arr[:, 2] - arr[:, 1]) * 1000 if arr.size else np.zeros(0)
        paced.append(
            {
                "rate": r,
                "events": n2,
                "answered": len(arr),
                "complete": ok2,
                "seconds": round(send_s, 1),
                "achieved_send_rate": round(n2 / send_s, 1),
                "e2a_ms": {**_pct(e2a), **_quarters(arr, e2a)},
                "worker_side_ms": _pct(worker_side),
                "where_time_goes": _breakdown(before, after, wall2, workers),
                "cpu": cpu,
                "join_s": p.join_s,
                "duplicates": dup2,
            }
        )
        log(
            f"[{mode}] paced at {r}/s for {send_s:.0f}s: e2a p50 "
            f"{paced[-1]['e2a_ms']['p50']} ms, p99 {paced[-1]['e2a_ms']['p99']} ms"
        )
        if kill is not None:
            f = paced[-1]["fault"] = kill.figures(arr)
            if "error" in f:
                log(f"[{mode}] fault at {r}/s: {f['error']}")
            else:
                log(
                    f"[{mode}] node {f['node']} (leader of page-views partition "
                    f"{f['partition']}) killed at {fault_at_s:g}s: {n2 - len(arr)} unanswered, "
                    f"longest gap in answers {f['longest_gap_s']} s, p99 {f['p99_ms_before']} "
                    f"ms before, {f['p99_ms_minute_after']} ms over the minute after"
                )
    return {
        "delivery": delivery,
        "redis_wait_replicas": settings.redis.wait_replicas,
        "saturation": sat,
        "paced": paced,
        "duplicates_on_output": duplicates,
    }


@click.command("stream")
@click.option(
    "--model",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    callback=checked_model,
    help="Exported predictor dir (or model registry root).",
)
@click.option(
    "--events", default=50000, show_default=True, help="Page views in the saturation phase."
)
@click.option("--workers", default=2, show_default=True)
@click.option(
    "--rate",
    "rates",
    type=float,
    multiple=True,
    help="Paced phase rate; repeat for several runs (default: one run at 50% of the "
    "measured saturation throughput).",
)
@click.option(
    "--paced-seconds",
    default=60.0,
    show_default=True,
    type=click.FloatRange(1),
    help="Length of each paced phase (its events: rate x seconds).",
)
@click.option(
    "--delivery",
    "deliveries",
    multiple=True,
    type=click.Choice(["exactly-once", "at-least-once"]),
    help="Workers' delivery mode; repeat to run both side by side (default: the "
    "`delivery` setting, exactly-once).",
)
@click.option(
    "--wait-replicas",
    "wait_replicas",
    multiple=True,
    type=click.IntRange(-1, 16),
    help="Workers' redis_wait_replicas (-1: 1 where the primary has a replica; 0: no wait); "
    "repeat to measure the cost of waiting for a replica in one command (each value runs "
    "with each --delivery).",
)
@click.option(
    "--titles",
    type=click.Path(exists=True, dir_okay=False),
    default=str(ROOT / "tests" / "data" / "stream" / "train.tsv"),
    show_default=True,
    help="Page titles: first TSV column of this file.",
)
@click.option("--users", default=5000, show_default=True, help="Distinct simulated users.")
@click.option(
    "--warmup-events",
    default=20000,
    show_default=True,
    type=click.IntRange(0),
    help="Events of one unreported saturation pass per delivery mode before any is measured "
    "(a fresh broker's JVM is slower for its first seconds of load); 0 skips it.",
)
@click.option(
    "--warmup-seconds",
    default=20.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds of unreported traffic paced at the highest --rate after the warm-up's "
    "saturation pass (a paced stream's small batches are new load to the broker's JVM); "
    "0 skips it.",
)
@click.option("--batch-max", default=256, show_default=True)
@click.option(
    "--use-running",
    is_flag=True,
    help="Use the configured services (env/config/`astec infra up`) instead of fresh "
    "temporary ones (those are removed after a successful run).",
)
@click.option(
    "--load-client",
    type=click.Choice(CLIENTS),
    default=None,
    help="Client of the page-view load generator and the ad-queries reader (they stand "
    "in for off-box front ends and ad servers): confluent (librdkafka, ~1/4 of the "
    "CPU per message; the default when confluent-kafka is installed) or "
    "kafka-python. The workers follow ASTEC_CONSUMER_CLIENT and "
    "ASTEC_PRODUCER_CLIENT.",
)
@click.option(
    "--brokers",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="Kafka nodes of the fresh services (a cluster from 2: topics replicated min(N, 3) "
    "times, min.insync.replicas 2 from 3); ignored with --use-running.",
)
@click.option(
    "--fault",
    type=click.Choice(FAULTS),
    default="none",
    show_default=True,
    help="kill-leader: SIGKILL the Kafka node leading the busiest page-views partition "
    "--fault-at seconds into each paced phase (it stays down for the phase and is started "
    "again before the next) and report the longest gap in answers and the p99 over the "
    "minute after; needs a cluster (--brokers 3, or --use-running on one).",
)
@click.option(
    "--fault-at",
    "fault_at_s",
    default=FAULT_AT_S,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds into each paced phase when the fault hits (make --paced-seconds at least "
    "this plus 60 for a whole minute after it).",
)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the JSON here.")
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also write every paced event's (event, ad, received) times and each party's "
    "CPU cores per second here (JSON), to look at the tail.",
)
def bench_stream(
    model,
    events,
    workers,
    rates,
    paced_seconds,
    titles,
    users,
    warmup_events,
    warmup_seconds,
    batch_max,
    use_running,
    load_client,
    deliveries,
    wait_replicas,
    brokers,
    fault,
    fault_at_s,
    out,
    trace,
):
    """End-to-end events/s and event->ad latency p50/p99 of `astec stream run`, with a breakdown."""
    import logging

    from infra.services import start_services, stop_services

    # kafka-python warns when this 2-core box starves its I/O thread; the figures say it anyway
    logging.getLogger("kafka.net.selector").setLevel(logging.ERROR)
    titles_list = _read_titles(titles)
    if fault != "none" and fault_at_s >= paced_seconds:
        raise click.BadParameter(
            f"{fault_at_s:g} s is not inside a {paced_seconds:g} s paced phase",
            param_hint="--fault-at",
        )
    if fault != "none" and not use_running and brokers < 2:
        raise click.BadParameter(
            f"--fault {fault} needs a Kafka cluster (--brokers 3)", param_hint="--brokers"
        )
    titles_list, unknown = _answerable(titles_list, model, load_settings().prediction.no_evidence)
    if unknown:
        click.echo(
            f"{unknown} of {unknown + len(titles_list)} titles hold no word the model knows and "
            "get no ad (no_evidence = skip): not sent"
        )
    tmp = info = None
    if use_running:
        settings = load_settings()
        info = read_info(settings.services_dir)  # None for services we did not start: no CPU
        if fault != "none" and (info is None or not info.kafka_nodes):
            raise click.ClickException(
                f"--fault {fault} kills a node of the services recorded in "
                f"{settings.services_dir}, and none is a cluster (astec infra up --brokers 3)"
            )
    else:
        tmp = tempfile.mkdtemp(prefix="astec-bench-services-")
        info = start_services(tmp, brokers=brokers)
        # the user's config file / ASTEC_* environment apply (e.g. ASTEC_POLL_TIMEOUT_MS); only
        # the service addresses are this run's own
        settings = load_settings(
            services_dir=tmp, kafka_bootstrap=info.kafka_bootstrap, redis_url=info.redis_url
        )
    res = None
    try:
        pids = _service_pids(info)
        res = run_bench(
            settings,
            model,
            titles_list,
            events,
            workers,
            list(rates),
            paced_seconds,
            users,
            batch_max,
            pids,
            trace,
            load_client,
            list(deliveries),
            wait_replicas=list(wait_replicas),
            warmup_events=warmup_events,
            warmup_seconds=warmup_seconds,
            fault=fault,
            fault_at_s=fault_at_s,
        )
        res["titles_without_evidence_left_out"] = unknown
    finally:
        if tmp:
            stop_services(tmp)
            if res is None:
                click.echo(f"bench stream failed; the services' logs are kept in {tmp}", err=True)
            else:
                # the run's own broker and Redis data (~90 MB a run): nothing outlives the figures
                shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(res, indent=1)
    click.echo(text)
    if out:
        Path(out).write_text(text + "\n")
