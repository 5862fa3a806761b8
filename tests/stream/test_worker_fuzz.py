"""Fuzzing the worker's loop against the real broker and Redis: thousands of generated and
mutated page views (random JSON, unicode edge cases, lone surrogates, huge and empty fields,
hostile ids that try to forge another user's Redis key, duplicates). The worker stays up, and
every record is either answered or dead-lettered: the counts match exactly."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid

import pytest

from stream.model_handle import ModelHandle
from stream.policy_handle import Top1Policy
from stream.schemas import decode, encode
from stream.state_store import StateStore, connect
from stream.topics import make_consumer
from stream.worker import StreamWorker

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]

HOSTILE_IDS = [
    "u}:seen:x",
    "{user:victim}",
    "victim}:states",
    "a:b:c",
    "*",
    "?",
    "\\",
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
    "<script>",
    "null",
    "\\u0000",
    "caf\u00e9",
    "ﬁ",
    "\t\n",
]


def _valid(rng, i, titles, tag):
    return {
        "event_id": f"{tag}-{i}",
        "user_id": rng.choice(HOSTILE_IDS + [f"u{i % 30}"] * 8),
        "ts": time.time(),
        "url": f"https://example.org/{i}",
        "title": rng.choice(titles),
    }


def _mutate(rng, msg) -> bytes:
    """One of many ways a producer can get a page view wrong (or odd but valid)."""
    m = dict(msg)
    kind = rng.randrange(12)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))  # not UTF-8/JSON
    if kind == 1:
        return json.dumps(rng.choice([[], 1, "x", None, {"v": 1}])).encode()
    if kind == 2:
        m[rng.choice(list(m))] = rng.choice([*ODD_TEXT, None, 1, [], {}, True, 1e308])
    if kind == 3:
        m.pop(rng.choice(list(m)))
    if kind == 4:
        m["ts"] = rng.choice([0, -1, 1e20, float("inf"), "now", True])
    if kind == 5:  # lone surrogates as JSON escapes (valid JSON, no valid text)
        return json.dumps({"v": 1, **m}).replace('"title": "', '"title": "\\ud800', 1).encode()
    if kind == 6:
        m["title"] = rng.choice(ODD_TEXT)
    if kind == 7:
        m["user_id"] = rng.choice(HOSTILE_IDS)
        m["event_id"] = rng.choice(HOSTILE_IDS) + str(rng.random())
    if kind == 8:
        m["extra"] = "y" * rng.randrange(10, 20000)  # extra fields are allowed, size is not
    try:
        return encode("page_view", m)
    except (TypeError, ValueError):
        return json.dumps({"v": 1, **m}, default=str).encode()


def test_fuzzed_page_views_are_each_answered_or_dead_lettered(
    stream_settings, knn_predictor, stream_corpus, tmp_path
):
    s = stream_settings.replace(batch_max=64, state_k=8)
    rng = random.Random(1234)
    titles = stream_corpus[0]
    tag = uuid.uuid4().hex[:6]
    raws = []
    for i in range(2500):
        msg = _valid(rng, i, titles, tag)
        raw = encode("page_view", msg) if rng.random() < 0.4 else _mutate(rng, msg)
        raws.append(raw)
        if rng.random() < 0.05:
            raws.append(raw)  # duplicates
    from stream.rdkafka_producer import RdProducer

    p = RdProducer(s, "fuzz", 2)
    for i, raw in enumerate(raws):
        p.send(s.topics.page_views, raw, rng.choice([b"k", None, str(i).encode()]))
    p.flush(60)
    p.close()

    w = StreamWorker(
        s, ModelHandle.open(tmp_path, loader=lambda _p: knn_predictor), Top1Policy(), "w-fuzz"
    )
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and w.metrics.events + w.metrics.dead_letters < len(raws):
            assert t.is_alive(), "the worker died"
            time.sleep(0.2)
    finally:
        w.stop()
        t.join(30)
    assert not t.is_alive()
    answered = _read_all(s, s.topics.ad_queries, w.metrics.events - w.metrics.no_query)
    dead = _read_all(s, s.topics.dead_letters, w.metrics.dead_letters)
    assert w.metrics.events + w.metrics.dead_letters == len(raws)
    assert len(answered) + w.metrics.no_query == w.metrics.events
    assert len(dead) == w.metrics.dead_letters > 0
    reasons = [decode("dead_letter", r, 1 << 22)["reason"] for r in dead]
    assert any("lone surrogate" in r for r in reasons)
    assert all("failed:" not in r for r in reasons), [r for r in reasons if "failed:" in r][:3]

    # hostile ids never reached another user's key: each stored state belongs to its user
    store = StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, s.state.k)
    ads = [decode("ad_query", r, 1 << 22) for r in answered]
    by_user: dict = {}
    for a in ads:
        by_user.setdefault(a["user_id"], set()).add(a["event_id"])
    for uid, eids in by_user.items():
        stored = {st.event_id for st in store.history(uid)}
        assert stored <= eids, f"user {uid!r} holds another user's visits"


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
