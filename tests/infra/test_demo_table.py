"""The demo's table of served ads shows, beside each ad, the visit its query came from and the
policy's margin over the page's own top query, read from the click log."""

from engine.clicklog import ClickLogWriter
from infra.demo import _show_ads


def test_demo_table_names_the_source_visit_and_margin(
    astec_predictor, stream_corpus, tmp_path, capsys
):
    titles = stream_corpus[0][:3]
    recs = [
        {"event_id": f"e{i}", "user_id": "u", "ts": 1.7e9 + i, "query": f"q{i}",
         "candidates": [f"q{i}"], "title": t, "url": f"https://x/{i}"}
        for i, t in enumerate(titles)
    ]  # fmt: skip
    recs[0].update(source_visits_ago=0, source_event_id="e0", margin=0.0)
    recs[2].update(source_visits_ago=2, source_event_id="e0", margin=0.25)  # from the first page
    with ClickLogWriter(tmp_path / "logs", "ad_impressions", writer_id="t") as w:
        w.write_many(recs)
    _show_ads(tmp_path / "logs", astec_predictor, n=3)
    out = capsys.readouterr().out.splitlines()
    assert "margin" in out[1] and out[1].rstrip().endswith("from")
    first = next(line for line in out[2:] if " q0 " in line)
    third = next(line for line in out[2:] if " q2 " in line)
    second = next(line for line in out[2:] if " q1 " in line)
    assert first.rstrip().endswith("this page") and "+0.000" in first
    assert third.rstrip().endswith(f"2 visits ago: {titles[0]}"[:60]) and "+0.250" in third
    assert second.rstrip().endswith("-")  # an ad logged without its source: said plainly
