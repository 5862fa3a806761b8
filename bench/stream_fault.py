"""`astec bench stream --fault kill-leader`: a Kafka node lost in the middle of a paced phase.

At `at_s` into the phase the node leading the busiest `page-views` partition is killed with
SIGKILL (a crash: no controlled shutdown, its leaderships move only when the controller fences
it); it stays down for the rest of the phase and is started again on its ports and storage
before the next phase, so every phase begins on a whole cluster. What the people running the
stream pay for such a crash is read off the ad reader's arrivals: the longest stretch with no
ad answered at all, and the event -> ad p99 of the page views the kill could hold (answered
after it, sent before the minute after it ends), beside the p99 of those answered before it and
of those sent after the stall (is the stream back to its pace, or still catching up?).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from infra.kafka_cluster import busiest_partition, kill_node, leader_of, restart_nodes
from stream.settings import Settings

FAULTS = ("none", "kill-leader")
WINDOW_S = 60.0  # "the minute after the kill"
FAULT_AT_S = 20.0  # seconds into each paced phase (--fault-at)


def longest_gap(received: np.ndarray, t: float, lead_s: float = 1.0) -> tuple[float, float]:
    """(the longest stretch with no answer among the answers received from `lead_s` before the
    fault at `t` on, when it began relative to `t`) in seconds; (nan, nan) with fewer than two."""
    after = np.sort(received[received >= t - lead_s])
    if after.size < 2:
        return float("nan"), float("nan")
    d = np.diff(after)
    i = int(np.argmax(d))
    return float(d[i]), float(after[i] - t)


@dataclass
class LeaderKill:
    """Kills the busiest page-views partition's leader `at_s` after `start`; `restore` starts
    it again. Runs on a timer thread so the paced producer keeps its pace through the kill."""

    services_dir: str
    settings: Settings
    at_s: float
    node: int = -1
    partition: int = -1
    t_kill: float = float("nan")
    error: str = ""
    _timer: threading.Timer | None = field(default=None, repr=False)

    def start(self) -> None:
        self._timer = threading.Timer(self.at_s, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        from confluent_kafka import KafkaException

        s = self.settings
        try:
            self.partition = busiest_partition(s, s.topics.page_views)
            self.node = leader_of(s, s.topics.page_views, self.partition)
            if self.node < 1:
                raise RuntimeError(f"partition {self.partition} has no leader")
            self.t_kill = time.time()
            kill_node(self.services_dir, self.node)
        except (KafkaException, RuntimeError, OSError) as e:  # reported with the phase's figures
            self.error = f"{type(e).__name__}: {e}"

    def restore(self) -> None:
        """Wait for the kill (a phase shorter than at_s cancels it) and restart the node."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
        if self.node >= 1 and not np.isnan(self.t_kill):
            restart_nodes(self.services_dir, [self.node])

    def figures(self, arr: np.ndarray) -> dict:
        """The fault's figures from the reader's arrivals arr [n, 3] = (received, event ts, ad
        ts) of the phase's answered events (seconds since the epoch)."""
        out: dict = {"kind": "kill-leader", "at_s": self.at_s}
        if self.error or np.isnan(self.t_kill):
            out["error"] = self.error or f"the phase ended before {self.at_s} s: no kill"
            return out
        t = self.t_kill
        arr = arr.reshape(-1, 3)  # no answer at all: an empty [0, 3]
        got, sent = arr[:, 0], arr[:, 1]
        gap, start = longest_gap(got, t)
        e2a = (got - sent) * 1000
        last = float(sent.max()) if sent.size else t
        # every event the kill could hold: not answered by then and sent within the minute
        win = (got >= t) & (sent < t + WINDOW_S)
        before = got < t  # sent and answered before the kill: the steady state

        def p99(x: np.ndarray) -> float:
            return round(float(np.percentile(x, 99)), 1) if x.size else float("nan")

        # once answers flow again: the events sent after the stall, within the minute
        settled = win if np.isnan(gap) else (sent >= t + start + gap) & (sent < t + WINDOW_S)
        out.update(
            node=self.node,
            partition=self.partition,
            longest_gap_s=round(gap, 2),
            gap_starts_after_kill_s=round(start, 2),
            p99_ms_before=p99(e2a[before]),
            p99_ms_minute_after=p99(e2a[win]),
            max_ms_minute_after=round(float(e2a[win].max()), 1) if win.any() else float("nan"),
            p99_ms_after_the_gap=p99(e2a[settled]),
            minute_after_covered_s=round(min(WINDOW_S, max(0.0, last - t)), 1),
        )
        return out
