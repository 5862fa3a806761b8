"""A Redis client for one of three topologies, chosen by the URL's scheme.

    redis://[:PASSWORD@]HOST:PORT/DB             one endpoint (a primary, or a proxy)
    rediss://...                                 the same over TLS
    redis+sentinel://[:PASSWORD@]H1:P1,H2:P2,.../SERVICE[/DB]
                                                 Sentinel: the client asks the sentinels for
                                                 SERVICE's current primary at every (re)connect,
                                                 so it follows a failover
    redis+cluster://[:PASSWORD@]H1:P1,H2:P2,...  Redis Cluster: a slot-aware client (redis-py's
                                                 RedisCluster) that follows MOVED / ASK

The password authenticates against the data nodes and, for Sentinel, against the sentinels too
(`?sentinel_password=` sets theirs apart). Every client retries connection errors a few times
with exponential backoff; longer outages are the caller's to wait out (the worker pauses its
partitions and keeps polling meanwhile, stream.worker_health).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster")


class RedisUrlError(ValueError):
    """A Redis URL this project cannot use; the message says which part is wrong."""


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL: its topology, nodes, password and (Sentinel) service name."""

    topology: str  # "single", "sentinel" or "cluster"
    nodes: tuple[tuple[str, int], ...]
    password: str | None
    service: str = ""
    db: int = 0
    sentinel_password: str | None = None

    def address(self) -> str:
        """The nodes as host:port[,host:port...] (no password: for messages)."""
        return ",".join(f"{h}:{p}" for h, p in self.nodes)


def _nodes(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts = netloc.rsplit("@", 1)[-1]
    out = []
    for part in hosts.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host:
            host, port = port, ""
        try:
            out.append((host or "127.0.0.1", int(port) if port else default_port))
        except ValueError:
            raise RedisUrlError(f"bad port in Redis node {part!r}") from None
    return tuple(out)


def parse_redis_url(url: str) -> RedisTarget:
    """The topology, nodes and password of a Redis URL, or a RedisUrlError naming the problem."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in SCHEMES:
        raise RedisUrlError(
            f"Redis URL scheme {scheme or '(none)'!r} is not one of {', '.join(SCHEMES)}"
        )
    u = urlsplit(url.replace(f"{scheme}://", "redis://", 1))
    password = unquote(u.password) if u.password else None
    query = {k: v[-1] for k, v in parse_qs(u.query).items()}
    path = [p for p in u.path.split("/") if p]
    if scheme == "redis+sentinel":
        if not path:
            raise RedisUrlError(
                "a redis+sentinel:// URL names the primary's service: "
                "redis+sentinel://:PASSWORD@HOST:PORT,HOST:PORT/SERVICE[/DB]"
            )
        try:
            db = int(path[1]) if len(path) > 1 else 0
        except ValueError:
            raise RedisUrlError(f"bad database number {path[1]!r} in the Redis URL") from None
        return RedisTarget(
            "sentinel",
            _nodes(u.netloc, 26379),
            password,
            path[0],
            db,
            query.get("sentinel_password", password),
        )
    if scheme == "redis+cluster":
        if path and path[0] != "0":
            raise RedisUrlError("Redis Cluster has database 0 only")
        return RedisTarget("cluster", _nodes(u.netloc, 6379), password)
    return RedisTarget("single", _nodes(u.netloc, 6379) if u.netloc else (), password)


def redis_client(url: str, retries: int = 3, socket_timeout: float = 5.0) -> Any:
    """A client for the URL's topology (redis.Redis for one endpoint or Sentinel's primary,
    redis.cluster.RedisCluster for a cluster) that retries connection errors `retries` times,
    50 ms doubling (capped at 2 s)."""
    target = parse_redis_url(url)
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 2,
        "retry": Retry(ExponentialBackoff(cap=2.0, base=0.05), retries),
    }
    if target.topology == "single":
        return redis.Redis.from_url(
            url,
            health_check_interval=10,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **common,
        )
    if target.topology == "sentinel":
        from redis.sentinel import Sentinel

        sentinel = Sentinel(
            list(target.nodes),
            sentinel_kwargs={
                "password": target.sentinel_password,
                "socket_timeout": 1.0,
                "socket_connect_timeout": 1.0,
            },
            password=target.password,
            db=target.db,
            health_check_interval=10,
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            **common,
        )
        return sentinel.master_for(target.service)
    from redis.cluster import ClusterNode, RedisCluster

    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
        password=target.password,
        **common,
    )


def is_cluster(client: Any) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)
