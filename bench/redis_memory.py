"""`astec bench redis`: Redis bytes per active user of the stream's user state, by design bounded.

Writes `--events` visits spread uniformly over `--users` users through the real StateStore
(stream.state_store: last K states + the per-user list of the last N event-id hashes, one Lua
script per event, batches of 256 as a worker sends them), then reads Redis' own accounting: the
growth of INFO used_memory, and MEMORY USAGE summed over every key the run wrote. The same events
are then written in the layout this project used before (one `seen:<event id>` key per event with
a 7-day TTL beside the same states list; its script is reproduced here verbatim, since the store
no longer has it), so both figures come from one run on one Redis.

States are shaped like the stream's (float16 z of --dim, --top-k query ids and scores) and event
ids are 36-character UUIDs; Redis does not compress list entries, so their content does not
matter, only their size. Redis: REDIS_URL / --redis-url (keys under a fresh prefix, deleted at the
end; other keys are left alone, though used_memory then also moves with other clients' writes),
otherwise a redis-server of its own started through infra.services in a temporary directory
(appendfsync everysec: the fsync policy changes the time a run takes, not its memory).
The documented figure is `astec bench redis --events 1000000 --users 10000`; the default run
keeps its 100 events per user at a fifth of the size.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np

from engine.cli_options import renamed_option
from personalization.state import UserState
from stream.redis_connect import is_cluster
from stream.state_store import DEDUP_N, StateStore, connect

BATCH = 256  # events per pipelined round trip (the workers' batch_max)

# stream/state_store.py's append script as it was before the per-user dedupe list (2026-11-27):
# KEYS: states, seen.  ARGV: state bytes, K, state ttl, dedup ttl, want history ("1"/"0").
_OLD_APPEND = """
local hist = {}
if ARGV[5] == '1' then hist = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1) end
local fresh = redis.call('SET', KEYS[2], '1', 'NX', 'EX', tonumber(ARGV[4]))
if fresh then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
if fresh then return {1, hist} end
return {0, hist}
"""


def _events(
    n: int, users: int, dim: int, top_k: int, seed: int
) -> Iterator[tuple[list[str], list[UserState]]]:
    """Batches of (user ids, states): users drawn uniformly, a UUID event id per visit."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal(dim).astype(np.float16)
    ids = rng.integers(0, 10**6, top_k)
    scores = np.sort(rng.random(top_k).astype(np.float32))[::-1]
    t0 = 1.7e9
    for start in range(0, n, BATCH):
        m = min(BATCH, n - start)
        raw = rng.bytes(16 * m)
        yield (
            [f"user-{u}" for u in rng.integers(0, users, m)],
            [
                UserState(
                    str(uuid.UUID(bytes=raw[16 * j : 16 * j + 16])),
                    t0 + start + j,
                    1,
                    2,
                    z,
                    ids,
                    scores,
                )
                for j in range(m)
            ],
        )


def _write_old(store: StateStore, user_ids: list[str], states: list[UserState]) -> None:
    """One batch in the old layout: states list + one seen key per event (old script)."""
    sha = store.__dict__.setdefault("_old_sha", store.client.script_load(_OLD_APPEND))
    pipe = store.client.pipeline(transaction=False)
    for uid, st in zip(user_ids, states, strict=True):
        seen = f"{store.states_key(uid).rsplit(':', 1)[0]}:seen:{st.event_id}"
        pipe.evalsha(
            sha,
            2,
            store.states_key(uid),
            seen,
            st.encode(),
            store.k,
            store.ttl_s,
            store.dedup_ttl_s,
            "0",
        )
    pipe.execute()


