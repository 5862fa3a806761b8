"""Click-log storage: date partitions, in-order reads, corrupt lines reported and skipped, files
readable by their owner only, each impression read once."""

import json
import os
import stat

import pytest

from engine.clicklog import (
    ClickLogError,
    ClickLogWriter,
    ReadReport,
    ad_outcomes,
    encode_record,
    partitions,
    read_log,
    validate,
)

DAY = 86400.0
T0 = 1_764_000_000.0  # 2025-11-24T16:00:00Z


def click(i, ts):
    return {"query": f"q{i}", "url": f"https://e.test/{i}", "title": f"page {i}", "ts": ts}


def test_partitions_by_utc_date_and_reads_in_time_order(tmp_path):
    with (
        ClickLogWriter(tmp_path, "search_clicks", writer_id="a") as a,
        ClickLogWriter(tmp_path, "search_clicks", writer_id="b") as b,
    ):
        a.write_many([click(0, T0), click(2, T0 + 20), click(4, T0 + DAY)])
        b.write_many([click(1, T0 + 10), click(3, T0 + 30)])
    assert partitions(tmp_path, "search_clicks") == ["2025-11-24", "2025-11-25"]
    got = [r["query"] for r in read_log(tmp_path, "search_clicks")]
    assert got == ["q0", "q1", "q2", "q3", "q4"]
    assert [r["query"] for r in read_log(tmp_path, "search_clicks", since="2025-11-25")] == ["q4"]


def test_corrupt_lines_are_counted_located_and_skipped(tmp_path):
    w = ClickLogWriter(tmp_path, "search_clicks")
    w.write_many([click(0, T0), click(1, T0 + 1)])
    w.close()
    part = tmp_path / "search_clicks" / "2025-11-24" / "part-0.jsonl"
    with open(part, "ab") as f:
        f.write(b"{not json\n")
        f.write(json.dumps({"query": "q", "url": "u", "ts": T0 + 2}).encode() + b"\n")  # no title
        f.write(json.dumps({**click(9, T0 + 3), "ts": "yesterday"}).encode() + b"\n")
        f.write(b"\xff\xfe\n")
        f.write(json.dumps(click(7, T0 + DAY * 3)).encode() + b"\n")  # wrong day
        f.write(b'{"query": "torn", "url": "u", "ti')  # killed writer
    # a new writer repairs the torn tail, so its own records stay readable
    with ClickLogWriter(tmp_path, "search_clicks") as w2:
        w2.write(click(2, T0 + 5))
    rep = ReadReport("search_clicks")
    got = [r["query"] for r in read_log(tmp_path, "search_clicks", rep)]
    assert got == ["q0", "q1", "q2"]
    assert rep.records == 3 and rep.corrupt == 6 and rep.lines == 9
    assert rep.reasons["schema"] == 2  # missing title, ts not a number
    assert rep.reasons["invalid JSON"] == 3  # garbage, bad bytes, the repaired torn line
    assert rep.reasons["wrong partition"] == 1
    assert any("part-0.jsonl:3: invalid JSON" in e for e in rep.examples)
    assert any("part-0.jsonl:4: schema: missing field 'title'" in e for e in rep.examples)


def test_unterminated_last_line_is_reported_not_read(tmp_path):
    part = tmp_path / "search_clicks" / "2025-11-24" / "part-x.jsonl"
    part.parent.mkdir(parents=True)
    part.write_bytes(json.dumps(click(0, T0)).encode() + b"\n" + json.dumps(click(1, T0)).encode())
    rep = ReadReport("search_clicks")
    assert [r["query"] for r in read_log(tmp_path, "search_clicks", rep)] == ["q0"]
    assert rep.corrupt == 1 and "torn line" in rep.examples[0]


def test_writer_rejects_invalid_records_naming_the_field(tmp_path):
    w = ClickLogWriter(tmp_path, "ad_clicks")
    with pytest.raises(ClickLogError, match="'clicked'"):
        w.write({"event_id": "e", "user_id": "u", "query": "q", "clicked": "yes", "ts": T0})
    with pytest.raises(ClickLogError, match="'propensity'"):
        validate(
            "ad_impressions",
            {
                "event_id": "e",
                "user_id": "u",
                "ts": T0,
                "query": "q",
                "candidates": ["q"],
                "propensity": 0,
            },
        )
    with pytest.raises(ClickLogError, match="unknown log kind"):
        ClickLogWriter(tmp_path, "clicks")


def test_ad_outcomes_join_clicks_to_impressions(tmp_path):
    imp = [
        {
            "event_id": f"e{i}",
            "user_id": "u1",
            "ts": T0 + i,
            "query": f"q{i}",
            "candidates": [f"q{i}", "z"],
            "propensity": 0.5,
        }
        for i in range(3)
    ]
    ClickLogWriter(tmp_path, "ad_impressions").write_many(imp)
    ClickLogWriter(tmp_path, "ad_clicks").write_many(
        [{"event_id": "e1", "user_id": "u1", "query": "q1", "clicked": True, "ts": T0 + 9}]
    )
    out = list(ad_outcomes(tmp_path))
    assert [(o["event_id"], o["clicked"]) for o in out] == [
        ("e0", False),
        ("e1", True),
        ("e2", False),
    ]


