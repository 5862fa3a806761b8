"""Users' last K visit states in Redis, appended idempotently by event id.

Keys (hash-tagged, so Redis Cluster keeps one user's keys in one slot):
    <prefix>:{user:<id>}:states   list of encoded UserState, newest first, capped at K, TTL ttl_s
    <prefix>:{user:<id>}:eids     list of the user's last N event-id hashes (8 bytes each,
                                  blake2b), newest first, capped at N, TTL dedup_ttl_s
User ids are percent-encoded in keys (`key_part`): an id holding `}`, `:` or `{` cannot close the
hash tag or forge another user's key (plain ids stay readable as they are).

Memory is bounded by design: per active user at most K states and N 8-byte hashes, whatever the
event rate, and every key expires (`astec bench redis` measures it; docs/operations.md). A replay
(at-least-once delivery after a crash) repeats only a user's most recent events, which are within
the last N as long as fewer than N of that user's events were uncommitted at the crash; the
default N = 128 is far above what one user produces in a replay window (a few batches plus one
commit interval). Redis must run with `maxmemory-policy noeviction`: an evicted dedupe list would
let a replay append twice, silently; under noeviction a full Redis refuses writes with OOM, which
is raised as RedisOutOfMemory and retried like an outage (the first use of a store logs an error
if the server's policy evicts).

One Lua script per event checks the hash against the list, and only when it is new appends the
state and the hash, trimming both, so a replay never appends the same visit twice. A batch is one
pipelined round trip of EVALSHA (the script is loaded once, and again if Redis forgot it). The
client (one endpoint, Sentinel or Cluster by the URL: stream.redis_connect) retries connection
errors a few times; a reply that is Redis' state rather than the command's (READONLY after a
failover, CLUSTERDOWN, LOADING, ...: `infra_error`) raises RedisUnavailable for the whole batch,
which the worker retries while holding its partitions (stream.worker_health). Where the primary
has replicas, the batch's pipeline ends with WAIT, and a batch no replica acknowledged is not
counted as stored (its offsets stay uncommitted), so a failover loses no committed visit. On
Redis Cluster the batch is one pipeline per primary it touches, each ending with its own WAIT.
Once the policy has chosen, `mark_shown` writes the chosen query into each event's stored state
(UserState.shown, one more pipelined round trip), so a user's later visits read what was shown.
`EventWindow` is the same dedupe list on its own, for consumers that write elsewhere (the click
logger).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

import redis

from personalization.state import SHOWN_OFFSET, UserState
from stream.redis_connect import is_cluster, parse_redis_url, redis_client

log = logging.getLogger(__name__)

REPLICAS_REREAD_S = 10.0  # how often a cluster primary is asked again whether it has a replica
DEDUP_N = 128  # event ids remembered per user (the replay window; see the module docstring)

# KEYS: states, eids.  ARGV: state bytes, K, state ttl, dedup ttl, want history ("1"/"0"),
# event-id hash, N.  Returns {1 if appended else 0, [history newest first, before this append]}.
_APPEND = """
local hist = {}
if ARGV[5] == '1' then hist = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1) end
local fresh = not redis.call('LPOS', KEYS[2], ARGV[6])
if fresh then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
  redis.call('LPUSH', KEYS[2], ARGV[6])
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[7]) - 1)
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
if fresh then return {1, hist} end
return {0, hist}
"""

# KEYS: states.  ARGV: a state's bytes with its `shown` field set, that field's byte offset.
# Rewrites the stored record of the same visit (every byte but the 4 of `shown` equal): what
# the policy chose for it, read back at the user's later visits.  Returns 1 if one was found.
_MARK_SHOWN = """
local new = ARGV[1]
local o = tonumber(ARGV[2])
local head, tail = string.sub(new, 1, o), string.sub(new, o + 5)
local list = redis.call('LRANGE', KEYS[1], 0, -1)
for i, e in ipairs(list) do
  if #e == #new and string.sub(e, 1, o) == head and string.sub(e, o + 5) == tail then
    redis.call('LSET', KEYS[1], i - 1, new)
    return 1
  end
