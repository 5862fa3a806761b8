"""The stream pipeline on a real Apache Kafka broker (KRaft, `astec infra up --broker kafka`):
every produced page view yields one ad query through a consumer group that commits its offsets.
The rest of the suite runs on Tansu; this file skips where Kafka's jars are not installed."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from infra.config import Settings
from infra.kafka.broker import KafkaNotInstalled, check_installed
from stream.model import ModelHandle
from stream.policy import Top1Policy
from stream.schemas import decode, encode
from stream.topics import ensure_topics, make_consumer, make_producer
from stream.worker import StreamWorker


def _installed() -> bool:
    try:
        check_installed()
        return True
    except KafkaNotInstalled:
        return False


pytestmark = [pytest.mark.services, pytest.mark.timeout(300),
              pytest.mark.skipif(not _installed(), reason="Apache Kafka jars not installed "
                                 "(`make kafka` needs Maven Central)")]


@pytest.fixture(scope="module")
def kafka_settings(tmp_path_factory) -> Settings:
    """Apache Kafka + Redis started for this module only, with topics of their own."""
    from infra.services import start_services, stop_services
    data_dir = tmp_path_factory.mktemp("kafka-services")
    info = start_services(data_dir, broker="kafka")
    try:
        s = Settings(kafka_bootstrap=info.kafka_bootstrap, redis_url=info.redis_url,
                     services_dir=str(data_dir), broker="kafka",
                     consumer_group=f"astec-kafka-{uuid.uuid4().hex[:6]}")
        ensure_topics(s)
        yield s
    finally:
        stop_services(data_dir)


def test_every_page_view_yields_an_ad_query_on_kafka(kafka_settings, astec_predictor,
                                                    stream_corpus):
    from kafka import TopicPartition
    s = kafka_settings
    titles = stream_corpus[0]
    msgs = [{"event_id": f"k-{i}", "user_id": f"u{i % 30}", "ts": time.time(),
             "url": f"https://example.org/{i}", "title": titles[i % len(titles)]}
            for i in range(300)]
    p = make_producer(s)
    for m in msgs:
        p.send(s.topic_page_views, key=m["user_id"].encode(), value=encode("page_view", m))
    p.flush()
    p.close()

    w = StreamWorker(s, ModelHandle.open(astec_predictor, check_every_s=0.1), Top1Policy(), "w-k")
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    c = make_consumer(s, [s.topic_ad_queries], None)
    got, deadline = [], time.monotonic() + 90
    try:
        while len(got) < len(msgs) and time.monotonic() < deadline:
            for recs in c.poll(timeout_ms=200).values():
                got.extend(recs)
    finally:
        c.close()
        w.stop()
        t.join(30)
    ads = [decode("ad_query", r.value, 1 << 20) for r in got]
    assert sorted(a["event_id"] for a in ads) == sorted(m["event_id"] for m in msgs)

    # the group committed every partition up to its end (the worker commits on a graceful stop)
    probe = make_consumer(s, [], s.consumer_group)
    tps = [TopicPartition(s.topic_page_views, i) for i in range(s.partitions)]
    ends = probe.end_offsets(tps)
    committed = {tp: probe.committed(tp) for tp in tps}
    probe.close()
    assert sum(ends.values()) == len(msgs)
    assert committed == ends
