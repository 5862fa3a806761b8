"""Exactly-once: one transaction's commit on a thread of its own, off the worker's loop.

A commit (AddOffsetsToTxn, TxnOffsetCommit, EndTxn) is a few broker round trips; waited for on
the worker's loop it held every event that arrived meanwhile, which made exactly-once cost
several times at-least-once's Kafka time per event. The worker starts the commit here and goes
on polling and predicting; it looks at `done` between batches. A producer cannot produce into
the next transaction while this one commits (librdkafka serialises the transactional calls), so
the worker holds the next interval's messages until the commit returned (worker.OpenTxn).

A daemon thread per commit (~0.1 ms against a commit of several ms): a commit stuck in
librdkafka must never keep the process from exiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundCommit:
    """`commit()` running on its own thread; `error` is what it raised (None: committed)."""

    def __init__(self, commit: Callable[[], None]):
        self._commit = commit
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.t_start = time.monotonic()
        self.t_done = 0.0  # wall clock (time.time) when the commit returned: outputs visible
        threading.Thread(target=self._run, name="astec-txn-commit", daemon=True).start()

    def _run(self) -> None:
        try:
            self._commit()
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's thread
            self.error = exc
        self.t_done = time.time()
        self.done.set()

    def age(self) -> float:
        """Seconds since the commit started."""
        return time.monotonic() - self.t_start

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the commit to return; whether it did."""
        return self.done.wait(max(0.0, timeout))