def _imp(eid, ts, query="q", **kw):
    return {"event_id": eid, "user_id": "u1", "ts": ts, "query": query, "candidates": [query], **kw}


def test_ad_outcomes_reads_each_impression_once_first_one_wins(tmp_path):
    """A repeated ad query (at-least-once worker) or a record rewritten after a click logger
    was killed between its write and its dedupe record is logged twice, across parts and days:
    training data still counts it once, the earliest copy, and the report counts the rest."""
    with ClickLogWriter(tmp_path, "ad_impressions", writer_id="a") as a:
        a.write_many([_imp("e0", T0, "first"), _imp("e1", T0 + 1), _imp("e0", T0 + 2, "again")])
    with ClickLogWriter(tmp_path, "ad_impressions", writer_id="b") as b:
        b.write_many([_imp("e1", T0 + 0.5, "b-first"), _imp("e0", T0 + DAY, "next day")])
    with ClickLogWriter(tmp_path, "ad_clicks") as c:
        click = {"event_id": "e1", "user_id": "u1", "query": "q", "clicked": True, "ts": T0 + 3}
        c.write_many([click, click])
    reports = {}
    out = list(ad_outcomes(tmp_path, reports))
    assert [(o["event_id"], o["query"], o["clicked"]) for o in out] == [
        ("e0", "first", False),
        ("e1", "b-first", True),
    ]
    assert reports["ad_impressions"].duplicates == 3 and reports["ad_impressions"].records == 5
    assert "3 duplicate event ids skipped" in reports["ad_impressions"].summary()
    assert reports["ad_impressions"].to_dict()["duplicates"] == 3


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"url": ""}, "'url' is empty"),
        ({"ts": 1e20}, "'ts' must be seconds since the epoch"),
        ({"title": "a\ud800b"}, "lone surrogate"),
        ({"candidates": ["ok", "\udfff"]}, "lone surrogate"),
        ({"extra": {1, 2}}, "not representable as JSON"),
        ({"query": None}, "missing field 'query'"),
    ],
)
def test_encode_record_refuses_what_cannot_be_logged_with_a_reason(change, reason):
    with pytest.raises(ClickLogError, match=reason):
        encode_record("ad_impressions", {**_imp("e", T0), **change})
    date, line = encode_record("ad_impressions", _imp("e", T0, "caf\u00e9 \U0001f600"))
    assert date == "2025-11-24" and json.loads(line)["query"] == "caf\u00e9 \U0001f600"


def test_absurd_timestamp_in_a_file_is_reported_not_fatal(tmp_path):
    part = tmp_path / "search_clicks" / "2025-11-24" / "part-x.jsonl"
    part.parent.mkdir(parents=True)
    part.write_bytes(
        b"".join(json.dumps(click(i, ts)).encode() + b"\n" for i, ts in [(0, T0), (1, 1e20)])
    )
    rep = ReadReport("search_clicks")
    assert [r["query"] for r in read_log(tmp_path, "search_clicks", rep)] == ["q0"]
    assert rep.reasons["schema"] == 1 and "seconds since the epoch" in rep.examples[0]


def test_log_files_and_directories_are_private_under_any_umask(tmp_path):
    old = os.umask(0)
    try:
        with ClickLogWriter(tmp_path / "logs", "ad_clicks", writer_id="w") as w:
            w.write({"event_id": "e", "user_id": "u", "query": "q", "clicked": True, "ts": T0})
        (tmp_path / "mine").mkdir(mode=0o755)
        os.umask(0o277)  # an umask that would leave the owner unable to write
        with ClickLogWriter(tmp_path / "mine", "ad_clicks", writer_id="w") as w:
            w.write({"event_id": "e", "user_id": "u", "query": "q", "clicked": True, "ts": T0})
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(os.stat(p).st_mode)

    for root, top in ((tmp_path / "logs", 0o700), (tmp_path / "mine", 0o755)):
        assert mode(root) == top  # the operator's own directory is left as it is
        assert mode(root / "ad_clicks") == 0o700
        assert mode(root / "ad_clicks" / "2025-11-24") == 0o700
        assert mode(root / "ad_clicks" / "2025-11-24" / "part-w.jsonl") == 0o600
    # a part file left world-readable by an older writer is closed to others when reopened
    part = tmp_path / "logs" / "ad_clicks" / "2025-11-24" / "part-w.jsonl"
    os.chmod(part, 0o644)
    with ClickLogWriter(tmp_path / "logs", "ad_clicks", writer_id="w") as w:
        w.write({"event_id": "f", "user_id": "u", "query": "q", "clicked": True, "ts": T0})
    assert mode(part) == 0o600
    assert [r["event_id"] for r in read_log(tmp_path / "logs", "ad_clicks")] == ["e", "f"]
