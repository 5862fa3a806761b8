"""The librdkafka clients against the real broker: the bench's load generator (every page view
arrives, in the partition kafka-python and Java clients would pick, so per-user order and the
workers' split are the product's), its ad reader, and the workers' consumer's commit refusals."""

from __future__ import annotations

import pytest

from bench.stream_load import ConfluentProducer, KafkaPythonProducer
from stream.topics import ensure_topics, make_consumer

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


def _read_all(settings, topic, n):
    c = make_consumer(settings, [topic], None, max_poll_records=1000)
    got = []
    try:
        for _ in range(200):
            got += [
                (r.key, r.partition, r.value) for rs in c.poll(timeout_ms=100).values() for r in rs
            ]
            if len(got) >= n:
                break
    finally:
        c.close()
    return got


def test_confluent_load_producer_delivers_everything_to_the_kafka_python_partition(stream_settings):
    pytest.importorskip("confluent_kafka")
    s = stream_settings
    a, b = s.topics.page_views + "-ck", s.topics.page_views + "-kp"
    ensure_topics(s, [a, b])
    keys = [f"user{i % 37}".encode() for i in range(300)]
    for topic, prod in ((a, ConfluentProducer(s)), (b, KafkaPythonProducer(s))):
        for i, k in enumerate(keys):
            prod.send(topic, k, f"view-{i}".encode())
        prod.flush()
        prod.close()
    ck, kp = _read_all(s, a, 300), _read_all(s, b, 300)
    assert sorted(v for _, _, v in ck) == sorted(f"view-{i}".encode() for i in range(300))
    part_ck = {k: p for k, p, _ in ck}
    assert part_ck == {k: p for k, p, _ in kp}
    assert len(set(part_ck.values())) > 1  # the keys really were spread
    # one partition per user: the user's views keep their order
    for k in set(keys):
        views = [int(v[5:]) for kk, _, v in ck if kk == k]
        assert views == sorted(views)


def test_rdkafka_producer_reports_an_undelivered_message_as_an_error():
    """The worker commits a batch's offsets only after every message it produced is
    acknowledged: a message the broker never took must raise, not count as done."""
    pytest.importorskip("confluent_kafka")
    from infra.services import free_port
    from stream.rdkafka_producer import DeliveryError, RdProducer
    from stream.settings import Settings

    p = RdProducer(
        Settings().replace(kafka_bootstrap=f"127.0.0.1:{free_port()}"),
        "test",
        **{"message.timeout.ms": 300},
    )  # nobody listens there
    d = p.send("page-views", b"v", b"k")
    assert not d.is_done
    with pytest.raises(DeliveryError):
        d.get(timeout=20)
    assert d.is_done and d.error is not None
    p.send("page-views", b"v2", b"k")
    with pytest.raises(DeliveryError, match="unacknowledged"):
        p.flush(timeout=0.1)
    p.close(timeout=0)


@pytest.mark.parametrize("client", ["confluent", "kafka-python"])
def test_ad_reader_records_every_ad_query_once_and_counts_replays(stream_settings, client):
    """The bench's latency figures are the reader's arrival times: it must see every ad query of
    every partition from the start, keep the first arrival of a replayed one and count the rest."""
    import json
    import time

    from bench.stream_load import AdReader

    if client == "confluent":
        pytest.importorskip("confluent_kafka")
    s = stream_settings
    ensure_topics(s, [s.topics.ad_queries])
    prod = KafkaPythonProducer(s)
    ids = [f"e{i}" for i in range(200)]
    for i, e in enumerate(ids + ids[:7]):  # the first 7 are produced twice (a replay)
        prod.send(
            s.topics.ad_queries,
            f"u{i % 23}".encode(),
            json.dumps({"event_id": e, "event_ts": 1.0, "ts": 2.0}).encode(),
        )
    prod.flush()
    prod.close()
    reader = AdReader(s, client)
    reader.start()
    try:
        assert reader.wait(ids, 60)
        time.sleep(0.5)
    finally:
        reader.stop_event.set()
        reader.join(10)
    assert set(reader.arrivals) == set(ids)
    assert reader.duplicates == 7
    assert all(ev == 1.0 and ad == 2.0 and recv > 2.0 for recv, ev, ad in reader.arrivals.values())


def test_rdkafka_consumer_commit_refusal_is_a_commit_failure(stream_settings, monkeypatch):
    """The worker treats CommitFailedError as "these offsets will be replayed" and goes on; a
    refusal from librdkafka must arrive as that, not as an exception that kills the worker."""
    pytest.importorskip("confluent_kafka")
    from confluent_kafka import KafkaError, KafkaException
    from kafka.errors import CommitFailedError
    from kafka.structs import OffsetAndMetadata, TopicPartition

    from stream.rdkafka_consumer import RdConsumer

    s = stream_settings
    ensure_topics(s, [s.topics.page_views])
    c = RdConsumer(s, [s.topics.page_views], s.consumer.group, "test-commit")
    try:

        def refuse(*_a, **_k):  # what librdkafka raises once the group moved on without us
            raise KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION))

        monkeypatch.setattr(
            c, "_c", type("C", (), {"commit": staticmethod(refuse), "close": c._c.close})()
        )
        with pytest.raises(CommitFailedError, match=r"ILLEGAL_GENERATION|generation"):
            c.commit({TopicPartition(s.topics.page_views, 0): OffsetAndMetadata(5, None, -1)})
        c.commit({})  # nothing to commit: no request at all
    finally:
        c.close()


def test_ad_reader_waits_for_every_id_not_for_as_many_arrivals():
    """A phase's warm-up answers sit in the same reader: one page view of the phase still
    unanswered must keep the wait going (it once ended it early, and the saturation figure then
    left that view out), and its arrival ends it."""
    from bench.stream_load import AdReader

    r = AdReader.__new__(AdReader)  # the wait alone: no consumer
    ids = [f"sat-{i}" for i in range(1000)]
    r.arrivals = {f"warm-{i}": (0.0, 0.0, 0.0) for i in range(500)}
    r.arrivals.update({e: (1.0, 0.0, 0.0) for e in ids if e != "sat-17"})
    assert not r.wait(ids, 0.1)
    r.arrivals["sat-17"] = (2.0, 0.0, 0.0)
    assert r.wait(ids, 0.1)