def _key_usage(client, prefix: str) -> dict:
    """Keys under `prefix`: count, MEMORY USAGE summed (exact: SAMPLES 0), keys without TTL,
    and the sum per key kind (the last `:` part, `seen` for the old per-event keys)."""
    n, total, no_ttl = 0, 0, 0
    by_kind: dict[str, list[int]] = {}
    batch: list[bytes] = []

    def flush() -> None:
        nonlocal n, total, no_ttl
        pipe = client.pipeline(transaction=False)
        for k in batch:
            pipe.memory_usage(k, samples=0)
            pipe.ttl(k)
        res = pipe.execute()
        for k, size, ttl in zip(batch, res[::2], res[1::2], strict=True):
            kind = "seen" if b":seen:" in k else k.rsplit(b":", 1)[1].decode()
            by_kind.setdefault(kind, [0, 0])
            by_kind[kind][0] += 1
            by_kind[kind][1] += size or 0
            n += 1
            total += size or 0
            no_ttl += ttl < 0
        batch.clear()

    for k in client.scan_iter(f"{prefix}:*", count=5000):
        batch.append(k)
        if len(batch) >= 5000:
            flush()
    if batch:
        flush()
    return {
        "keys": n,
        "memory_usage_bytes": total,
        "keys_without_ttl": no_ttl,
        "by_kind": {k: {"keys": c, "bytes": b} for k, (c, b) in sorted(by_kind.items())},
    }


def _used_memory(client) -> int:
    """used_memory of the server, or summed over a cluster's primaries."""
    if is_cluster(client):
        per_node = client.info("memory", target_nodes=client.PRIMARIES)
        return sum(int(v["used_memory"]) for v in per_node.values())
    return int(client.info("memory")["used_memory"])


def measure(
    client,
    layout: str,
    events: int,
    users: int,
    k: int,
    dedup_n: int,
    dim: int,
    top_k: int,
    wait_replicas: int = 0,
) -> dict:
    """Write the events in `layout` ("new" or "old") under a fresh prefix, measure, delete;
    wait_replicas > 0: each batch waits for that many replicas (WAIT), as the workers do."""
    prefix = f"astec-bench-{layout}-{uuid.uuid4().hex[:8]}"
    store = StateStore(client, prefix, k=k, dedup_n=dedup_n, wait_replicas=wait_replicas)
    store.append_batch(["warm-up"], [next(_events(1, 1, dim, top_k, 1))[1][0]])  # script load
    client.delete(store.states_key("warm-up"), store.eids_key("warm-up"))
    before = _used_memory(client)
    t0 = time.perf_counter()
    active: set[str] = set()
    for uids, states in _events(events, users, dim, top_k, seed=0):
        active.update(uids)
        if layout == "new":
            _, _, errors = store.append_batch_checked(uids, states)
            if any(errors):
                raise click.ClickException(
                    f"Redis refused an event: {next(e for e in errors if e)}"
                )
        else:
            _write_old(store, uids, states)
    seconds = time.perf_counter() - t0
    if not is_cluster(client):
        time.sleep(0.2)  # replicas' buffers settle before used_memory is read
    after = _used_memory(client)
    usage = _key_usage(client, prefix)
    for keys in _chunks(list(client.scan_iter(f"{prefix}:*", count=5000)), 5000):
        client.unlink(*keys)
    return {
        "layout": layout,
        "events": events,
        "active_users": len(active),
        "K": k,
        "N": dedup_n if layout == "new" else None,
        "seconds": round(seconds, 1),
        "events_per_s": round(events / seconds),
        "used_memory_growth_bytes": after - before,
        "bytes_per_user_used_memory": round((after - before) / len(active)),
        "bytes_per_user_memory_usage": round(usage["memory_usage_bytes"] / len(active)),
        **usage,
    }


def _chunks(xs: list, n: int) -> Iterator[list]:
    for i in range(0, len(xs), n):
        yield xs[i : i + n]


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    """The given Redis, or a redis-server of our own for the length of the run."""
    if url:
        yield url
        return
    import psutil

    from infra.services import start_redis

    with tempfile.TemporaryDirectory(prefix="astec-bench-redis-") as d:
        password = uuid.uuid4().hex
        proc = start_redis(Path(d), password)
        try:
            url = f"redis://:{password}@127.0.0.1:{proc.port}/0"
            # memory does not depend on the fsync policy; `always` (the services' default)
            # only makes the run slower
            connect(url).config_set("appendfsync", "everysec")
            yield url
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                p = psutil.Process(proc.pid)
                p.terminate()
                p.wait(30)


@contextlib.contextmanager
def _topology(kind: str) -> Iterator[str]:
    """A loopback Sentinel or Cluster of our own (infra.redis_topologies) for the run, every
    node at appendfsync everysec like the single one; yields its URL."""
    from infra.redis_topologies import start_cluster, start_sentinel, stop_topology_procs

    with tempfile.TemporaryDirectory(prefix=f"astec-bench-{kind}-") as d:
        password = uuid.uuid4().hex
        topo = (start_sentinel if kind == "sentinel" else start_cluster)(Path(d), password)
        try:
            for n in topo.nodes:
                node = connect(f"redis://:{password}@127.0.0.1:{n.port}/0")
                node.config_set("appendfsync", "everysec")
                node.close()
            yield topo.url
        finally:
            stop_topology_procs(topo)