end
return 0
"""

# KEYS: eids.  ARGV: event-id hash, N, ttl.  Returns 1 if the hash was new (now remembered).
_REMEMBER = """
local fresh = not redis.call('LPOS', KEYS[1], ARGV[1])
if fresh then
  redis.call('LPUSH', KEYS[1], ARGV[1])
  redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
if fresh then return 1 end
return 0
"""


class RedisUnavailable(redis.ConnectionError):
    """Redis refused a command for a reason of its own, not the event's (a replica answering
    READONLY after a failover, a cluster slot moving or down, a node loading its data, an ACL
    refusal): the caller retries after a reconnect, never dead-letters the event."""


class RedisOutOfMemory(RedisUnavailable):
    """Redis refused a write with OOM (maxmemory reached): retried like an outage, never
    skipped, so idempotence is never silently given up."""


# error replies that say where Redis is (or is not), not what the command was: the first word of
# the reply; redis-py parses most of them into the classes below
INFRA_REPLIES = (
    *("READONLY", "MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "MASTERDOWN"),
    *("NOPERM", "NOREPLICAS", "UNBLOCKED"),
)
_INFRA_CLASSES = (
    redis.exceptions.ReadOnlyError,
    redis.exceptions.AskError,  # MovedError is one
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # MasterDownError is one
    redis.exceptions.BusyLoadingError,
    redis.exceptions.NoPermissionError,
    redis.ConnectionError,
    redis.TimeoutError,
)


def infra_error(exc: BaseException) -> bool:
    """Whether a per-command error is Redis' own state (retry) rather than the command's."""
    if isinstance(exc, _INFRA_CLASSES):
        return True
    words = str(exc).split(None, 2)
    if words and words[0] == "ERR" and len(words) > 1:
        words = words[1:]
    return bool(words) and words[0].rstrip(":") in INFRA_REPLIES


def key_part(value: str) -> str:
    """An id as it appears inside a key: percent-encoded, so it cannot contain the separators
    (`:`) or the hash-tag braces; surrogates are escaped rather than failing the encode."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def user_key(prefix: str, user_id: str, name: str) -> str:
    """`<prefix>:{user:<encoded id>}:<name>`: one user's key, in the user's hash slot."""
    return f"{prefix}:{{user:{key_part(user_id)}}}:{name}"


