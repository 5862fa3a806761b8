"""User-state records and the Redis store: compact round trip, capped last-K history with TTL,
idempotent appends (a replayed batch never appends twice), schema validation reasons."""

from __future__ import annotations

import numpy as np
import pytest

from personalization.state import StateFormatError, UserState
from stream.schemas import SchemaError, decode, encode
from stream.state_store import StateStore, connect


def state(i: int, D: int = 8, k: int = 4) -> UserState:
    rng = np.random.default_rng(i)
    return UserState.from_visit(
        f"e{i}",
        1.7e9 + i,
        f"https://x/{i}",
        f"title {i}",
        rng.normal(size=D),
        rng.integers(0, 10**6, k),
        rng.random(k),
    )


def test_user_state_binary_round_trip_is_compact():
    s = state(1, D=300, k=10)
    raw = s.encode()
    assert len(raw) < 300 * 2 + 10 * 8 + 64  # float16 z, int32 ids, float32 scores
    back = UserState.decode(raw)
    assert back.event_id == "e1" and back.ts == s.ts and back.url_hash == s.url_hash
    assert np.array_equal(back.z, s.z) and back.z.dtype == np.float16
    assert np.array_equal(back.query_ids, s.query_ids) and back.query_ids.dtype == np.int64
    assert np.array_equal(back.scores, s.scores)
    assert UserState.from_json(back.to_json()).event_id == "e1"
    with pytest.raises(StateFormatError, match="header says"):
        UserState.decode(raw[:-1])


@pytest.mark.services
def test_store_appends_once_per_event_keeps_last_k(stream_settings):
    s = stream_settings
    store = StateStore(connect(s.redis_url), s.redis_key_prefix, k=5, ttl_s=60, dedup_ttl_s=60)
    states = [state(i) for i in range(8)]
    fresh, _ = store.append_batch(["alice"] * 8, states)
    assert fresh == [True] * 8
    # a replay of part of the batch (crash before commit) changes nothing
    fresh, hist = store.append_batch(["alice"] * 3, states[5:], with_history=True)
    assert fresh == [False] * 3
    assert [h.event_id for h in hist[0]] == ["e3", "e4", "e6", "e7"]  # current (e5) excluded
    assert [h.event_id for h in store.history("alice")] == ["e3", "e4", "e5", "e6", "e7"]
    assert 0 < store.client.ttl(store.states_key("alice")) <= 60
    assert store.client.ttl(store.seen_key("alice", "e0")) > 0
    assert "{user:alice}" in store.states_key("alice") and "{user:alice}" in store.seen_key(
        "alice", "e"
    )
    fresh, hist = store.append_batch(["bob", "bob"], [state(20), state(21)], with_history=True)
    assert fresh == [True, True] and hist[0] == [] and [h.event_id for h in hist[1]] == ["e20"]
    # Redis forgets scripts when it restarts (AOF keeps data, not scripts): the store reloads
    store.client.script_flush()
    fresh, _ = store.append_batch(["bob", "bob"], [state(21), state(22)])
    assert fresh == [False, True]
    assert [h.event_id for h in store.history("bob")] == ["e20", "e21", "e22"]


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"\x80abc", "not UTF-8"),
        (b"[1, 2]", "expected a JSON object"),
        (
            b'{"v": 1, "event_id": "e", "user_id": "u", "ts": 1.7e9, "url": "x", "title": "  "}',
            "field 'title' is empty",
        ),
        (
            b'{"v": 1, "event_id": "e", "user_id": "u", "ts": "now", "url": "x", "title": "t"}',
            "field 'ts' must be a finite number",
        ),
        (
            b'{"event_id": "e", "user_id": "u", "ts": 1.7e9, "url": "x", "title": "t"}',
            "unsupported schema version None",
        ),
        (b"x" * 5000, "oversized message: 5000 bytes"),
    ],
)
def test_page_view_validation_reasons(raw, reason):
    with pytest.raises(SchemaError, match=reason):
        decode("page_view", raw, 4096)


def test_schema_round_trip_and_unknown_fields_allowed():
    msg = {
        "event_id": "e",
        "user_id": "u",
        "ts": 1.7e9,
        "url": "https://x",
        "title": "t",
        "referrer": "new-field",
    }
    assert decode("page_view", encode("page_view", msg), 4096)["referrer"] == "new-field"


@pytest.mark.services
def test_hostile_ids_cannot_forge_another_users_keys(stream_settings):
    """An id holding `}` or `:` used to close the hash tag: user "v}:seen:e1" owned the key of
    user "v"'s dedupe entry for e1, and a WRONGTYPE error stopped the worker's partition."""
    s = stream_settings
    store = StateStore(connect(s.redis_url), s.redis_key_prefix, k=5, ttl_s=60, dedup_ttl_s=60)
    forged = ["v}:seen:e1", "v}:states", "{user:v}", "v:", "%76"]  # %76 is "v" percent-encoded
    keys = {store.states_key(u) for u in ["v", *forged]} | {store.seen_key("v", "e1")}
    assert len(keys) == len(forged) + 2
    fresh, _, errors = store.append_batch_checked(["v", *forged], [state(1)] * (1 + len(forged)))
    assert errors == [None] * (1 + len(forged)) and all(fresh)
    assert [st.event_id for st in store.history("v")] == ["e1"]
    for u in forged:
        assert [st.event_id for st in store.history(u)] == ["e1"]


def test_schema_refuses_lone_surrogates_empty_urls_and_absurd_timestamps():
    ok = {"event_id": "e", "user_id": "u", "ts": 1.7e9, "url": "https://x", "title": "t"}
    decode("page_view", encode("page_view", ok), 4096)
    raw = encode("page_view", ok).replace(b'"title":"t"', b'"title":"t\\ud800"')
    with pytest.raises(SchemaError, match="'title' holds a lone surrogate"):
        decode("page_view", raw, 4096)
    with pytest.raises(SchemaError, match="'url' is empty"):
        decode("page_view", encode("page_view", {**ok, "url": ""}), 4096)
    with pytest.raises(SchemaError, match="'ts' must be seconds since the epoch"):
        decode("page_view", encode("page_view", {**ok, "ts": 1e20}), 4096)
