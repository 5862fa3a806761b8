"""Per-consumer operational metrics, published to Redis (and optionally Prometheus).

Redis layout, read by the dashboard:
    <prefix>:metrics:consumers              set of consumer ids seen
    <prefix>:metrics:consumer:<id>          hash, rewritten every metrics_interval_s, TTL 120 s:
        events, events_per_s, dead_letters, duplicates, batches, partitions (assigned now),
        no_query, refused_versions (versions its hot reload refused), redis_retries,
        commit_failures, model_version, policy, pid,
        batch_ms_p50/p99, e2a_ms_p50/p95/p99 (event ts -> ad query acked), time shares
        predict_s/redis_s/policy_s/kafka_s/decode_s (cumulative seconds), updated_at
        (and lag, messages behind the partitions' ends, once the worker sets metrics.lag)
    <prefix>:metrics:series:<id>            list of JSON points, newest first, one per publish:
        capped at SERIES_LEN points (LTRIM) and expiring SERIES_TTL_S after the last publish,
        so its memory is bounded by design (~200 bytes x 600 points per consumer) and a
        consumer that stopped keeps its history for an hour. A point holds the cumulative
        counters (rates come from differences, robust to a missed point), the rate over the
        last 10 s, and the event->ad p50/p99 of the events since the previous point only
        (the snapshot's percentiles cover the last 20,000 events, too slow to show a spike).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

STAGES = ("decode", "predict", "redis", "policy", "kafka")
SERIES_LEN = 600  # points kept per consumer: 10 minutes at the default 1 s interval
SERIES_TTL_S = 3600  # a silent consumer's series disappears an hour after its last point
PRUNE_EVERY = 300  # publishes between two prunings of the consumers set (5 minutes at 1 s)
SERIES_FIELDS = ("events", "events_per_s", "dead_letters", "no_query", "duplicates", "lag")


class Ring:
    """The last `size` samples, for percentiles without unbounded memory."""

    def __init__(self, size: int = 20000):
        self.buf = np.zeros(size, np.float64)
        self.n = 0

    def extend(self, xs: np.ndarray) -> None:
        xs = np.asarray(xs, np.float64)[-self.buf.size :]
        i = self.n % self.buf.size
        first = min(xs.size, self.buf.size - i)
        self.buf[i : i + first] = xs[:first]
        self.buf[: xs.size - first] = xs[first:]
        self.n += xs.size

    def values(self) -> np.ndarray:
        return self.buf[: min(self.n, self.buf.size)]

    def pct(self, q) -> np.ndarray:
        v = self.values()
        return np.percentile(v, q) if v.size else np.full(np.shape(q), np.nan)


@dataclass
class ConsumerMetrics:
    consumer_id: str
    policy: str = ""
    model_version: str = ""
    events: int = 0
    dead_letters: int = 0
    duplicates: int = 0
    batches: int = 0
    partitions: int = 0
    no_query: int = 0  # events whose page got no predicted query (no ad query sent)
    lag: int | None = None  # messages behind the assigned partitions' ends (set by the worker)
    refused_versions: int = 0  # model / policy versions its hot reload refused (set by the worker)
    redis_retries: int = 0  # Redis calls retried while it was unavailable (set by the worker)
    commit_failures: int = 0  # offset commits refused (set by the worker)
    stage_s: dict = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    e2a_ms: Ring = field(default_factory=Ring)
    batch_ms: Ring = field(default_factory=lambda: Ring(4000))
    started: float = field(default_factory=time.monotonic)
    _window: list = field(default_factory=list)  # (monotonic time, events) of recent publishes
    _since: Ring = field(default_factory=Ring)  # event->ad samples since the last series point
    _publishes: int = 0

    def record_batch(
        self,
        n_events: int,
        n_dead: int,
        n_dup: int,
        batch_s: float,
        e2a_ms: np.ndarray,
        stages: dict[str, float],
    ) -> None:
        self.events += n_events
        self.dead_letters += n_dead
        self.duplicates += n_dup
        self.batches += 1
        self.batch_ms.extend(np.array([batch_s * 1000.0]))
        if len(e2a_ms):
            self.e2a_ms.extend(e2a_ms)
            self._since.extend(e2a_ms)
        for k, v in stages.items():
            self.stage_s[k] = self.stage_s.get(k, 0.0) + v

    def snapshot(self) -> dict:
        now = time.monotonic()
        self._window.append((now, self.events))
        self._window = [w for w in self._window if now - w[0] <= 10.0]
        t0, e0 = self._window[0]
        rate = (self.events - e0) / (now - t0) if now > t0 else 0.0
        b50, b99 = self.batch_ms.pct([50, 99])
        l50, l95, l99 = self.e2a_ms.pct([50, 95, 99])
        snap = {
            "consumer": self.consumer_id,
            "pid": os.getpid(),
            "policy": self.policy,
            "model_version": self.model_version,
            "events": self.events,
            "events_per_s": round(rate, 1),
            "dead_letters": self.dead_letters,
            "duplicates": self.duplicates,
            "batches": self.batches,
            "partitions": self.partitions,
            "no_query": self.no_query,
            "refused_versions": self.refused_versions,
            "redis_retries": self.redis_retries,
            "commit_failures": self.commit_failures,
            "batch_ms_p50": b50,
            "batch_ms_p99": b99,
            "e2a_ms_p50": l50,
            "e2a_ms_p95": l95,
            "e2a_ms_p99": l99,
            "uptime_s": round(now - self.started, 1),
            "updated_at": time.time(),
        }
        if self.lag is not None:
            snap["lag"] = int(self.lag)
        snap.update({f"{k}_s": round(v, 4) for k, v in self.stage_s.items()})
        return {
            k: (round(float(v), 3) if isinstance(v, (float, np.floating)) else v)
            for k, v in snap.items()
        }

    def series_point(self, snap: dict) -> dict:
        """One time-series point from `snap`: its counters and the event->ad p50/p99 of the
        events since the previous point (None when none arrived), then starts a new interval."""
        p50, p99 = self._since.pct([50, 99])
        n = int(min(self._since.n, self._since.buf.size))
        self._since.n = 0
        point = {
            "t": snap["updated_at"],
            "n_e2a": n,
            "e2a_ms_p50": None if n == 0 else round(float(p50), 3),
            "e2a_ms_p99": None if n == 0 else round(float(p99), 3),
            "model_version": snap.get("model_version", ""),
        }
        point.update({k: snap[k] for k in SERIES_FIELDS if snap.get(k) is not None})
        return point


def series_key(prefix: str, consumer_id: str) -> str:
    return f"{prefix}:metrics:series:{consumer_id}"


def publish(
    client,
    prefix: str,
    metrics: ConsumerMetrics,
    ttl_s: int = 120,
    series_len: int = SERIES_LEN,
    series_ttl_s: int = SERIES_TTL_S,
) -> dict:
    """Write the snapshot and append a series point (one pipelined round trip).

    The consumers set expires with the series, and every PRUNE_EVERY publishes the ids whose
    series has expired (consumers gone for an hour) are removed from it, so ids do not
    accumulate across restarts while other workers keep the set alive."""
    snap = metrics.snapshot()
    point = metrics.series_point(snap)
    key = f"{prefix}:metrics:consumer:{metrics.consumer_id}"
    skey = series_key(prefix, metrics.consumer_id)
    ids = f"{prefix}:metrics:consumers"
    pipe = client.pipeline(transaction=False)
    pipe.hset(
        key,
        mapping={
            k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in snap.items()
        },
    )
    pipe.expire(key, ttl_s)
    pipe.sadd(ids, metrics.consumer_id)
    pipe.expire(ids, max(ttl_s, series_ttl_s))
    pipe.lpush(skey, json.dumps(point, separators=(",", ":")))
    pipe.ltrim(skey, 0, series_len - 1)
    pipe.expire(skey, series_ttl_s)
    pipe.execute()
    if metrics._publishes % PRUNE_EVERY == 0:
        prune_consumers(client, prefix)
    metrics._publishes += 1
    return snap


def prune_consumers(client, prefix: str) -> list[str]:
    """Remove from the consumers set the ids with neither a snapshot nor a series left (both
    expired: the consumer stopped more than SERIES_TTL_S ago); returns them."""
    ids = [
        x.decode() if isinstance(x, bytes) else x
        for x in client.smembers(f"{prefix}:metrics:consumers")
    ]
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for cid in ids:  # one key per EXISTS: on Redis Cluster the two may live in different slots
        pipe.exists(series_key(prefix, cid))
        pipe.exists(f"{prefix}:metrics:consumer:{cid}")
    found = pipe.execute()
    stale = [cid for i, cid in enumerate(ids) if not (found[2 * i] or found[2 * i + 1])]
    if stale:
        client.srem(f"{prefix}:metrics:consumers", *stale)
    return stale


def read_series(client, prefix: str, max_points: int = SERIES_LEN) -> dict[str, list[dict]]:
    """Every consumer's recent series points, oldest first (consumers gone < an hour included).

    A point that is not a JSON object (written by something else) is skipped."""
    ids = sorted(
        x.decode() if isinstance(x, bytes) else x
        for x in client.smembers(f"{prefix}:metrics:consumers")
    )
    pipe = client.pipeline(transaction=False)
    for cid in ids:
        pipe.lrange(series_key(prefix, cid), 0, max_points - 1)
    out = {}
    for cid, raw in zip(ids, pipe.execute(), strict=True):
        pts = []
        for r in reversed(raw):
            try:
                p = json.loads(r)
            except ValueError:
                continue
            if isinstance(p, dict) and isinstance(p.get("t"), (int, float)):
                pts.append(p)
        if pts:
            out[cid] = pts
    return out


def partitions_shared(snaps: list[dict], workers: int, partitions: int) -> bool:
    """Whether exactly `workers` consumers each own partitions and together own all of them: the
    group has settled. A worker publishes before it joins, so counting consumers alone would let
    traffic start before the last rebalance (whose replays are answered twice)."""
    owned = [int(m["partitions"]) for m in snaps]
    return len(owned) == workers and all(owned) and sum(owned) == partitions


def read_all(client, prefix: str) -> list[dict]:
    """Every live consumer's last snapshot (what the dashboard shows)."""
    ids = sorted(
        x.decode() if isinstance(x, bytes) else x
        for x in client.smembers(f"{prefix}:metrics:consumers")
    )
    pipe = client.pipeline(transaction=False)
    for cid in ids:
        pipe.hgetall(f"{prefix}:metrics:consumer:{cid}")
    out = []
    for h in pipe.execute():
        if h:
            out.append(
                {
                    (k.decode() if isinstance(k, bytes) else k): (
                        v.decode() if isinstance(v, bytes) else v
                    )
                    for k, v in h.items()
                }
            )
    return out


