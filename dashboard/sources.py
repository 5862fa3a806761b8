"""Where the dashboard reads from: the model directory and Redis, resolved like every other command.

Settings come from stream.settings (defaults < services.json of `astec infra up` < config file <
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

POLICY_ENV = "ASTEC_DASHBOARD_POLICY"
LOGS_ENV = "ASTEC_DASHBOARD_LOGS"
BENCH_ENV = "ASTEC_DASHBOARD_BENCH"


class SourceError(RuntimeError):
    """A data source is missing or unreachable; the message says which and what to do."""


@dataclass(frozen=True)
class Sources:
    models_dir: Path
    redis_url: str
    prefix: str
    policy_dir: Path | None
    metrics_interval_s: float = 1.0
    logs_dir: Path | None = None
    bench_files: tuple[Path, ...] = ()
    policy_how: str = ""  # "given", "found next to the models" or ""
    logs_how: str = ""

    @property
    def redis_display(self) -> str:
        return mask_url(self.redis_url)


def mask_url(url: str) -> str:
    """The URL with any password replaced by ***, for messages shown on screen."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def find_policy(models: Path) -> Path | None:
    """MODELS/gru, else MODELS/../gru (a GRU registry or version directory), else None."""
    models = Path(models).absolute()
    for cand in (models / "gru", models.parent / "gru"):
        if cand.is_dir() and cand != models:
            return cand
    return None


def is_click_log(path: Path) -> bool:
    return (Path(path) / "ad_impressions").is_dir() or (Path(path) / "ad_clicks").is_dir()


def find_logs(models: Path) -> Path | None:
    """A `live-logs` click-log directory beside MODELS or up to two levels above it."""
    models = Path(models).absolute()
    for base in (models, models.parent, models.parent.parent):
        cand = base / "live-logs"
        if is_click_log(cand):
            return cand
    return None


def load_sources(env: dict | None = None) -> Sources:
    """Resolve the dashboard's sources from the environment (as `astec dashboard` sets it)."""
    from stream.settings import load_settings

    env = dict(os.environ if env is None else env)
    s = load_settings(env=env)
    models = Path(s.ops.models_dir).expanduser()
    policy, logs = env.get(POLICY_ENV), env.get(LOGS_ENV)
    policy_dir = Path(policy).expanduser() if policy else find_policy(models)
    logs_dir = Path(logs).expanduser() if logs else find_logs(models)
    bench = tuple(Path(b).expanduser() for b in env.get(BENCH_ENV, "").split(os.pathsep) if b)
    return Sources(
        models_dir=models,
        redis_url=s.redis.url.reveal(),
        prefix=s.redis.key_prefix,
        policy_dir=policy_dir,
        metrics_interval_s=s.ops.metrics_interval_s,
        logs_dir=logs_dir,
        bench_files=bench,
        policy_how="given" if policy else ("found next to the models" if policy_dir else ""),
        logs_how="given" if logs else ("found next to the models" if logs_dir else ""),
    )


def redis_client(url: str) -> redis.Redis:
    """A client that fails fast (no retry loop): the page says "unreachable" instead of hanging.
    Any of the stream's Redis URLs (redis://, redis+sentinel://, redis+cluster://)."""
    from stream.redis_connect import redis_client as topology_client

    return topology_client(url, retries=0, socket_timeout=2)


def ping(client: redis.Redis, url: str) -> None:
    """Raise SourceError naming the (masked) URL when Redis does not answer."""
    try:
        client.ping()
    except redis.AuthenticationError as e:
        raise SourceError(
            f"Redis at {mask_url(url)} refused the credentials ({e}); check REDIS_URL"
        ) from None
    except redis.RedisError as e:
        raise SourceError(
            f"Redis at {mask_url(url)} is unreachable ({e}); start the services "
            "with `astec infra up` or set REDIS_URL"
        ) from None
