"""A test's own topics, consumer group and Redis key prefix, so tests sharing one broker and
one Redis never read each other's events, offsets or user state."""

from __future__ import annotations

import uuid

from stream.settings import Settings


def own_topics(settings: Settings, **changes) -> Settings:
    """`settings` with topics, group and Redis prefix suffixed by a fresh 8-hex tag (the last 8
    characters of `consumer_group`), plus `changes`. The topics are not created here
    (stream.topics.ensure_topics does that, with whatever settings the test means)."""
    tag = uuid.uuid4().hex[:8]
    return settings.replace(
        topic_page_views=f"page-views-{tag}",
        topic_ad_queries=f"ad-queries-{tag}",
        topic_ad_clicks=f"ad-clicks-{tag}",
        topic_dead_letters=f"dead-letters-{tag}",
        consumer_group=f"astec-test-{tag}",
        redis_key_prefix=f"astec-test-{tag}",
        **changes,
    )