def _print_table(rows: list[dict]) -> None:
    click.echo(
        f"{'layout':<16}{'events':>10}{'users':>8}{'keys':>10}{'used_memory':>14}"
        f"{'B/user (INFO)':>15}{'B/user (MEMORY USAGE)':>23}{'events/s':>10}"
    )
    for r in rows:
        click.echo(
            f"{r['layout']:<16}{r['events']:>10,}{r['active_users']:>8,}{r['keys']:>10,}"
            f"{r['used_memory_growth_bytes']:>14,}{r['bytes_per_user_used_memory']:>15,}"
            f"{r['bytes_per_user_memory_usage']:>23,}{r['events_per_s']:>10,}"
        )
    for r in rows:
        parts = ", ".join(
            f"{kind}: {v['keys']:,} keys, {v['bytes'] / max(1, v['keys']):,.0f} B each"
            for kind, v in r["by_kind"].items()
        )
        click.echo(f"  {r['layout']}: {parts}; keys without TTL: {r['keys_without_ttl']}")


@click.command("redis")
@click.option(
    "--events",
    type=click.IntRange(1),
    default=200_000,
    show_default=True,
    help="Visits written per layout (documented figure: 1000000).",
)
@click.option(
    "--users",
    type=click.IntRange(1),
    default=2_000,
    show_default=True,
    help="Users the visits are spread over (documented figure: 10000).",
)
@renamed_option(
    "--state-k",
    "--k",
    "k",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="States kept per user (state_k).",
)
@click.option(
    "--dedup-n",
    type=click.IntRange(1),
    default=DEDUP_N,
    show_default=True,
    help="Event ids remembered per user.",
)
@click.option(
    "--dim",
    type=click.IntRange(1),
    default=300,
    show_default=True,
    help="Dimension of the state vector z (float16).",
)
@click.option(
    "--top-k",
    type=click.IntRange(1),
    default=10,
    show_default=True,
    help="Predicted query ids kept per state.",
)
@click.option(
    "--layouts",
    type=click.Choice(["both", "new", "old"]),
    default="both",
    show_default=True,
    help="old: one seen key per event (before this layout).",
)
@click.option(
    "--redis-url",
    default=None,
    help="Redis to measure on ($REDIS_URL; default: start one of its own).",
)
@click.option(
    "--topologies",
    is_flag=True,
    help="Also write the new layout to a Sentinel primary and to a 3-primary Cluster (each "
    "batch waiting for a replica, on Cluster each written primary's, and not), each topology "
    "started of its own: memory and events/s beside the single endpoint's, in one run.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per layout.")
def bench_redis(events, users, k, dedup_n, dim, top_k, layouts, redis_url, topologies, as_json):
    """Redis bytes per active user of the stream's user state (INFO and MEMORY USAGE)."""
    url = redis_url or os.environ.get("REDIS_URL")
    rows = []
    with _redis(url) as u:
        client = connect(u)
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
        server = client.info("server")["redis_version"]
        for layout in ["new", "old"] if layouts == "both" else [layouts]:
            row = measure(client, layout, events, users, k, dedup_n, dim, top_k)
            row.update(redis_version=server, maxmemory_policy=policy, dim=dim, top_k=top_k)
            rows.append(row)
            if as_json:
                click.echo(json.dumps(row))
    for kind in ("sentinel", "cluster") if topologies else ():
        with _topology(kind) as u:
            for wait in (1, 0):  # on the same servers, one after the other
                row = measure(connect(u), "new", events, users, k, dedup_n, dim, top_k, wait)
                row["layout"] = f"{kind}{' WAIT 1' if wait else ''}"
                rows.append(row)
                if as_json:
                    click.echo(json.dumps(row))
    if not as_json:
        click.echo(
            f"Redis {server}, maxmemory-policy {policy}, K={k}, state z dim {dim}, "
            f"top-k {top_k}, N={dedup_n}"
        )
        _print_table(rows)
