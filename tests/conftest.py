"""Shared fixtures: the real Apache Kafka broker and Redis, started once per test session.

Unless both KAFKA_BOOTSTRAP and REDIS_URL are set (then those services are used as they are,
with KAFKA_SASL_* / ASTEC_* settings from the environment), the `services` fixture starts an
Apache Kafka broker (KRaft, SASL) and redis-server on free loopback ports in a temp
directory through infra.services, and stops exactly those processes at the end, also on failure.
Tests that use the stream should take `stream_settings`: same services, but topic names and a
consumer group of their own so tests never read each other's messages.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from stream.settings import Settings, load_settings
from testkit.astec_cli import astec
from testkit.corpora import KnnPredictor, read_stream_corpus
from testkit.own_topics import own_topics
from testkit.paths import STREAM_DATA


@pytest.fixture(scope="session")
def services(tmp_path_factory) -> Settings:
    """Settings pointing at running services (started here unless the env names them)."""
    if os.environ.get("KAFKA_BOOTSTRAP") and os.environ.get("REDIS_URL"):
        yield load_settings(services_dir=str(tmp_path_factory.mktemp("no-services")))
        return
    from infra.services import start_services, stop_services

    data_dir = tmp_path_factory.mktemp("services")
    start_services(data_dir)
    try:
        yield load_settings(services_dir=str(data_dir), env={})
    finally:
        stop_services(data_dir)


@pytest.fixture
def stream_settings(services: Settings) -> Settings:
    """The session's services with fresh topics, consumer group and Redis key prefix."""
    from stream.topics import ensure_topics

    s = own_topics(services)
    ensure_topics(s)
    return s


@pytest.fixture(scope="session")
def stream_corpus():
    return read_stream_corpus()


@pytest.fixture(scope="session")
def knn_predictor(stream_corpus):
    return KnnPredictor(*stream_corpus)


@pytest.fixture(scope="session")
def astec_predictor(tmp_path_factory) -> str:
    """A real exported Astec predictor trained on tests/data/stream (about 10 s on 2 cores)."""
    d = tmp_path_factory.mktemp("astec")
    astec(
        "train",
        "--train",
        os.path.join(STREAM_DATA, "train.tsv"),
        "--labels",
        os.path.join(STREAM_DATA, "labels.txt"),
        "--out",
        str(d / "model"),
        "--threads",
        "1",
        "--quiet",
    )
    astec("export", "--model", str(d / "model"), "--out", str(d / "predictor"), "--threads", "1")
    return str(d / "predictor")


@pytest.fixture(scope="session")
def evaluation_json(astec_predictor, tmp_path_factory) -> Path:
    """A real `astec evaluate --json-out` file for the fixture model on its own training lines."""
    d = tmp_path_factory.mktemp("eval")
    model = str(Path(astec_predictor).parent / "model")
    train, labels = os.path.join(STREAM_DATA, "train.tsv"), os.path.join(STREAM_DATA, "labels.txt")
    astec(
        "predict", "--model", model, "--input", train, "--out", str(d / "pred.txt"), "--top-k", "5"
    )
    astec(
        "evaluate",
        "--test",
        train,
        "--labels",
        labels,
        "--pred",
        str(d / "pred.txt"),
        "--train",
        train,
        "--train-labels",
        labels,
        "--json-out",
        str(d / "eval.json"),
    )
    return d / "eval.json"


@pytest.fixture
def redis_settings(services: Settings) -> Settings:
    """The session's services with a Redis key prefix of this test's own (for tests that need
    Redis only, not the Kafka topics `stream_settings` creates)."""
    return services.replace(redis_key_prefix=f"astec-dash-{uuid.uuid4().hex[:8]}")
