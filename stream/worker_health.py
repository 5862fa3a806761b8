"""A worker's health: waiting out a Redis outage while staying in the group, and what /healthz
and /readyz report.

While Redis is unavailable (connection refused, a failover in progress, an infrastructure reply
such as READONLY or CLUSTERDOWN: stream.state_store.RedisUnavailable) the batch at hand cannot be
stored, and a worker that retried without polling would overrun `max.poll.interval` and be
evicted from its group (its partitions then bounce between members all doing the same). So the
retry pauses the worker's partitions and keeps polling between attempts: the group sees a live
member, nothing new is fetched, and the batch resumes where it stopped when Redis answers again
(its offsets stay uncommitted until then). Records that arrive anyway (partitions assigned by a
rebalance during the pause) are rewound and paused too. The same hold covers a long wait for
the broker's acknowledgements (a frozen leader until its partitions move: StreamWorker.settle).

Ready (/readyz) = the worker owns partitions, has polled recently, Redis answers (no outage
under way) and the broker acknowledges what it produces (no batch waiting for acks longer than
BROKER_STALL_S). Alive (/healthz) = the loop polled within LIVE_S.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis

log = logging.getLogger(__name__)
T = TypeVar("T")
BROKER_STALL_S = 30.0  # a batch unacknowledged this long: the broker is not answering
LIVE_S = 60.0  # a loop that has not polled this long is stuck
RETRYABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.NoScriptError)


class WorkerHealth:
    """Bound to one stream.worker.StreamWorker (its consumer, stop event, in-flight batches)."""

    def __init__(self, worker: Any):
        self.w = worker
        self.last_poll = time.monotonic()
        self.redis_down_since: float | None = None
        self.redis_retries = 0
        self._paused: set = set()

    def polled(self) -> None:
        self.last_poll = time.monotonic()

    # ---- Redis outages --------------------------------------------------------------------
    def retry_redis(self, call: Callable[[], T]) -> T:
        """call() until it succeeds, holding the partitions (paused, polled) between attempts
        with backoff (0.1 s doubling to 2 s); raises only when the worker is stopping."""
        delay = 0.1
        try:
            while True:
                try:
                    out = call()
                except RETRYABLE as exc:
                    if self.w.stop_event.is_set():
                        raise
                    self.redis_retries += 1
                    self.w.metrics.redis_retries = self.redis_retries
                    now = time.monotonic()
                    if self.redis_down_since is None:
                        self.redis_down_since = now
                    log.warning(
                        "%s: Redis unavailable for %.1fs (%s); partitions paused, retrying in "
                        "%.1fs",
                        self.w.cid,
                        now - self.redis_down_since,
                        exc,
                        delay,
                    )
                    self.hold(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                if self.redis_down_since is not None:
                    log.warning(
                        "%s: Redis answers again after %.1fs; resuming",
                        self.w.cid,
                        time.monotonic() - self.redis_down_since,
                    )
                return out
        finally:
            self.redis_down_since = None
            self.resume()

    def hold(self, seconds: float) -> None:
        """Poll for `seconds` with every owned partition paused (membership kept alive)."""
        consumer = self.w.consumer
        end = time.monotonic() + seconds
        while True:
            self._pause(consumer.assignment())
            polled = consumer.poll(timeout_ms=int(max(1, min(200, (end - time.monotonic()) * 1e3))))
            self.polled()
            if polled:  # fetched before the pause took (a partition newly assigned): again later
                first = {tp: min(r.offset for r in rs) for tp, rs in polled.items() if rs}
                _rewind(consumer, first)
                self._pause(set(first))
            if time.monotonic() >= end or self.w.stop_event.is_set():
                return

    def _pause(self, tps: set) -> None:
        """Pause them all again each time (idempotent in both clients): a partition revoked and
        assigned back by a rebalance comes back unpaused."""
        if tps:
            self.w.consumer.pause(*tps)
            self._paused |= set(tps)

    def resume(self) -> None:
        if self._paused:
            owned = self._paused & set(self.w.consumer.assignment())
            if owned:
                self.w.consumer.resume(*owned)
            self._paused = set()

    # ---- health and readiness -------------------------------------------------------------
    def alive(self) -> tuple[bool, dict]:
        since = time.monotonic() - self.last_poll
        return since < LIVE_S, {"last_poll_s": round(since, 3)}

    def readiness(self) -> tuple[bool, dict]:
        """(ready, the checks by name: True when passing) for /readyz."""
        now = time.monotonic()
        w = self.w
        oldest = min((b.t0 for b in w.inflight), default=None)
        checks = {
            "assigned": bool(w.consumer.assignment()),
            "polling": now - self.last_poll < max(w.s.consumer.max_poll_interval_ms / 1000.0, 1.0),
            "redis": self.redis_down_since is None,
            "broker": oldest is None or time.perf_counter() - oldest < BROKER_STALL_S,
            "running": not w.stop_event.is_set(),
        }
        return all(checks.values()), checks

    def counters(self) -> dict[str, float]:
        """Operational counters read at scrape time (Prometheus)."""
        w = self.w
        lag = w.metrics.lag
        return {
            "commit_failures": w.commit_failures,
            "redis_retries": self.redis_retries,
            "refused_versions": w.metrics.refused_versions,
            "partitions": len(w.consumer.assignment()),
            "lag": -1 if lag is None else lag,
            "redis_unavailable": 0 if self.redis_down_since is None else 1,
        }


def _rewind(consumer: Any, first: dict) -> None:
    """Fetch again from {TopicPartition: offset} (librdkafka's wrapper, or kafka-python)."""
    if hasattr(consumer, "rewind"):
        consumer.rewind(first)
        return
    for tp, off in first.items():
        consumer.seek(tp, off)
