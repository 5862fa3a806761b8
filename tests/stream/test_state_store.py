"""User-state records and the Redis store: compact round trip, capped last-K history with TTL,
idempotent appends (a replayed batch never appends twice) through a per-user dedupe list capped
at N with a TTL, OOM raised as RedisOutOfMemory, an evicting policy reported, schema validation
reasons."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from personalization.state import StateFormatError, UserState
from stream.schemas import SchemaError, decode, encode
from stream.state_store import (
    EventWindow,
    RedisOutOfMemory,
    StateStore,
    check_eviction_policy,
    connect,
    event_hash,
    user_key,
)


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
    store = StateStore(
        connect(s.redis.url.reveal()), s.redis.key_prefix, k=5, ttl_s=60, dedup_ttl_s=60
    )
    states = [state(i) for i in range(8)]
    fresh, _ = store.append_batch(["alice"] * 8, states)
    assert fresh == [True] * 8
    # a replay of part of the batch (crash before commit) changes nothing
    fresh, hist = store.append_batch(["alice"] * 3, states[5:], with_history=True)
    assert fresh == [False] * 3
    assert [h.event_id for h in hist[0]] == ["e3", "e4", "e6", "e7"]  # current (e5) excluded
    assert [h.event_id for h in store.history("alice")] == ["e3", "e4", "e5", "e6", "e7"]
    assert 0 < store.client.ttl(store.states_key("alice")) <= 60
    assert 0 < store.client.ttl(store.eids_key("alice")) <= 60
    assert store.client.llen(store.eids_key("alice")) == 8  # one 8-byte hash per event
    assert "{user:alice}" in store.states_key("alice") and "{user:alice}" in store.eids_key("alice")
    fresh, hist = store.append_batch(["bob", "bob"], [state(20), state(21)], with_history=True)
    assert fresh == [True, True] and hist[0] == [] and [h.event_id for h in hist[1]] == ["e20"]
    # Redis forgets scripts when it restarts (AOF keeps data, not scripts): the store reloads
    store.client.script_flush()
    fresh, _ = store.append_batch(["bob", "bob"], [state(21), state(22)])
    assert fresh == [False, True]
    assert [h.event_id for h in store.history("bob")] == ["e20", "e21", "e22"]


@pytest.mark.services
def test_the_chosen_query_is_written_into_the_events_stored_state(stream_settings):
    """mark_shown rewrites the stored record of each event's visit with the query chosen for
    it (what the policy reads at the user's later visits); a replayed event is marked again
    with the replay's choice; a visit no longer stored is reported, not created."""
    s = stream_settings
    store = StateStore(
        connect(s.redis.url.reveal()), s.redis.key_prefix, k=3, ttl_s=60, dedup_ttl_s=60
    )
    states = [state(100 + i) for i in range(4)]
    store.append_batch(["carol"] * 4, states)  # e100 is trimmed (k=3)
    assert store.mark_shown(["carol"] * 3, states[1:], [7, -1, 42]) == [True, True, True]
    assert [h.shown for h in store.history("carol")] == [7, -1, 42]
    assert store.mark_shown(["carol"], [states[1]], [8]) == [True]  # a replay's new choice
    assert store.mark_shown(["carol", "dave"], [states[0], states[2]], [5, 5]) == [False, False]
    hist = store.history("carol")
    assert [h.shown for h in hist] == [8, -1, 42]
    assert [h.event_id for h in hist] == ["e101", "e102", "e103"]
    assert np.array_equal(hist[2].query_ids, states[3].query_ids)
    _, h = store.append_batch(["carol"], [state(104)], with_history=True)
    assert [x.shown for x in h[0]] == [8, -1, 42]  # what the next visit's policy reads


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
    store = StateStore(
        connect(s.redis.url.reveal()), s.redis.key_prefix, k=5, ttl_s=60, dedup_ttl_s=60
    )
    forged = ["v}:seen:e1", "v}:states", "{user:v}", "v:", "%76"]  # %76 is "v" percent-encoded
    keys = {store.states_key(u) for u in ["v", *forged]} | {
        store.eids_key(u) for u in ["v", *forged]
    }
    assert len(keys) == 2 * (len(forged) + 1)
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


@pytest.mark.services
def test_dedupe_list_is_capped_at_n_and_replays_inside_it_append_nothing(stream_settings):
    """Memory per user does not grow with the user's events: N hashes, K states, both with a
    TTL. A replay of the user's last N events is refused; older ids are forgotten by design."""
    s = stream_settings
    store = StateStore(
        connect(s.redis.url.reveal()), s.redis.key_prefix, k=4, ttl_s=60, dedup_ttl_s=30
    )
    store.dedup_n = 10
    states = [state(i) for i in range(25)]
    fresh, _ = store.append_batch(["carol"] * 25, states)
    assert fresh == [True] * 25
    r = store.client
    assert r.llen(store.eids_key("carol")) == 10 and r.llen(store.states_key("carol")) == 4
    assert r.lrange(store.eids_key("carol"), 0, -1) == [
        event_hash(f"e{i}") for i in range(24, 14, -1)
    ]
    assert 0 < r.ttl(store.eids_key("carol")) <= 30 and 0 < r.ttl(store.states_key("carol")) <= 60
    fresh, _ = store.append_batch(["carol"] * 10, states[15:])  # the last N replayed
    assert fresh == [False] * 10
    assert [h.event_id for h in store.history("carol")] == ["e21", "e22", "e23", "e24"]
    # the same event id for another user is that user's event
    assert store.append_batch(["dave"], [state(24)])[0] == [True]
    # no per-event key is left behind
    assert sorted(r.scan_iter(f"{s.redis.key_prefix}:*")) == sorted(
        k.encode()
        for k in [store.states_key(u) for u in ("carol", "dave")]
        + [store.eids_key(u) for u in ("carol", "dave")]
    )


@pytest.mark.services
def test_event_window_seen_then_remember(stream_settings):
    s = stream_settings
    w = EventWindow(connect(s.redis.url.reveal()), n=3, ttl_s=60)
    keys = [user_key(s.redis.key_prefix, u, "clicklog:test") for u in ("a", "a", "b}:x")]
    assert w.seen(keys, ["e1", "e2", "e1"]) == [False, False, False]
    assert w.remember(keys, ["e1", "e2", "e1"]) == [True, True, True]
    assert w.remember(keys[:1], ["e1"]) == [False]
    assert w.seen(keys, ["e1", "e2", "e2"]) == [True, True, False]
    w.remember(keys[:1] * 3, ["e3", "e4", "e5"])  # pushes e1, e2 out of a's window of 3
    assert w.seen(keys[:1] * 3, ["e1", "e2", "e5"]) == [False, False, True]
    assert 0 < w.client.ttl(keys[0]) <= 60


@pytest.mark.services
def test_out_of_memory_raises_and_evicting_policy_is_reported(stream_settings, caplog):
    """noeviction + maxmemory reached: the append raises RedisOutOfMemory (the worker retries
    it like an outage) instead of dropping the dedupe; an evicting policy is logged as an error."""
    s = stream_settings
    r = connect(s.redis.url.reveal())
    store = StateStore(r, s.redis.key_prefix, k=4, ttl_s=60, dedup_ttl_s=60)
    store.append_batch(["erin"], [state(1)])  # script loaded while memory is free
    old = r.config_get("maxmemory")["maxmemory"], r.config_get("maxmemory-policy")
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        with pytest.raises(RedisOutOfMemory, match="out of memory"):
            store.append_batch(["erin"], [state(2)])
        with pytest.raises(RedisOutOfMemory):
            EventWindow(r).remember([store.eids_key("erin")], ["x"])
        r.config_set("maxmemory", old[0])
        assert [h.event_id for h in store.history("erin")] == ["e1"]
        r.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.ERROR, logger="stream.state_store"):
            assert check_eviction_policy(r) == "allkeys-lru"
        assert "noeviction" in caplog.text
    finally:
        r.config_set("maxmemory", old[0])
        r.config_set("maxmemory-policy", old[1]["maxmemory-policy"])
    assert check_eviction_policy(r) == "noeviction"


