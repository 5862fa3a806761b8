"""`astec bench broker`: what the broker's CPU per message grows with.

A broker may not cost the same per message on a long log as on a fresh one (the memory-only
development broker this project used before Apache Kafka did not), and on a small box the broker
shares the cores with the consumers, so its cost shows up as event latency. This probes the broker
that `astec infra up` started (its PID is in services.json): at each log size, messages are
produced one by one at a fixed rate to partition 0 of a fresh probe topic while a consumer reads
them, and the broker process's CPU time is read with psutil.

The options separate what the cost could grow with: `--fill-batch` (messages per produce
request while growing the log: messages vs stored batches), `--partitions` (the log is spread
over N partitions and only partition 0 is probed: the partition vs the topic) and
`--idle-messages` (a second topic filled first and never read: the whole broker).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path

import click

FILLER = b"f" * 300


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (psutil, as `astec bench stream` reads them)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _fill_producer(opts: dict, fill_batch: int):
    """A producer whose flushed batches hold exactly `fill_batch` messages: batch_size=1 makes
    every message its own batch; otherwise a long linger holds them until the flush."""
    from kafka import KafkaProducer

    if fill_batch == 1:
        return KafkaProducer(**opts, acks="all", linger_ms=0, batch_size=1)
    size = fill_batch * (len(FILLER) + 100)
    return KafkaProducer(
        **opts,
        acks="all",
        linger_ms=60_000,
        delivery_timeout_ms=300_000,
        batch_size=size,
        max_request_size=max(1048576, 2 * size),
    )


def fill(producer, topic: str, counts: dict[int, int], fill_batch: int) -> int:
    """Append counts[p] messages to each partition p, `fill_batch` per stored batch (not timed).
    Returns the number of batches written."""
    batches = 0
    for part, n in counts.items():
        done = 0
        while done < n:
            k = min(fill_batch, n - done) if fill_batch > 1 else min(1000, n - done)
            for _ in range(k):
                producer.send(topic, FILLER, partition=part)
            producer.flush()
            done += k
            batches += 1 if fill_batch > 1 else k
    return batches


def probe(
    opts: dict,
    pid: int,
    sizes: list[int],
    messages: int,
    rate: float,
    partitions: int = 1,
    fill_batch: int = 1,
    idle_messages: int = 0,
    stall_s: float = 30.0,
    log=click.echo,
) -> list[dict]:
    """One row per topic size: broker CPU per message and produce->consume latency at `rate`
    msgs/s, one message per produce request (so per message = per request), on partition 0.
    `opts` are kafka-python's connection and security options (Settings.kafka.kafka_python_options).

    `sizes` count messages in the whole probe topic, spread evenly over its `partitions`."""
    import numpy as np
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import KafkaAdminClient, NewTopic

    tag = uuid.uuid4().hex[:8]
    topic, idle_topic = f"bench-broker-{tag}", f"bench-broker-idle-{tag}"
    admin = KafkaAdminClient(**opts)
    admin.create_topics(
        [NewTopic(topic, partitions, 1)] + ([NewTopic(idle_topic, 1, 1)] if idle_messages else [])
    )
    filler = _fill_producer(opts, fill_batch)
    prod = KafkaProducer(**opts, linger_ms=0, acks="all")
    cons = KafkaConsumer(**opts, fetch_max_wait_ms=5, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    cons.assign([tp])
    in_part = [0] * partitions  # messages in each partition of the probe topic
    batches0 = 0  # stored batches in partition 0
    rows = []
    try:
        if idle_messages:
            log(f"filling idle topic with {idle_messages} messages ({fill_batch} per batch)")
            fill(filler, idle_topic, {0: idle_messages}, fill_batch)
        for size in sorted(sizes):
            target = [size // partitions + (p < size % partitions) for p in range(partitions)]
            add = {p: target[p] - in_part[p] for p in range(partitions) if target[p] > in_part[p]}
            f0, ft0 = _cpu_seconds(pid), time.monotonic()
            for p, n in add.items():  # grow the log (timed apart: produce only, no fetches)
                b = fill(filler, topic, {p: n}, fill_batch)
                in_part[p] += n
                batches0 += b if p == 0 else 0
            added, fill_wall = sum(add.values()), time.monotonic() - ft0
            fill_cpu = _cpu_seconds(pid) - f0
            cons.seek(tp, in_part[0])
            row0 = {
                "topic_messages": sum(in_part),
                "partition_messages": in_part[0],
                "partition_batches": batches0,
                "fill_messages": added,
                "fill_s": round(fill_wall, 2),
                "fill_broker_cpu_us_per_message": round(fill_cpu / added * 1e6, 1)
                if added
                else None,
            }
            lat, got, stalled, offsets = [], 0, False, []
            c0, t0 = _cpu_seconds(pid), time.monotonic()
            for i in range(messages):
                t = time.perf_counter()
                prod.send(topic, FILLER, partition=0)
                prod.flush()
                while got <= i and time.perf_counter() - t < stall_s:
                    recs = [r for rs in cons.poll(timeout_ms=50).values() for r in rs]
                    offsets += [r.offset for r in recs]
                    got += len(recs)
                lat.append(time.perf_counter() - t)
                if got <= i:  # the broker did not deliver it: report, stop growing
                    stalled = True
                    break
                ahead = (i + 1) / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
            wall, cpu = time.monotonic() - t0, _cpu_seconds(pid) - c0
            sent = len(lat)
            # the timed messages must sit right after the fill: proves partition 0 holds exactly
            # the messages counted
            want = list(range(in_part[0], in_part[0] + got))
            if offsets != want:
                raise RuntimeError(
                    f"{topic}/0: timed messages read at offsets {offsets[:3]}..., "
                    f"expected {want[:3]}...: the fill is not what was counted"
                )
            in_part[0] += sent
            batches0 += sent
            row = {
                **row0,
                "partitions": partitions,
                "fill_batch": fill_batch,
                "idle_topic_messages": idle_messages,
                "messages": sent,
                "stalled_after_s": round(lat[-1], 1) if stalled else None,
                "achieved_rate": round(sent / wall, 1),
                "broker_cpu_share": round(cpu / wall, 3),
                "broker_cpu_us_per_message": round(cpu / sent * 1e6, 1),
                "produce_consume_ms_p50": round(float(np.median(lat)) * 1e3, 2),
                "produce_consume_ms_p99": round(float(np.percentile(lat, 99)) * 1e3, 2),
            }
            rows.append(row)
            log(
                f"topic {row['topic_messages']:>7} msgs, partition 0: "
                f"{row['partition_messages']:>7} msgs in {row['partition_batches']:>7} batches: "
                f"broker {row['broker_cpu_share']:.1%} of a core at {row['achieved_rate']:.0f}/s, "
                f"{row['broker_cpu_us_per_message']} us CPU per message, produce->consume p50 "
                f"{row['produce_consume_ms_p50']} ms"
                + (f"; a message was not delivered in {stall_s:.0f}s: stopping" if stalled else "")
            )
            if stalled:
                break
    finally:
        prod.close(timeout=5)
        filler.close(timeout=5)
        cons.close()
        # best effort: a leftover probe topic is harmless
        with contextlib.suppress(Exception):
            admin.delete_topics([topic] + ([idle_topic] if idle_messages else []))
        admin.close()
    return rows


@click.command("broker")
@click.option(
    "--services-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where `astec infra up` recorded the services ($ASTEC_SERVICES_DIR, default "
    ".astec/services); the broker must be one it started (its PID is read).",
)
@click.option(
    "--sizes",
    default="0,2000,5000,10000",
    show_default=True,
    help="Comma-separated sizes of the probe topic (messages already in it, spread "
    "evenly over its partitions) to probe at.",
)
@click.option("--messages", default=1000, show_default=True, help="Timed messages per size.")
@click.option("--rate", default=300.0, show_default=True, help="Messages per second while timed.")
@click.option(
    "--partitions",
    default=1,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="Partitions of the probe topic; the log is spread over all of them and only "
    "partition 0 is probed (does the cost follow the partition or the topic?).",
)
@click.option(
    "--fill-batch",
    default=1,
    show_default=True,
    type=click.IntRange(1, 100000),
    help="Messages per produce request (stored batch) while growing the log (does the "
    "cost follow messages or batches?).",
)
@click.option(
    "--idle-messages",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="First fill a second, never-read topic with this many messages (does the cost "
    "follow everything the broker holds?).",
)
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Write the JSON here.")
def bench_broker(services_dir, sizes, messages, rate, partitions, fill_batch, idle_messages, out):
    """Broker CPU per message and produce->consume latency as a partition / topic / broker grows."""
    from infra.services import read_info
    from stream.settings import load_settings

    d = services_dir or load_settings().services_dir  # flag, else env / config / default
    info = read_info(d)
    if info is None:
        raise click.ClickException(
            f"{d}: no services.json; start the services with `astec infra up --data-dir {d}`"
        )
    import psutil

    try:
        _cpu_seconds(info.kafka.pid)
    except psutil.Error:
        raise click.ClickException(
            f"{d}: the broker (pid {info.kafka.pid}) is not running"
        ) from None
    try:
        size_list = [int(x) for x in sizes.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(
            f"not a list of integers: {sizes!r}", param_hint="--sizes"
        ) from None
    opts = load_settings(services_dir=d).kafka.kafka_python_options()
    rows = probe(
        opts, info.kafka.pid, size_list, messages, rate, partitions, fill_batch, idle_messages
    )
    text = json.dumps(
        {
            "broker": "Apache Kafka (KRaft, SASL/PLAIN on loopback)",
            "jvm": info.kafka.binary,
            "rows": rows,
        },
        indent=1,
    )
    click.echo(text)
    if out:
        Path(out).write_text(text + "\n")
