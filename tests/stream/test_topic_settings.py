"""Topics as the settings describe them, on the real broker: created with the replication and
min.insync.replicas the cluster's size calls for, and an existing topic of another partition
count or replication refused by `astec stream run` in one line before any worker starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from stream.settings import settings_env
from stream.topics import TopicMismatch, ensure_topics, replication_for
from testkit.own_topics import own_topics
from testkit.paths import REPO

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def _admin(settings):
    from confluent_kafka.admin import AdminClient

    return AdminClient(settings.kafka.librdkafka_options())


def test_replication_follows_the_cluster_size(services):
    assert replication_for(services, 1) == (1, 1)
    assert replication_for(services, 2) == (2, 1)
    assert replication_for(services, 3) == (3, 2)
    assert replication_for(services, 5) == (3, 2)
    assert replication_for(services.replace(replication_factor=2, min_insync_replicas=2), 5) == (
        2,
        2,
    )


def test_topics_created_with_replication_and_min_isr_of_the_cluster(stream_settings):
    from confluent_kafka.admin import ConfigResource

    admin = _admin(stream_settings)
    meta = admin.list_topics(timeout=10)
    rf, isr = replication_for(stream_settings, len(meta.brokers))
    t = meta.topics[stream_settings.topics.page_views]
    assert len(t.partitions) == stream_settings.topics.partitions
    assert {len(p.replicas) for p in t.partitions.values()} == {rf}
    res = ConfigResource(ConfigResource.Type.TOPIC, stream_settings.topics.page_views)
    cfg = admin.describe_configs([res])[res].result(10)
    assert cfg["min.insync.replicas"].value == str(isr)


def test_stream_run_refuses_a_topic_with_other_partitions_in_one_line(
    services, astec_predictor, tmp_path
):
    s = own_topics(services)
    tag = s.consumer.group[-8:]
    ensure_topics(s.replace(partitions=2))  # made earlier by someone with other settings
    with pytest.raises(TopicMismatch, match=rf"page-views-{tag}' .* has 2 partitions"):
        ensure_topics(s)
    with pytest.raises(
        TopicMismatch, match="replication 1, the settings expect 4 with replication 3"
    ):
        ensure_topics(s.replace(replication_factor=3), [s.topics.page_views])
    res = subprocess.run(
        [sys.executable, "-m", "infra.cli", "stream", "run", "--model", astec_predictor],
        cwd=REPO,
        env={**os.environ, **settings_env(s), "ASTEC_SERVICES_DIR": str(tmp_path / "none")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"page-views-{tag}' on {s.kafka.bootstrap} has 2 partitions" in res.stderr
    assert "worker" not in res.stdout + res.stderr  # refused before any worker started
