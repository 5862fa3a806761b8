"""The workers' librdkafka consumer against the real broker: a worker pauses its partitions
while it waits (for acknowledgements, for Redis); a partition that a rebalance takes away in
that wait and later gives back must be fetched again, or its page views wait forever."""

from __future__ import annotations

import time

import pytest

from stream.rdkafka_consumer import RdConsumer
from stream.topics import make_producer
from testkit.stream_run import wait_for

pytestmark = [pytest.mark.services, pytest.mark.timeout(150)]


def _until(cond, consumers, timeout, what):
    """wait_for, each member polling (its rebalance callbacks run inside poll)."""

    def polled() -> bool:
        for c in consumers:
            c.poll(timeout_ms=100)
        return bool(cond())

    wait_for(polled, timeout, what)


def test_a_partition_paused_revoked_and_assigned_back_is_fetched_again(stream_settings):
    s = stream_settings
    topic, n = s.topics.page_views, s.topics.partitions
    a = RdConsumer(s, [topic], s.consumer.group, client_id="pause-a")
    b = None
    try:
        _until(lambda: len(a.assignment()) == n, [a], 60, "the first member owning every partition")
        everything = a.assignment()
        a.pause(*everything)  # a worker's wait begins
        b = RdConsumer(s, [topic], s.consumer.group, client_id="pause-b")
        _until(lambda: b.assignment() and len(a.assignment()) < n, [a, b], 60, "the split")
        moved = everything - a.assignment()
        a.resume(*everything)  # the wait ends: what the member still owns is resumed
        b.close()  # leaves the group: its partitions come back to the first member
        b = None
        _until(lambda: a.assignment() == everything, [a], 60, "the partitions back")
        p = make_producer(s)
        for part in range(n):
            p.send(topic, value=b"view", partition=part)
        p.flush()
        p.close()
        fetched: set = set()
        deadline = time.monotonic() + 30
        while fetched != everything and time.monotonic() < deadline:
            fetched |= set(a.poll(timeout_ms=200))
        assert moved and moved <= fetched, f"{sorted(moved - fetched)} never fetched again"
        assert fetched == everything
    finally:
        for c in (a, b):
            if c is not None:
                c.close()
