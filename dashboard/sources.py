"""Where the dashboard reads from: the model directory and Redis, resolved like every other command.

Settings come from infra.config (defaults < services.json of `astec infra up` < config file <
env), so `astec dashboard` passes them to the Streamlit process as ASTEC_* / REDIS_URL
variables and the app resolves the same values. The GRU policy directory is optional
(ASTEC_DASHBOARD_POLICY, else MODELS_DIR/gru when it exists).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

POLICY_ENV = "ASTEC_DASHBOARD_POLICY"


class SourceError(RuntimeError):
    """A data source is missing or unreachable; the message says which and what to do."""


@dataclass(frozen=True)
class Sources:
    models_dir: Path
    redis_url: str
    prefix: str
    policy_dir: Path | None
    metrics_interval_s: float = 1.0

    @property
    def redis_display(self) -> str:
        return mask_url(self.redis_url)


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***, for messages shown on screen."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def load_sources(env: dict | None = None) -> Sources:
    """Resolve the dashboard's sources from the environment (as `astec dashboard` sets it)."""
    from infra.config import load_settings
    env = dict(os.environ if env is None else env)
    s = load_settings(env=env)
    models = Path(s.models_dir).expanduser()
    policy = env.get(POLICY_ENV)
    policy_dir = Path(policy).expanduser() if policy else (models / "gru" if (models / "gru").is_dir()
                                                             else None)
    return Sources(models_dir=models, redis_url=s.redis_url, prefix=s.redis_key_prefix,
                   policy_dir=policy_dir, metrics_interval_s=s.metrics_interval_s)


def redis_client(url: str) -> redis.Redis:
    """A client that fails fast (no retry loop): the page says "unreachable" instead of hanging."""
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=1,
                                 retry=Retry(NoBackoff(), 0))


def ping(client: redis.Redis, url: str) -> None:
    """Raise SourceError naming the (masked) URL when Redis does not answer."""
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise SourceError(f"Redis at {mask_url(url)} refused the credentials ({e}); check "
                          "REDIS_URL") from None
    except redis.RedisError as e:
        raise SourceError(f"Redis at {mask_url(url)} is unreachable ({e}); start the services "
                          "with `astec infra up` or set REDIS_URL") from None
