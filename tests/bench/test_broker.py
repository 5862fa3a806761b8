"""`astec bench broker` against the real broker: the log is spread over the probe topic's
partitions as asked (the broker's end offsets are checked inside the probe), batches are
counted as filled, and every timed message comes back through the consumer."""

from __future__ import annotations

import pytest

from bench.broker import probe
from infra.services import read_info

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def test_probe_spreads_the_log_over_partitions_and_counts_batches(services):
    info = read_info(services.services_dir)
    if info is None:
        pytest.skip("services given by the environment: no broker PID to read CPU from")
    rows = probe(
        services.kafka.kafka_python_options(),
        info.kafka.pid,
        [0, 300],
        messages=20,
        rate=400.0,
        partitions=3,
        fill_batch=50,
        idle_messages=60,
        log=lambda *_: None,
    )
    assert [r["topic_messages"] for r in rows] == [0, 300]
    # partition 0 held the 20 timed messages of the first row, then was filled to 300 / 3
    assert [r["partition_messages"] for r in rows] == [0, 100]
    assert [r["partition_batches"] for r in rows] == [0, 20 + 2]  # 80 more in batches of 50
    for r in rows:  # (broker CPU is read in 10 ms clock ticks: too coarse to assert on here)
        assert r["messages"] == 20 and r["stalled_after_s"] is None
        assert 0 < r["produce_consume_ms_p50"] <= r["produce_consume_ms_p99"]