class PromExporter:
    """Optional Prometheus endpoint mirroring the Redis metrics (metrics_port > 0), with
    /healthz and /readyz answered from `health` (stream.worker_health.WorkerHealth: 200 when
    passing, 503 otherwise, JSON body naming each check). Binds `host` (the metrics_host
    setting: loopback unless a Prometheus server on another host must scrape it)."""

    def __init__(self, port: int, consumer_id: str, host: str = "127.0.0.1", health=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.reg = CollectorRegistry()
        lab = {"consumer": consumer_id}
        self.events = Counter(
            "astec_stream_events", "page views processed", ["consumer"], registry=self.reg
        ).labels(**lab)
        self.dead = Counter(
            "astec_stream_dead_letters",
            "messages sent to the dead-letter topic",
            ["consumer"],
            registry=self.reg,
        ).labels(**lab)
        self.batch = Histogram(
            "astec_stream_batch_seconds", "batch latency", ["consumer"], registry=self.reg
        ).labels(**lab)
        self.e2a = Histogram(
            "astec_stream_event_to_ad_seconds",
            "event ts -> ad query acked",
            ["consumer"],
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
            registry=self.reg,
        ).labels(**lab)
        self.version = Gauge(
            "astec_stream_model_info",
            "model version in use",
            ["consumer", "version"],
            registry=self.reg,
        )
        self._last_version: str | None = None
        self.cid = consumer_id
        self.health = health
        if health is not None:
            self.reg.register(_HealthCollector(consumer_id, health))
        self.server = serve_http(host, port, self.reg, health)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def observe(
        self, n_events: int, n_dead: int, batch_s: float, e2a_ms: np.ndarray, version: str
    ) -> None:
        self.events.inc(n_events)
        self.dead.inc(n_dead)
        self.batch.observe(batch_s)
        for x in np.asarray(e2a_ms)[:: max(1, len(e2a_ms) // 64)]:  # sampled: bounded cost
            self.e2a.observe(float(x) / 1000.0)
        if version != self._last_version:
            if self._last_version is not None:
                self.version.remove(self.cid, self._last_version)
            self.version.labels(consumer=self.cid, version=version).set(1)
            self._last_version = version


# health counters under their Prometheus names: (name, kind, help)
_HEALTH_METRICS = (
    ("commit_failures", "counter", "offset commits the broker refused (the batches replay)"),
    ("redis_retries", "counter", "Redis calls retried while Redis was unavailable"),
    ("refused_versions", "gauge", "model / policy versions the hot reload refused"),
    ("partitions", "gauge", "partitions assigned now"),
    ("lag", "gauge", "messages behind the assigned partitions' ends (-1: unknown)"),
    ("redis_unavailable", "gauge", "1 while the worker waits for Redis"),
)


class _HealthCollector:
    """The worker's counters, read when scraped (no bookkeeping on the batch path)."""

    def __init__(self, consumer_id: str, health):
        self.cid, self.health = consumer_id, health

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        values = self.health.counters()
        for name, kind, text in _HEALTH_METRICS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = cls(f"astec_stream_{name}", text, labels=["consumer"])
            m.add_metric([self.cid], float(values[name]))
            yield m


def serve_http(host: str, port: int, registry, health=None):
    """A threaded HTTP server on host:port (daemon threads): /healthz, /readyz, and the
    registry's metrics on every other path. Returns the server (shutdown() stops it)."""
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz") and health is not None:
            ok, checks = health.alive() if path == "/healthz" else health.readiness()
            body = json.dumps({"ok": ok, **checks}).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        return metrics_app(environ, start_response)

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # no access log on the worker's stderr
            pass

    httpd = make_server(host, port, app, Server, handler_class=Quiet)
    threading.Thread(target=httpd.serve_forever, name="astec-metrics", daemon=True).start()
    return httpd
