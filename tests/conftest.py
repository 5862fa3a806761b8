"""Shared fixtures: the real Kafka-API broker and Redis, started once per test session.

Unless both KAFKA_BOOTSTRAP and REDIS_URL are set (then those services are used as they are),
the `services` fixture starts a Tansu broker and redis-server on free loopback ports in a temp
directory through infra.services, and stops exactly those processes at the end, also on failure.
Tests that use the stream should take `stream_settings`: same services, but topic names and a
consumer group of their own so tests never read each other's messages.
"""
from __future__ import annotations

import os
import uuid

import pytest

from infra.config import Settings, load_settings


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Settings:
    """Settings pointing at running services (started here unless the env names them)."""
    if os.environ.get("KAFKA_BOOTSTRAP") and os.environ.get("REDIS_URL"):
        yield load_settings(services_dir=str(tmp_path_factory.mktemp("no-services")))
        return
    from infra.services import start_services, stop_services
    data_dir = tmp_path_factory.mktemp("services")
    info = start_services(data_dir)
    try:
        yield Settings(kafka_bootstrap=info.kafka_bootstrap, redis_url=info.redis_url,
                       services_dir=str(data_dir))
    finally:
        stop_services(data_dir)


@pytest.fixture
def stream_settings(services: Settings) -> Settings:
    """The session's services with fresh topics, consumer group and Redis key prefix."""
    from stream.topics import ensure_topics
    tag = uuid.uuid4().hex[:8]
    s = services.replace(topic_page_views=f"page-views-{tag}", topic_ad_queries=f"ad-queries-{tag}",
                         topic_ad_clicks=f"ad-clicks-{tag}", topic_dead_letters=f"dead-letters-{tag}",
                         consumer_group=f"astec-test-{tag}", redis_key_prefix=f"astec-test-{tag}")
    ensure_topics(s)
    return s
