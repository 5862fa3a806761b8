"""Each dashboard page through streamlit's AppTest, on a real exported predictor and real Redis:
what a user sees (tables, figures, messages) and that missing sources give messages, not
tracebacks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from testkit.dashboard_data import (
    BENCH,
    make_registry,
    publish_metrics,
    publish_series,
    store_visits,
    write_click_log,
)
from testkit.paths import REPO

APP = str(Path(REPO) / "dashboard" / "app.py")
DEAD_REDIS = "redis://:pw@127.0.0.1:1/0"


@pytest.fixture
def app_env(monkeypatch, tmp_path):
    """Point the app at MODELS_DIR / Redis / key prefix through the env `astec dashboard` sets."""
    for var in ("ASTEC_CONFIG", "ASTEC_DASHBOARD_POLICY", "KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ASTEC_SERVICES_DIR", str(tmp_path / "no-services"))

    def setenv(models: Path, redis_url: str = DEAD_REDIS, prefix: str = "astec"):
        monkeypatch.setenv("ASTEC_MODELS_DIR", str(models))
        monkeypatch.setenv("REDIS_URL", redis_url)
        monkeypatch.setenv("ASTEC_REDIS_KEY_PREFIX", prefix)

    return setenv


def run_page(page: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    if page != "Predict":
        at.sidebar.radio(key="page").set_value(page).run()
    assert not at.exception, at.exception
    return at


def texts(elements) -> list[str]:
    return [e.value for e in elements]


def test_predict_page_shows_top_queries_of_current_version(app_env, astec_predictor, tmp_path):
    from engine.predictor import Predictor

    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    app_env(tmp_path / "models")
    at = run_page("Predict")
    assert texts(at.header) == ["Predict: page title → queries"]
    assert any("Type a page title" in t for t in texts(at.info))
    title = "Debian -- Details of package openssh-server in bookworm"
    at.text_input(key="title").input(title).run()
    at.slider(key="k").set_value(7).run()
    assert not at.exception, at.exception
    assert v2 in at.caption[0].value and "1880 labels" in at.caption[0].value
    df = at.dataframe[0].value
    ids, scores = Predictor.load(astec_predictor).predict_one(title, 7)
    names = Predictor.load(astec_predictor).label_names
    assert df["id"].tolist() == ids.tolist()
    assert df["query"].tolist() == [names[i] for i in ids]
    assert np.allclose(df["score"], np.round(scores, 4))
    lat = {m.label: m.value for m in at.metric}
    assert float(lat["Latency (median of 5, warm)"].split()[0]) > 0
    assert lat["Queries returned"] == "7"
    # promoting another version is picked up on the next rerun (no restart)
    from engine.registry import Registry

    Registry(tmp_path / "models").promote(v1)
    at.run()
    assert v1 in at.caption[0].value and f"versions/{v1}/predictor" in at.caption[0].value


def test_predict_page_no_evidence_known_words_and_two_versions(app_env, astec_predictor, tmp_path):
    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    app_env(tmp_path / "models")
    at = run_page("Predict")
    at.text_input(key="title").input("zzqxv blorfx").run()
    assert not at.exception, at.exception
    errs = texts(at.error)
    assert len(errs) == 1 and errs[0].startswith("**No evidence.**") and v2 in errs[0]
    assert any("Known words: 0 of 2" in m for m in texts(at.markdown))
    # the prior's answer sits only in a labelled expander, marked as no evidence
    assert len(at.dataframe) == 1
    assert set(at.dataframe[0].value["evidence"]) == {"none (prior)"}
    assert "NOT evidence" in at.expander[0].label
    assert not [m for m in at.metric if m.label == "Queries returned"]
    at.text_input(key="title").input("Debian openssh server zzqxv").run()
    assert any("Known words: 3 of 4" in m and "~~zzqxv~~" in m for m in texts(at.markdown))
    df = at.dataframe[0].value
    assert "proposed by" in df.columns and df["proposed by"].str.len().min() > 0
    # two versions side by side
    at.toggle(key="compare").set_value(True).run()
    assert not at.exception, at.exception
    assert at.selectbox(key="ver-A").value == v2 and at.selectbox(key="ver-B").value == v1
    assert len(at.dataframe) == 2
    assert any("A vs B:" in m and "queries shared" in m for m in texts(at.markdown))


def test_predict_page_without_a_model_says_so(app_env, tmp_path):
    (tmp_path / "empty").mkdir()
    app_env(tmp_path / "empty")
    at = run_page("Predict")
    assert any("No model yet" in w and "astec export" in w for w in texts(at.warning))
    assert len(at.dataframe) == 0
    app_env(tmp_path / "missing")
    at = run_page("Offline metrics")
    assert any("no such directory" in w for w in texts(at.warning))


def test_users_page_lists_states_with_names(
    app_env, astec_predictor, redis_settings, stream_corpus, tmp_path
):
    from engine.predictor import Predictor

    s = redis_settings
    make_registry(tmp_path / "models", astec_predictor)
    pred = Predictor.load(astec_predictor)
    ids, scores = store_visits(s, pred, stream_corpus[0][10:13], "alice", k=16)
    app_env(tmp_path / "models", s.redis.url.reveal(), s.redis.key_prefix)
    at = run_page("Users")
    assert any("alice" in c for c in texts(at.caption))
    at.text_input(key="user_id").input("alice").run()
    assert not at.exception, at.exception
    df = at.dataframe[0].value
    assert df["event"].tolist() == ["alice-e2", "alice-e1", "alice-e0"]
    top = [pred.label_names[ids[i][int(np.argmax(scores[i]))]] for i in (2, 1, 0)]
    assert df["chosen now"].tolist() == top
    assert df["candidates (Astec)"].iloc[0].startswith(pred.label_names[ids[2][0]] + " (")
    assert any("top1 rule" in m for m in texts(at.markdown))
    # no click log: the page says titles are hashes and how to get them
    assert df["title"].str.startswith("(not in the click log; title hash").all()
    assert any("--logs DIR" in m for m in texts(at.info))
    at.text_input(key="user_id").input("bob").run()
    assert any("No stored states for user 'bob'" in w for w in texts(at.warning))


def test_redis_down_is_a_message_on_users_and_health(app_env, tmp_path):
    app_env(tmp_path, DEAD_REDIS)
    for page in ("Users", "Stream health"):
        at = run_page(page)
        errs = texts(at.error)
        assert (
            len(errs) == 1 and "unreachable" in errs[0] and "redis://:***@127.0.0.1:1/0" in errs[0]
        )
        assert ":pw@" not in errs[0]


def test_offline_metrics_page_tables_and_module_timing(app_env, astec_predictor, tmp_path):
    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    app_env(tmp_path / "models")
    at = run_page("Offline metrics")
    summary = at.dataframe[0].value
    assert set(summary["run"]) == {v1, v2}
    assert set(summary["source"]) == {
        "train_log (validation)",
        "retrain holdout",
        f"retrain holdout: parent {v1}",
    }
    assert texts(at.subheader)[:6] == [
        "Astec against its peers (benchmark JSON)",
        "P@k against k",
        "Each label-frequency bin's share of P@5",
        "Metrics per run",
        "Registry versions",
        "Training time per module",
    ]
    assert any("astec bench peers" in t for t in texts(at.info))  # no benchmark yet
    assert at.selectbox(key="run").value == v2
    mods = at.dataframe[2].value
    assert {"I", "II", "IV", "reranker"} <= set(mods["module"])
    # P@k against k (validation + held-out) and the per-module time chart
    assert len(at.get("vega_lite_chart")) == 2
    # wide tables say what they hide, and show it on request
    assert any("Hidden to fit the page: points, labels" in c for c in texts(at.caption))
    at.toggle(key="all-summary").set_value(True).run()
    assert "peak_rss_mb" in at.dataframe[0].value.columns


def test_offline_metrics_peers_pk_and_frequency_bins(
    app_env, astec_predictor, evaluation_json, tmp_path, monkeypatch
):
    _v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    (tmp_path / "models/versions" / v2 / "eval_test.json").write_text(evaluation_json.read_text())
    (tmp_path / "peers.json").write_text(json.dumps(BENCH))
    monkeypatch.setenv("ASTEC_DASHBOARD_BENCH", str(tmp_path / "peers.json"))
    app_env(tmp_path / "models")
    at = run_page("Offline metrics")
    bench = at.dataframe[0].value
    assert bench["method"].tolist() == ["astec", "parabel", "napkinxc-plt"]
    # peers bar chart, P@k vs k, label-frequency bins, module time
    assert len(at.get("vega_lite_chart")) == 4
    assert any("the bins of a version add up" in c for c in texts(at.caption))


def test_stream_health_page_totals(app_env, redis_settings, tmp_path):
    s = redis_settings
    app_env(tmp_path, s.redis.url.reveal(), s.redis.key_prefix)
    at = run_page("Stream health")
    assert any("No consumer has published metrics" in t for t in texts(at.info))
    publish_metrics(s, "w-1", "v7", 40, 4)
    publish_metrics(s, "w-2", "v8", 60, 1)
    at.run()
    assert not at.exception, at.exception
    m = {x.label: x.value for x in at.metric}
    assert m["Events"] == "100" and m["Dead letters"] == "5" and m["Model versions"] == "2"
    assert m["Consumers (live/stale)"] == "2/0"
    assert any("different model versions" in w for w in texts(at.warning))
    table = at.dataframe[0].value
    assert table["consumer"].tolist() == ["w-1", "w-2"]
    assert table["model_version"].tolist() == ["v7", "v8"]


def test_stream_health_plots_the_series_over_time(app_env, redis_settings, tmp_path):
    s = redis_settings
    app_env(tmp_path, s.redis.url.reveal(), s.redis.key_prefix)
    now = time.time()
    publish_series(s, "w-1", [(20, i % 7 == 0, [10.0 + i] * 20) for i in range(40)], now - 80)
    publish_series(s, "w-2", [(10, 0, [12.0] * 10) for i in range(40)], now - 80)
    at = run_page("Stream health")
    m = {x.label: x.value for x in at.metric}
    assert m["Events"] == "1,200" and m["Consumers (live/stale)"] == "2/0"
    # events/s, latency p50/p99, dead letters; lag is named as not published
    assert len(at.get("arrow_line_chart")) + len(at.get("vega_lite_chart")) >= 3
    assert any("do not publish their lag" in c for c in texts(at.caption))
    # a window with no points left says so instead of plotting nothing
    at.selectbox(key="window").set_value("5 min").run()
    assert not at.exception


def test_users_page_titles_clicks_from_the_click_log(
    app_env, astec_predictor, redis_settings, stream_corpus, tmp_path, monkeypatch
):
    from engine.predictor import Predictor

    s = redis_settings
    make_registry(tmp_path / "demo/models/engine", astec_predictor)
    pred = Predictor.load(astec_predictor)
    titles = stream_corpus[0][30:34]
    store_visits(s, pred, titles, "erin", k=16)
    write_click_log(tmp_path / "demo/live-logs", "erin", titles, 1.7e9, clicked=(2,))
    app_env(tmp_path / "demo/models/engine", s.redis.url.reveal(), s.redis.key_prefix)
    at = run_page("Users")
    sidebar = " ".join(c.value for c in at.sidebar.caption)
    assert "live-logs" in sidebar and "found next to the models" in sidebar
    at.text_input(key="user_id").input("erin").run()
    assert not at.exception, at.exception
    df = at.dataframe[0].value
    assert df["title"].tolist() == titles[::-1]
    assert df["clicked"].tolist() == ["no", "yes", "no", "no"]
    m = {x.label: x.value for x in at.metric}
    assert (m["Ad impressions (log)"], m["Clicks"], m["CTR"]) == ("4", "1", "25.0%")
    clicks = at.dataframe[-1].value
    assert clicks["query"].tolist() == ["shown-2"] and clicks["on page"].tolist() == [titles[2]]


def test_stream_health_after_the_workers_stopped(app_env, redis_settings, tmp_path):
    """`astec demo --keep-services` stops the workers: their last minutes stay on the page."""
    s = redis_settings
    app_env(tmp_path, s.redis.url.reveal(), s.redis.key_prefix)
    publish_series(s, "w-old", [(30, 0, [12.0] * 30) for _ in range(30)], time.time() - 1500)
    at = run_page("Stream health")
    assert m_value(at, "Consumers (live/stale)") == "0/1"
    assert any(
        w.startswith("No live consumer: the charts show the 10 min before the last point")
        for w in texts(at.warning)
    )
    assert len(at.get("arrow_line_chart")) + len(at.get("vega_lite_chart")) >= 3


def m_value(at, label):
    return next(m.value for m in at.metric if m.label == label)