@pytest.mark.services
def test_memory_bench_accounts_every_key_and_dedupe_does_not_grow_with_events(stream_settings):
    """`astec bench redis` at a tiny scale: every key the run wrote is counted and expires,
    and doubling the events per user leaves the per-user dedupe list's size where N caps it,
    while the old layout's per-event keys double with them."""
    from bench.redis_memory import measure

    r = connect(stream_settings.redis.url.reveal())
    rows = {
        (layout, n): measure(r, layout, n, 20, k=4, dedup_n=8, dim=16, top_k=3)
        for layout in ("new", "old")
        for n in (600, 1200)
    }
    for (layout, n), row in rows.items():
        assert row["active_users"] == 20 and row["keys_without_ttl"] == 0
        assert row["by_kind"]["states"]["keys"] == 20
        if layout == "new":
            assert row["keys"] == 40 and row["by_kind"]["eids"]["keys"] == 20
        else:
            assert row["keys"] == 20 + n and row["by_kind"]["seen"]["keys"] == n
    new_small, new_big = rows["new", 600]["by_kind"]["eids"], rows["new", 1200]["by_kind"]["eids"]
    assert new_small["bytes"] == new_big["bytes"]  # N = 8 hashes per user either way
    old_small, old_big = rows["old", 600]["by_kind"]["seen"], rows["old", 1200]["by_kind"]["seen"]
    assert old_big["bytes"] >= 1.9 * old_small["bytes"]
    assert not list(r.scan_iter("astec-bench-*"))  # the bench deletes what it wrote