def event_hash(event_id: str) -> bytes:
    """8 bytes standing for an event id in a dedupe list: fixed size whatever the id's length
    (a false "seen" needs a 64-bit collision among one user's last N ids)."""
    return hashlib.blake2b(event_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def connect(url: str, retries: int = 3) -> Any:
    """A client for the URL's topology (stream.redis_connect: redis://, redis+sentinel://,
    redis+cluster://) that reconnects with exponential backoff (50 ms doubling, capped at 2 s).
    A few retries only: a longer outage is the caller's to wait out (the worker keeps polling
    Kafka meanwhile, which a client retrying inside one call for seconds would not)."""
    return redis_client(url, retries)


def redis_address(url: str) -> str:
    """host:port[,host:port...] of a Redis URL, without its password (for messages)."""
    try:
        return parse_redis_url(url).address() or "127.0.0.1:6379"
    except ValueError:
        return "(unparsable Redis URL)"


def check_eviction_policy(client: redis.Redis) -> str | None:
    """The server's maxmemory-policy, logged as an error unless it is `noeviction` (an evicting
    Redis may drop a dedupe list, and a replay then appends twice without any error). None when
    the server hides CONFIG (some managed Redis services do)."""
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.ResponseError:
        return None
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if policy != "noeviction":
        log.error(
            "Redis maxmemory-policy is %r: evicted dedupe lists let replays append twice; "
            "set maxmemory-policy noeviction (docs/operations.md, Redis memory)",
            policy,
        )
    return policy


def _run(pipe: Any, client: Any = None) -> list:
    """Execute a pipeline; OOM raises RedisOutOfMemory and an infrastructure reply
    (infra_error: READONLY, MOVED / ASK not followed, TRYAGAIN, CLUSTERDOWN, LOADING,
    MASTERDOWN, NOPERM) raises RedisUnavailable after dropping the client's connections, so the
    retry reconnects (Sentinel: to the current primary). Any other per-command error comes back
    in place of that command's result (the event's own fault)."""
    results = pipe.execute(raise_on_error=False)
    for r in results:
        # redis-py turns an "OOM ..." reply into OutOfMemoryError and drops the "OOM" prefix
        if isinstance(r, redis.exceptions.OutOfMemoryError) or (
            isinstance(r, redis.ResponseError) and str(r).startswith("OOM")
        ):
            raise RedisOutOfMemory(f"Redis is out of memory (maxmemory): {r}")
    bad = next((r for r in results if isinstance(r, Exception) and infra_error(r)), None)
    if bad is not None:
        if client is not None and not is_cluster(client):
            client.connection_pool.disconnect()
        raise RedisUnavailable(f"Redis: {type(bad).__name__}: {bad}")
    return results


class _Scripted:
    """A Lua script loaded once per client (EVALSHA in pipelines; reloaded after NOSCRIPT).
    Plain EVALSHA: redis-py's Script objects cost an extra SCRIPT EXISTS round trip per
    pipeline. The first load also checks the server's eviction policy."""

    client: redis.Redis
    _shas: dict[str, str]

    def _sha(self, script: str) -> str:
        shas = self.__dict__.setdefault("_shas", {})
        if script not in shas:
            if not shas:
                check_eviction_policy(self.client)
            shas[script] = self.client.script_load(script)
        return shas[script]

    def _evalsha_batch(self, script: str, calls: list[tuple[list, list]], tail: Any = None) -> list:
        """One pipelined round trip of EVALSHA(script, keys, args) per call, then what
        `tail(pipe)` adds (its results follow the calls')."""
        for attempt in (0, 1):
            pipe = self.client.pipeline(transaction=False)
            sha = self._sha(script)
            for keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            if tail is not None:
                tail(pipe)
            results = _run(pipe, self.client)
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                # Redis restarted and forgot the script: nothing ran, so load it and run again
                self._shas.pop(script, None)
                if attempt:
                    raise next(r for r in results if isinstance(r, Exception))
                continue
            break
        return results


@dataclass
class EventWindow(_Scripted):
    """Per-user dedupe of event ids in Redis: the last `n` ids of each key, nothing older.
    `seen` before writing, `remember` after the write is durable (a crash between the two can
    repeat a record, never lose one)."""

    client: redis.Redis
    n: int = DEDUP_N
    ttl_s: int = 7 * 86400

    def seen(self, keys: list[str], event_ids: list[str]) -> list[bool | str]:
        """Per event: True if remembered, False if not, or the reason Redis refused it."""
        pipe = self.client.pipeline(transaction=False)
        for k, e in zip(keys, event_ids, strict=True):
            pipe.lpos(k, event_hash(e))  # type: ignore[arg-type]  # bytes go out as they are
        return [
            _reason(r) if isinstance(r, Exception) else r is not None
            for r in _run(pipe, self.client)
        ]

    def remember(self, keys: list[str], event_ids: list[str]) -> list[bool | str]:
        """Remember each event id under its key; per event: True if it was new, False if it was
        already there, or the reason Redis refused it."""
        res = self._evalsha_batch(
            _REMEMBER,
            [
                ([k], [event_hash(e), self.n, self.ttl_s])
                for k, e in zip(keys, event_ids, strict=True)
            ],
        )
        return [_reason(r) if isinstance(r, Exception) else bool(r) for r in res]


def _decode_history(raws: list[bytes]) -> tuple[list[UserState], list[tuple[bytes, str]]]:
    """A stored list (newest first) as states oldest first, and the entries that do not decode
    with why (a state written by another format's writer, or damaged)."""
    out, bad = [], []
    for raw in reversed(raws):
        try:
            out.append(UserState.decode(raw))
        except Exception as exc:  # noqa: BLE001 - whatever the bytes are, they are one entry's
            bad.append((raw, f"{type(exc).__name__}: {exc}"))
    return out, bad


def replica_count(client: Any) -> int:
    """Replicas connected to the primary the client writes to (0 when INFO is refused or the
    client is a cluster's)."""
    if is_cluster(client):
        return 0
    try:
        info = client.info("replication")
    except redis.ResponseError:
        return 0
    return int(info.get("connected_slaves", 0))


def _refresh_slots(client: Any, failed_node: str | None = None) -> None:
    """Re-read a cluster's slot map (after a failover its replica owns the slots), so the
    batch's retry goes to the current primaries; a cluster that does not answer yet is left
    to the retry."""
    with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException):
        client.nodes_manager.initialize(last_failed_node_name=failed_node)


