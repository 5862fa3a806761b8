"""The consumers' set in Redis does not grow with worker restarts: an id whose snapshot and
series have both expired is pruned, while live consumers keep the set (and their ids) alive."""

from __future__ import annotations

import time

import pytest

from stream.consumer_metrics import ConsumerMetrics, prune_consumers, publish, read_all
from stream.state_store import connect

pytestmark = pytest.mark.services


def test_ids_of_consumers_gone_are_pruned_live_ones_kept(redis_settings):
    s = redis_settings
    r = connect(s.redis.url.reveal())
    gone = ConsumerMetrics("w-restarted-before")
    live = ConsumerMetrics("w-live")
    publish(r, s.redis.key_prefix, gone, ttl_s=1, series_ttl_s=1)  # a worker that stopped
    publish(r, s.redis.key_prefix, live)
    ids_key = f"{s.redis.key_prefix}:metrics:consumers"
    assert r.smembers(ids_key) == {b"w-restarted-before", b"w-live"}
    time.sleep(1.5)  # the stopped worker's snapshot and series expire; the set lives on
    assert prune_consumers(r, s.redis.key_prefix) == ["w-restarted-before"]
    assert r.smembers(ids_key) == {b"w-live"}
    assert [m["consumer"] for m in read_all(r, s.redis.key_prefix)] == ["w-live"]
    # a publish prunes by itself (a worker's first, then every PRUNE_EVERY): an id left by a
    # worker whose keys expired long ago goes at the next worker's start
    r.sadd(ids_key, "w-long-gone")
    publish(r, s.redis.key_prefix, ConsumerMetrics("w-new"))
    assert r.smembers(ids_key) == {b"w-live", b"w-new"}
