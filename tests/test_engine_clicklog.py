"""Click-log storage: date partitions, in-order reads, and corrupt lines reported and skipped."""

import json

import pytest

from engine.clicklog import (
    ClickLogError,
    ClickLogWriter,
    ReadReport,
    ad_outcomes,
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
