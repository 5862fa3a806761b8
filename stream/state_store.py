"""Users' last K visit states in Redis, appended idempotently by event id.

Keys (hash-tagged, so Redis Cluster keeps one user's keys in one slot):
    <prefix>:{user:<id>}:states          list of encoded UserState, newest first, capped at K, TTL
    <prefix>:{user:<id>}:seen:<event_id> idempotence key, TTL dedup_ttl_s
User and event ids are percent-encoded in keys (`key_part`): an id holding `}`, `:` or `{`
cannot close the hash tag or forge another user's key (plain ids stay readable as they are).

One Lua script per event sets the idempotence key with NX and appends only when it was new, so a
replay after a crash (at-least-once delivery) never appends the same visit twice. A batch is one
pipelined round trip of EVALSHA (the script is loaded once, and again if Redis forgot it). The
client retries connection errors with exponential backoff (Redis restarts).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from personalization.state import UserState

# KEYS: states, seen.  ARGV: state bytes, K, state ttl, dedup ttl, want history ("1"/"0").
# Returns {1 if appended else 0, [history newest first, before this append]}.
_APPEND = """
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


class RedisOutOfMemory(redis.ConnectionError):
    """Redis refused a write with OOM (maxmemory reached): retried like an outage, never
    skipped, so idempotence is never silently given up."""


def key_part(value: str) -> str:
    """An id as it appears inside a key: percent-encoded, so it cannot contain the separators
    (`:`) or the hash-tag braces; surrogates are escaped rather than failing the encode."""
    return quote(value.encode("utf-8", "surrogatepass"), safe="")


def connect(url: str, retries: int = 10) -> redis.Redis:
    """A client that reconnects with exponential backoff (50 ms doubling, capped at 2 s)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=5,
        socket_connect_timeout=2,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
    )


@dataclass
class StateStore:
    client: redis.Redis
    prefix: str = "astec"
    k: int = 16
    ttl_s: int = 30 * 86400
    dedup_ttl_s: int = 7 * 86400

    def _sha(self) -> str:
        """The append script's SHA1, loaded into Redis once per client (and again after a Redis
        restart forgets it: append_batch reloads on NOSCRIPT). Plain EVALSHA in the pipeline:
        redis-py's Script objects cost an extra SCRIPT EXISTS round trip per pipeline."""
        if getattr(self, "_append_sha", None) is None:
            self._append_sha = self.client.script_load(_APPEND)
        return self._append_sha

    def states_key(self, user_id: str) -> str:
        return f"{self.prefix}:{{user:{key_part(user_id)}}}:states"

    def seen_key(self, user_id: str, event_id: str) -> str:
        return f"{self.prefix}:{{user:{key_part(user_id)}}}:seen:{key_part(event_id)}"

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
        for attempt in (0, 1):
            pipe = self.client.pipeline(transaction=False)
            sha = self._sha()
            for uid, st in zip(user_ids, states):
                pipe.evalsha(
                    sha,
                    2,
                    self.states_key(uid),
                    self.seen_key(uid, st.event_id),
                    st.encode(),
                    self.k,
                    self.ttl_s,
                    self.dedup_ttl_s,
                    want,
                )
            results = pipe.execute(raise_on_error=False)
            if any(isinstance(r, redis.exceptions.NoScriptError) for r in results):
                # Redis restarted and forgot the script: nothing ran, so load it and run again
                self._append_sha = None
                if attempt:
                    raise next(r for r in results if isinstance(r, Exception))
                continue
            break
        oom = next(
            (r for r in results if isinstance(r, redis.ResponseError) and str(r).startswith("OOM")),
            None,
        )
        if oom is not None:
            raise RedisOutOfMemory(f"Redis is out of memory (maxmemory): {oom}")
        errors = [
            f"Redis: {type(r).__name__}: {r}" if isinstance(r, Exception) else None for r in results
        ]
        fresh = [e is None and bool(r[0]) for r, e in zip(results, errors)]
        if not with_history:
            return fresh, [[] for _ in states], errors
        hists = []
        for r, st, e in zip(results, states, errors):
            if e is not None:
                hists.append([])
                continue
            h = [UserState.decode(raw) for raw in reversed(r[1])]
            hists.append([s for s in h if s.event_id != st.event_id])
        return fresh, hists, errors

    def history(self, user_id: str) -> list[UserState]:
        """A user's stored states, oldest first."""
        return [
            UserState.decode(raw)
            for raw in reversed(self.client.lrange(self.states_key(user_id), 0, -1))
        ]

    def histories(self, user_ids: list[str]) -> list[list[UserState]]:
        pipe = self.client.pipeline(transaction=False)
        for uid in user_ids:
            pipe.lrange(self.states_key(uid), 0, -1)
        return [[UserState.decode(raw) for raw in reversed(r)] for r in pipe.execute()]
