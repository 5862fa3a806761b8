"""Each dashboard page through streamlit's AppTest, on a real exported predictor and real Redis:
what a user sees (tables, figures, messages) and that missing sources give messages, not
tracebacks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from test_dashboard_data import _publish, _store_visits, make_registry

APP = str(Path(__file__).resolve().parent.parent / "dashboard" / "app.py")
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


def test_predict_page_without_a_model_says_so(app_env, tmp_path):
    (tmp_path / "empty").mkdir()
    app_env(tmp_path / "empty")
    at = run_page("Predict")
    assert any("No model yet" in w and "astec export" in w for w in texts(at.warning))
    assert len(at.dataframe) == 0
    app_env(tmp_path / "missing")
    at = run_page("Offline metrics")
    assert any("no such directory" in w for w in texts(at.warning))


def test_users_page_lists_states_with_names(app_env, astec_predictor, stream_settings,
                                            stream_corpus, tmp_path):
    from engine.predictor import Predictor
    s = stream_settings
    make_registry(tmp_path / "models", astec_predictor)
    pred = Predictor.load(astec_predictor)
    ids, scores = _store_visits(s, pred, stream_corpus[0][10:13], "alice", k=16)
    app_env(tmp_path / "models", s.redis_url, s.redis_key_prefix)
    at = run_page("Users")
    assert any("alice" in c for c in texts(at.caption))
    at.text_input(key="user_id").input("alice").run()
    assert not at.exception, at.exception
    df = at.dataframe[0].value
    assert df["event"].tolist() == ["alice-e2", "alice-e1", "alice-e0"]
    top = [pred.label_names[ids[i][int(np.argmax(scores[i]))]] for i in (2, 1, 0)]
    assert df["chosen ad query"].tolist() == top
    assert df["top queries"].iloc[0].startswith(pred.label_names[ids[2][0]] + " (")
    assert any("top1" in m for m in texts(at.markdown))
    at.text_input(key="user_id").input("bob").run()
    assert any("No stored states for user 'bob'" in w for w in texts(at.warning))


def test_redis_down_is_a_message_on_users_and_health(app_env, tmp_path):
    app_env(tmp_path, DEAD_REDIS)
    for page in ("Users", "Stream health"):
        at = run_page(page)
        errs = texts(at.error)
        assert len(errs) == 1 and "unreachable" in errs[0] and "redis://:***@127.0.0.1:1/0" in errs[0]
        assert ":pw@" not in errs[0]


def test_offline_metrics_page_tables_and_module_timing(app_env, astec_predictor, tmp_path):
    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    app_env(tmp_path / "models")
    at = run_page("Offline metrics")
    summary = at.dataframe[0].value
    assert set(summary["run"]) == {v1, v2}
    assert set(summary["source"]) == {"train_log (validation)", "retrain holdout",
                                      f"retrain holdout: parent {v1}"}
    assert texts(at.subheader)[:3] == ["Metrics per run", "Registry versions",
                                       "Training time per module"]
    assert at.selectbox(key="run").value == v2
    mods = at.dataframe[2].value
    assert {"I", "II", "IV", "reranker"} <= set(mods["module"])
    assert len(at.get("vega_lite_chart")) == 1          # the per-module time bar chart


def test_stream_health_page_totals(app_env, stream_settings, tmp_path):
    s = stream_settings
    app_env(tmp_path, s.redis_url, s.redis_key_prefix)
    at = run_page("Stream health")
    assert any("No consumer has published metrics" in t for t in texts(at.info))
    _publish(s, "w-1", "v7", 40, 4)
    _publish(s, "w-2", "v8", 60, 1)
    at.run()
    assert not at.exception, at.exception
    m = {x.label: x.value for x in at.metric}
    assert m["Events"] == "100" and m["Dead letters"] == "5" and m["Model versions"] == "2"
    assert m["Consumers (live/stale)"] == "2/0"
    assert any("different model versions" in w for w in texts(at.warning))
    table = at.dataframe[0].value
    assert table["consumer"].tolist() == ["w-1", "w-2"]
    assert table["model_version"].tolist() == ["v7", "v8"]
