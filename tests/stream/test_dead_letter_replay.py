"""`astec stream replay-dead-letters` on the real broker and Redis: the dead letters whose reason
matches (and written since the given time) go back to their source topic, each event once per
run; replaying twice stores each visit once (the workers are idempotent by event id)."""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner

from stream.model_handle import ModelHandle
from stream.policy_handle import Top1Policy
from stream.schemas import dead_letter, encode
from stream.settings import settings_env
from stream.state_store import StateStore, connect
from stream.topics import make_producer
from testkit.stream_load import answered, read_all_messages, worker_thread
from testkit.stream_run import page_view

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]


def _dead(settings, raw: bytes, reason: str, offset: int):
    p = make_producer(settings)
    p.send(
        settings.topics.dead_letters,
        key=b"u",
        value=dead_letter(raw, reason, settings.topics.page_views, 0, offset, "w-old"),
    ).get(timeout=30)
    p.close()


def test_replay_sends_matching_dead_letters_once_and_counts_no_visit_twice(
    stream_settings, knn_predictor, stream_corpus, tmp_path
):
    s = stream_settings
    titles = stream_corpus[0]
    pv = [encode("page_view", page_view(i, 2, titles[i], "rp")) for i in range(3)]
    _dead(s, pv[0], "state: Redis: ReadOnlyError: You can't write against a read only replica", 0)
    mid = time.time()
    time.sleep(0.05)
    _dead(s, pv[1], "state: Redis: ClusterDownError: The cluster is down", 1)
    _dead(s, pv[1], "state: Redis: ClusterDownError: The cluster is down", 1)  # twice
    _dead(s, pv[2], "predict failed: RuntimeError: bad title", 2)

    from infra.cli import cli

    env = settings_env(s)
    since = datetime.fromtimestamp(mid, UTC).isoformat()
    res = CliRunner().invoke(
        cli,
        ["stream", "replay-dead-letters", "--reason", "Redis", "--since", since, "--dry-run"],
        env=env,
    )
    assert res.exit_code == 0, res.output
    dry = json.loads(res.output.strip().splitlines()[-1])
    assert (dry["read"], dry["matched"], dry["repeated_in_run"], dry["sent"]) == (4, 2, 1, 0)
    assert read_all_messages(s, s.topics.page_views, "page_view", timeout=2) == []

    from stream.dead_letter_replay import replay_dead_letters

    first = replay_dead_letters(s, "Redis")
    again = replay_dead_letters(s, "Redis")
    assert first["sent"] == again["sent"] == 2 and first["by_topic"] == {s.topics.page_views: 2}
    sent = Counter(
        m["event_id"]
        for m in read_all_messages(
            s, s.topics.page_views, "page_view", until=lambda m: len(m) >= 4, timeout=30
        )
    )
    assert sent == {"rp-0": 2, "rp-1": 2}  # the predict failure is not replayed

    w, t = worker_thread(
        s, ModelHandle.open(tmp_path, loader=lambda _p: knn_predictor), Top1Policy(), "w-replay"
    )
    try:
        answered(s, ["rp-0", "rp-1"], timeout=60)
        time.sleep(0.5)
    finally:
        w.stop()
        t.join(30)
    store = StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, s.state.k)
    stored = Counter(v.event_id for h in store.histories(["u0", "u1"]) for v in h)
    assert stored == {"rp-0": 1, "rp-1": 1}, "a replayed visit was stored twice"
    assert w.metrics.duplicates == 2
