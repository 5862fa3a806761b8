"""Fuzzing the click logger against the real broker and Redis: thousands of generated and mutated
ad queries and ad clicks (random bytes and JSON, unicode edge cases, lone surrogates, huge and
empty fields, absurd timestamps, hostile ids, exact and replayed duplicates). The logger stays up,
every message is counted once as logged, duplicate or dead-lettered, and the counts match the log
files, the dead-letter topic and what the schema functions say of each message exactly."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import uuid

import pytest

from engine.clicklog import ReadReport, ad_outcomes, encode_record, read_log
from stream.click_logger import _click, _impression, run_click_logger
from stream.schemas import decode, encode
from stream.state_store import DEDUP_N, connect, key_part
from stream.topics import make_consumer

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]

HOSTILE_IDS = [
    "u}:clicklog:ad_clicks",
    "{user:victim}",
    "victim}:eids",
    "a:b:c",
    "*",
    "%7D",
    "victim",
    "\u00e9\u0301",
    "\U0001f600",
    " ",
    "x" * 128,
]
ODD_TEXT = [
    "",
    " ",
    "\u0000",
    "\ud800",
    "a\udfffb",
    "\u202e\u200b",
    "\U0001f600" * 300,
    "x" * 5000,
    "null",
    "caf\u00e9",
    "\t\n",
]


def _query(rng, i, tag):
    q = f"query {i % 97}"
    return {
        "event_id": f"{tag}-{i}",
        "user_id": rng.choice(HOSTILE_IDS + [f"u{i % 30}"] * 8),
        "ts": time.time(),
        "event_ts": time.time() - 0.05,
        "query": q,
        "query_id": i % 97,
        "score": 0.5,
        "candidates": [q, "other"],
        "propensity": 0.9,
        "policy": "top1",
        "model_version": "v1",
        "url": f"https://example.org/{i}",
        "title": f"page {i}",
    }


def _click_msg(rng, i, tag, q):
    return {
        "event_id": f"{tag}-{i}",
        "user_id": q["user_id"],
        "query": q["query"],
        "clicked": rng.random() < 0.3,
        "ts": time.time() + 1,
    }


def _mutate(rng, kind, msg) -> bytes:
    """One of many ways a producer can get a message wrong (or odd but valid)."""
    m = dict(msg)
    k = rng.randrange(13)
    if k == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
    if k == 1:
        return json.dumps(rng.choice([[], 1, "x", None, {"v": 1}])).encode()
    if k == 2:
        m[rng.choice(list(m))] = rng.choice([*ODD_TEXT, None, 1, [], {}, True, 1e308, -1])
    if k == 3:
        m.pop(rng.choice(list(m)))
    if k == 4:
        m["ts"] = rng.choice([0, -1, 1e20, 1e13, "now", True])
    if k == 5:  # lone surrogates as JSON escapes (valid JSON, no valid text)
        field = "query" if rng.random() < 0.5 else "user_id"
        return (
            json.dumps({"v": 1, **m}).replace(f'"{field}": "', f'"{field}": "\\udc80', 1).encode()
        )
    if k == 6 and kind == "ad_query":
        m["url"] = rng.choice(["", " "])
    if k == 7:
        m["user_id"] = rng.choice(HOSTILE_IDS)
        m["event_id"] = rng.choice(HOSTILE_IDS) + str(rng.random())
    if k == 8:
        m["extra"] = "y" * rng.choice([10, 20000, 200_000])  # extra fields are allowed
    if k == 12:
        m["query"] = "q" * rng.choice([1025, 100_000])  # over the schema's cap
    if k == 9 and kind == "ad_query":
        m["candidates"] = rng.choice([["a"] * 1001, ["ok", "\ud800"], [1, 2], []])
    if k == 10 and kind == "ad_query":
        m["propensity"] = rng.choice([0.0, 1.5, -0.1, float("nan")])
    if k == 11 and kind == "ad_click":
        m["clicked"] = rng.choice(["yes", 1, None])
    try:
        return encode(kind, m)
    except (TypeError, ValueError):
        return json.dumps({"v": 1, **m}, default=str).encode()


def _expected(kind, raw):
    """(user id, event id) the logger should log for this message, or None (dead letter),
    by the public schema functions."""
    schema, convert = {
        "ad_impressions": ("ad_query", _impression),
        "ad_clicks": ("ad_click", _click),
    }[kind]
    try:
        rec = convert(decode(schema, raw, 1 << 20))
        encode_record(kind, rec)
    except Exception:  # noqa: BLE001 - any failure is a dead letter
        return None
    return rec["user_id"], rec["event_id"]


def test_fuzzed_ad_queries_and_clicks_are_each_logged_once_or_dead_lettered(
    stream_settings, tmp_path
):
    s = stream_settings
    rng = random.Random(4321)
    tag = uuid.uuid4().hex[:6]
    msgs: list[tuple[str, bytes]] = []  # (kind, raw)
    for i in range(1800):
        q = _query(rng, i, tag)
        raw = encode("ad_query", q) if rng.random() < 0.45 else _mutate(rng, "ad_query", q)
        msgs.append(("ad_impressions", raw))
        if rng.random() < 0.05:  # a worker's replay: same event, answered again later
            msgs.append(("ad_impressions", encode("ad_query", {**q, "ts": q["ts"] + 5})))
        if rng.random() < 0.6:
            c = _click_msg(rng, i, tag, q)
            msgs.append(
                (
                    "ad_clicks",
                    encode("ad_click", c) if rng.random() < 0.5 else _mutate(rng, "ad_click", c),
                )
            )
    dups = rng.sample(msgs, len(msgs) // 20)  # exact copies, delivered anywhere later
    for d in dups:
        msgs.insert(rng.randrange(len(msgs) // 2, len(msgs) + 1), d)

    from stream.rdkafka_producer import RdProducer

    p = RdProducer(s, "fuzz-clicks", 2)
    topic = {"ad_impressions": s.topics.ad_queries, "ad_clicks": s.topics.ad_clicks}
    for i, (kind, raw) in enumerate(msgs):
        p.send(topic[kind], raw, rng.choice([b"k", None, str(i).encode()]))
    p.flush(60)
    p.close()

    counts: dict = {}
    stop = threading.Event()
    log_dir = tmp_path / "log"
    t = threading.Thread(
        target=run_click_logger,
        args=(s, str(log_dir)),
        kwargs={"stop_event": stop, "counts": counts},
        daemon=True,
    )
    t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(counts.values()) < len(msgs):
            assert t.is_alive(), "the click logger died"
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert sum(counts.values()) == len(msgs), counts
    print(f"\nclick logger fuzz: {len(msgs)} messages -> {counts}")

    want = {"ad_impressions": set(), "ad_clicks": set()}
    n_dead = 0
    for kind, raw in msgs:
        key = _expected(kind, raw)
        if key is None:
            n_dead += 1
        else:
            want[kind].add(key)
    assert counts["dead_letters"] == n_dead > 300
    for kind in want:
        rep = ReadReport(kind)
        got = [(r["user_id"], r["event_id"]) for r in read_log(log_dir, kind, rep)]
        assert rep.corrupt == 0, rep.examples
        assert len(got) == len(set(got)) == counts[kind], f"{kind} logged twice"
        assert set(got) == want[kind]
    n_valid = sum(1 for k, raw in msgs if _expected(k, raw) is not None)
    assert counts["duplicates"] == n_valid - len(want["ad_impressions"]) - len(want["ad_clicks"])

    dead = _read_all(s, s.topics.dead_letters, n_dead)
    assert len(dead) == n_dead
    reasons = [decode("dead_letter", r, 1 << 22)["reason"] for r in dead]
    for expect in ("lone surrogate", "seconds since the epoch", "'url' is empty", "longer than"):
        assert any(expect in r for r in reasons), expect
    assert any(r.startswith("click log: field 'propensity'") for r in reasons)
    unexplained = [r for r in reasons if "failed:" in r]
    assert not unexplained, unexplained[:3]

    # training reads each impression once, clicks joined
    clicked = {r["event_id"] for r in read_log(log_dir, "ad_clicks") if r["clicked"]}
    outs = list(ad_outcomes(log_dir))
    assert len(outs) == len({e for _, e in want["ad_impressions"]})
    assert [o["clicked"] for o in outs] == [o["event_id"] in clicked for o in outs]
    assert 0 < sum(o["clicked"] for o in outs) < len(outs)

    # the dedupe keys: one list per user and kind, each capped at N, each expiring, and none
    # readable as another user's key
    r = connect(s.redis.url.reveal())
    users = {u for k in want for u, _ in want[k]}
    pattern = re.compile(
        re.escape(s.redis.key_prefix) + r":\{user:([^{}:]*)\}:clicklog:(ad_impressions|ad_clicks)$"
    )
    keys = [k.decode() for k in r.scan_iter(f"{s.redis.key_prefix}:*", count=1000)]
    assert keys
    encoded = {key_part(u) for u in users}
    for k in keys:
        m = pattern.match(k)
        assert m and m.group(1) in encoded, k
        assert r.llen(k) <= DEDUP_N and r.ttl(k) > 0


def test_click_logger_keeps_the_dedup_n_of_its_settings(stream_settings, tmp_path):
    """ASTEC_DEDUP_N sets the click logger's window as it sets the workers': with dedup_n = 4 a
    user's list holds the last 4 impression ids, not DEDUP_N."""
    s = stream_settings.replace(dedup_n=4)
    rng = random.Random(7)
    from stream.rdkafka_producer import RdProducer

    p = RdProducer(s, "dedup-n", 2)
    for i in range(10):
        p.send(s.topics.ad_queries, encode("ad_query", {**_query(rng, i, "dn"), "user_id": "d"}))
    p.flush(30)
    p.close()
    counts: dict = {}
    stop = threading.Event()
    t = threading.Thread(
        target=run_click_logger,
        args=(s, str(tmp_path / "log")),
        kwargs={"stop_event": stop, "counts": counts},
        daemon=True,
    )
    t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and counts.get("ad_impressions", 0) < 10:
            time.sleep(0.2)
    finally:
        stop.set()
        t.join(30)
    assert counts["ad_impressions"] == 10
    key = f"{s.redis.key_prefix}:{{user:d}}:clicklog:ad_impressions"
    assert connect(s.redis.url.reveal()).llen(key) == 4


def _read_all(s, topic, n, timeout=60.0):
    c = make_consumer(s, [topic], None)
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        for recs in c.poll(timeout_ms=200).values():
            out += [r.value for r in recs]
    extra_deadline = time.monotonic() + 1.0
    while time.monotonic() < extra_deadline:  # nothing beyond what was counted
        for recs in c.poll(timeout_ms=200).values():
            out += [r.value for r in recs]
    c.close()
    return out
