"""`astec bench broker`: the broker's CPU per message as one partition grows.

A development broker may not cost the same per message on a long log as on a fresh one (Tansu's
memory storage does not: README), and on a small box the broker shares the cores with the
consumers, so its cost shows up as event latency. This probes the broker that `astec infra up`
started (its PID is in services.json): at each log size, messages are produced one by one at a
fixed rate while a consumer reads them, and the broker process's CPU time is read from /proc.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import click


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (psutil, as `astec bench stream` reads them)."""
    import psutil
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def probe(bootstrap: str, pid: int, sizes: list[int], messages: int, rate: float,
          log=click.echo) -> list[dict]:
    """One row per log size: broker CPU share and produce->consume latency at `rate` msgs/s,
    one message per produce request (so per message = per request)."""
    import numpy as np
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic
    topic = f"bench-broker-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    prod = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, acks="all")
    cons = KafkaConsumer(bootstrap_servers=bootstrap, fetch_max_wait_ms=5, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    cons.assign([tp])
    filler, total, rows = b"f" * 300, 0, []
    try:
        for size in sorted(sizes):
            while total < size:                       # grow the log (not timed)
                n = min(1000, size - total)
                for _ in range(n):
                    prod.send(topic, filler)
                prod.flush()
                total += n
            cons.seek(tp, total)
            log_size, lat, got = total, [], 0
            c0, t0 = _cpu_seconds(pid), time.monotonic()
            for i in range(messages):
                t = time.perf_counter()
                prod.send(topic, filler)
                prod.flush()
                while True:
                    recs = [r for rs in cons.poll(timeout_ms=50).values() for r in rs]
                    got += len(recs)
                    if got > i:
                        break
                lat.append(time.perf_counter() - t)
                ahead = (i + 1) / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            wall, cpu = time.monotonic() - t0, _cpu_seconds(pid) - c0
            total += messages
            row = {"log_messages": log_size, "messages": messages,
                   "achieved_rate": round(messages / wall, 1),
                   "broker_cpu_share": round(cpu / wall, 3),
                   "broker_cpu_us_per_message": round(cpu / messages * 1e6, 1),
                   "produce_consume_ms_p50": round(float(np.median(lat)) * 1e3, 2),
                   "produce_consume_ms_p99": round(float(np.percentile(lat, 99)) * 1e3, 2)}
            rows.append(row)
            log(f"log {log_size:>7} messages: broker {row['broker_cpu_share']:.1%} of a core at "
                f"{row['achieved_rate']:.0f} msgs/s, {row['broker_cpu_us_per_message']} us CPU "
                f"per message, produce->consume p50 {row['produce_consume_ms_p50']} ms")
    finally:
        prod.close(timeout=5)
        cons.close()
        try:
            admin.delete_topics([topic])
        except Exception:   # noqa: BLE001 - best effort; memory storage forgets it on restart
            pass
        admin.close()
    return rows


@click.command("broker")
@click.option("--services-dir", type=click.Path(file_okay=False), default=None,
              help="Where `astec infra up` recorded the services ($ASTEC_SERVICES_DIR, default "
                   ".astec/services); the broker must be one it started (its PID is read).")
@click.option("--sizes", default="0,10000,50000,100000", show_default=True,
              help="Comma-separated log sizes (messages already in the partition) to probe at.")
@click.option("--messages", default=1000, show_default=True, help="Timed messages per size.")
@click.option("--rate", default=300.0, show_default=True, help="Messages per second while timed.")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the JSON here.")
def bench_broker(services_dir, sizes, messages, rate, out):
    """Broker CPU per message and produce->consume latency as one partition grows."""
    from infra.services import read_info
    from infra.config import load_settings
    d = services_dir or load_settings().services_dir   # flag, else env / config / default
    info = read_info(d)
    if info is None:
        raise click.ClickException(f"{d}: no services.json; start the services with "
                                   f"`astec infra up --data-dir {d}`")
    import psutil
    try:
        _cpu_seconds(info.kafka.pid)
    except psutil.Error:
        raise click.ClickException(f"{d}: the broker (pid {info.kafka.pid}) is not running")
    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"not a list of integers: {sizes!r}", param_hint="--sizes")
    rows = probe(info.kafka_bootstrap, info.kafka.pid, size_list, messages, rate)
    text = json.dumps({"broker": info.kafka.binary, "rows": rows}, indent=1)
    click.echo(text)
    if out:
        Path(out).write_text(text + "\n")