def _reason(exc: Exception) -> str:
    return f"Redis: {type(exc).__name__}: {exc}"


@dataclass
class StateStore(_Scripted):
    client: redis.Redis
    prefix: str = "astec"
    k: int = 16
    ttl_s: int = 30 * 86400
    dedup_ttl_s: int = 7 * 86400
    dedup_n: int = DEDUP_N
    # replicas that must hold a batch's writes before it counts as stored (WAIT in the batch's
    # pipeline, on the connection that wrote): -1 = 1 where the primary has replicas, else 0
    wait_replicas: int = 0
    wait_timeout_ms: int = 1000
    # cluster primary -> (1 if it has a replica online else 0, when asked): wait_replicas -1
    _replicas_seen: dict = field(default_factory=dict, init=False, repr=False)

    def _replicas_to_wait(self) -> int:
        """wait_replicas, with -1 resolved at the first append (by INFO replication, so a Redis
        down when the worker starts is waited out like any outage). On Cluster -1 stays: it is
        resolved per primary at each batch (_evalsha_per_primary)."""
        if self.wait_replicas < 0 and not is_cluster(self.client):
            self.wait_replicas = 1 if replica_count(self.client) else 0
        return self.wait_replicas

    def _has_replica(self, node: Any) -> int:
        """1 if the cluster primary has a replica online (its INFO replication, asked again
        every REPLICAS_REREAD_S and after a failed wait), else 0. The primary is asked, not the
        slot map: CLUSTER SLOTS leaves out a replica until it has replicated a write."""
        seen = self._replicas_seen.get(node.name)
        if seen is None or time.monotonic() - seen[1] > REPLICAS_REREAD_S:
            primary: Any = self.client.get_redis_connection(node)  # type: ignore[attr-defined]
            info = primary.info("replication")
            online = any(
                info.get(f"slave{i}", {}).get("state") == "online"
                for i in range(int(info.get("connected_slaves", 0)))
            )
            seen = self._replicas_seen[node.name] = (int(online), time.monotonic())
        return seen[0]

    def _evalsha_per_primary(self, script: str, calls: list[tuple[list, list]]) -> list:
        """The cluster's batch with a replica wait: one plain pipeline per primary that owns
        some of the batch's users (their EVALSHAs, then WAIT on that same connection: WAIT
        covers the writes of the connection it is sent on, and redis-py's cluster pipeline
        resends a failed command, WAIT included, on another connection, where it would
        acknowledge nothing). wait_replicas -1 waits for 1 replica on a primary that has one
        online, else 0 (the primary a failover promoted has none until its old one rejoins).
        A MOVED reply or a node that does not answer refreshes the slot map; it and a WAIT
        not acknowledged in time raise for a retry of the whole batch (the appends are
        idempotent, so the commands that ran on other nodes run again harmlessly)."""
        client: Any = self.client
        groups: dict[str, tuple[Any, list[int]]] = {}
        try:
            for i, (keys, _) in enumerate(calls):
                node = client.get_node_from_key(keys[0])
                groups.setdefault(node.name, (node, []))[1].append(i)
        except redis.exceptions.SlotNotCoveredError as exc:
            _refresh_slots(client)
            raise RedisUnavailable(f"Redis: {exc}") from None
        for attempt in (0, 1):
            sha = self._sha(script)
            results: list = [None] * len(calls)
            for node, idx in groups.values():
                try:
                    n = self.wait_replicas if self.wait_replicas >= 0 else self._has_replica(node)
                    pipe = client.get_redis_connection(node).pipeline(transaction=False)
                    for i in idx:
                        keys, args = calls[i]
                        pipe.evalsha(sha, len(keys), *keys, *args)
                    if n:
                        pipe.execute_command("WAIT", n, self.wait_timeout_ms)
                    res = _run(pipe)
                except (redis.ConnectionError, redis.TimeoutError):
                    self._replicas_seen.pop(node.name, None)
                    _refresh_slots(client, node.name)
                    raise
                if n:
                    acked = res.pop()
                    if isinstance(acked, Exception) or int(acked) < n:
                        self._replicas_seen.pop(node.name, None)  # asked again at the retry
                        raise RedisUnavailable(
                            f"Redis: {acked} of {n} replica(s) of {node.name} acknowledged "
                            f"the batch within {self.wait_timeout_ms} ms"
                        )
                for i, r in zip(idx, res, strict=True):
                    results[i] = r
            if not any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                break
            self._shas.pop(script, None)  # a node restarted and forgot it: load it again
            if attempt:
                raise next(r for r in results if isinstance(r, Exception))
        return results

    @classmethod
    def from_settings(cls, client: Any, settings: Any) -> StateStore:
        """The store as the settings describe it (prefix, K, TTLs, N, replica wait)."""
        return cls(
            client,
            settings.redis.key_prefix,
            settings.state.k,
            settings.state.ttl_s,
            settings.state.dedup_ttl_s,
            settings.state.dedup_n,
            settings.redis.wait_replicas,
            settings.redis.wait_timeout_ms,
        )

    def states_key(self, user_id: str) -> str:
        return user_key(self.prefix, user_id, "states")

    def eids_key(self, user_id: str) -> str:
        return user_key(self.prefix, user_id, "eids")

    def append_batch(
        self, user_ids: list[str], states: list[UserState], with_history: bool = False
    ) -> tuple[list[bool], list[list[UserState]]]:
        """Append each state to its user's list unless its event id was seen; one round trip.

        Returns per event whether it was appended (False = replayed duplicate) and, when asked,
        the user's earlier states oldest first (the current event excluded), for the policy.
        An event Redis refused raises (append_batch_checked reports it per event instead).
        """
        fresh, hists, errors = self.append_batch_checked(user_ids, states, with_history)
        for e in errors:
            if e is not None:
                raise redis.ResponseError(e)
        return fresh, hists

    def append_batch_checked(
        self, user_ids: list[str], states: list[UserState], with_history: bool = False
    ) -> tuple[list[bool], list[list[UserState]], list[str | None]]:
        """append_batch, with the events Redis refused reported one by one (their reason), so
        one event's error never holds back the others of its batch. Connection errors and OOM
        (RedisOutOfMemory) raise: they are not the event's fault, the caller retries."""
        want = "1" if with_history else "0"
        calls = [
            (
                [self.states_key(uid), self.eids_key(uid)],
                [
                    st.encode(),
                    self.k,
                    self.ttl_s,
                    self.dedup_ttl_s,
                    want,
                    event_hash(st.event_id),
                    self.dedup_n,
                ],
            )
            for uid, st in zip(user_ids, states, strict=True)
        ]
        n_wait = self._replicas_to_wait()

        def wait(pipe: Any) -> None:
            if n_wait:
                pipe.execute_command("WAIT", n_wait, self.wait_timeout_ms)

        if n_wait and is_cluster(self.client):
            results = self._evalsha_per_primary(_APPEND, calls)
        else:
            results = self._evalsha_batch(_APPEND, calls, wait if n_wait else None)
        if n_wait and not is_cluster(self.client):
            acked = results.pop()
            if isinstance(acked, Exception) or int(acked) < n_wait:
                # not stored until a replica holds it: retried (the appends are idempotent)
                raise RedisUnavailable(
                    f"Redis: {acked} of {n_wait} replica(s) acknowledged the batch within "
                    f"{self.wait_timeout_ms} ms"
                )
        errors = [_reason(r) if isinstance(r, Exception) else None for r in results]
        fresh = [e is None and bool(r[0]) for r, e in zip(results, errors, strict=True)]
        if not with_history:
            return fresh, [[] for _ in states], errors
        hists: list[list[UserState]] = []
        bad_raw: dict[str, set[bytes]] = {}  # user -> stored entries that do not decode
        refused: list[int] = []  # events dead-lettered for their user's undecodable state
        for i, (r, st, e) in enumerate(zip(results, states, errors, strict=True)):
            if e is not None:
                hists.append([])
                continue
            h, bad = _decode_history(r[1])
            hists.append([s for s in h if s.event_id != st.event_id])
            if bad:
                uid = user_ids[i]
                if uid not in bad_raw:  # the user's first event of the batch to meet them
                    errors[i] = (
                        f"state: {len(bad)} stored state(s) of this user cannot be decoded "
                        f"({bad[0][1]}); dropped from the user's window"
                    )[:4096]
                    fresh[i] = False
                    refused.append(i)
                bad_raw.setdefault(uid, set()).update(raw for raw, _ in bad)
        if bad_raw:
            self._drop_undecodable(bad_raw, [(user_ids[i], states[i]) for i in refused])
        return fresh, hists, errors

    def _drop_undecodable(
        self, bad_raw: dict[str, set[bytes]], refused: list[tuple[str, UserState]]
    ) -> None:
        """Remove the entries that do not decode from their users' lists (the window goes on
        with what decodes), and the refused events' own state and id, so a replay of their dead
        letter is appended as new."""
        pipe = self.client.pipeline(transaction=False)
        for uid, raws in bad_raw.items():
            for raw in raws:
                pipe.lrem(self.states_key(uid), 0, raw)  # type: ignore[arg-type]
        for uid, st in refused:
            pipe.lrem(self.states_key(uid), 1, st.encode())  # type: ignore[arg-type]
            pipe.lrem(self.eids_key(uid), 1, event_hash(st.event_id))  # type: ignore[arg-type]
        _run(pipe, self.client)

    def mark_shown(
        self, user_ids: list[str], states: list[UserState], queries: list[int]
    ) -> list[bool | str]:
        """Record in each event's stored state the ad query chosen for it (one round trip);
        per event whether its state was found, or the reason Redis refused it. Not waited on
        by replicas: a mark lost in a failover reads as nothing shown at that visit."""
        calls = [
            ([self.states_key(uid)], [replace(st, shown=int(q)).encode(), SHOWN_OFFSET])
            for uid, st, q in zip(user_ids, states, queries, strict=True)
        ]
        if not calls:
            return []
        results = self._evalsha_batch(_MARK_SHOWN, calls)
        return [_reason(r) if isinstance(r, Exception) else bool(r) for r in results]

    def history(self, user_id: str) -> list[UserState]:
        """A user's stored states, oldest first."""
        return self.histories([user_id])[0]

    def histories(self, user_ids: list[str]) -> list[list[UserState]]:
        pipe = self.client.pipeline(transaction=False)
        for uid in user_ids:
            pipe.lrange(self.states_key(uid), 0, -1)
        return [[UserState.decode(raw) for raw in reversed(r)] for r in pipe.execute()]
