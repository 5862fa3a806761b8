"""Dashboard data access against real artifacts and real Redis: model discovery, offline metrics
(train_log.json + `astec evaluate --json-out`), user states written by the stream's StateStore, and
consumer metrics published by stream.consumer_metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dashboard import health, models, offline, predictions, users
from dashboard.sources import SourceError, find_logs, find_policy, mask_url, ping, redis_client
from testkit.dashboard_data import (
    BENCH,
    make_registry,
    publish_metrics,
    publish_series,
    store_visits,
    write_click_log,
)


# ---- models ------------------------------------------------------------------------------------
def test_resolve_predictor_follows_current_pointer(astec_predictor, tmp_path):
    from engine.registry import Registry

    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    ref = models.resolve_predictor(tmp_path / "models")
    assert (ref.version, ref.path, ref.source) == (
        v2,
        tmp_path / "models/versions" / v2 / "predictor",
        "registry",
    )
    Registry(tmp_path / "models").promote(v1)
    assert models.resolve_predictor(tmp_path / "models").version == v1
    direct = models.resolve_predictor(Path(astec_predictor))
    assert direct.source == "predictor" and direct.version.startswith("astec-")
    p = models.load_predictor(ref)
    assert p.num_labels == 1880 and len(p.label_names) == 1880


def test_resolve_predictor_says_what_is_missing(tmp_path):
    with pytest.raises(models.ModelsError, match="no such directory"):
        models.resolve_predictor(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(models.ModelsError, match="astec export"):
        models.resolve_predictor(tmp_path / "empty")
    from engine.registry import Registry

    reg = Registry(tmp_path / "reg")
    with pytest.raises(models.ModelsError, match="no promoted model version"):
        (tmp_path / "reg" / "versions").mkdir(parents=True)
        models.resolve_predictor(tmp_path / "reg")
    st = reg.stage("v-without-predictor")
    reg.commit(st)
    reg.promote(st.version)
    with pytest.raises(models.ModelsError, match=r"v-without-predictor.*no exported predictor"):
        models.resolve_predictor(tmp_path / "reg")


def test_offline_metrics_from_train_log_and_evaluation(astec_predictor, evaluation_json, tmp_path):
    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    vdir = tmp_path / "models/versions" / v2
    (vdir / "eval_test.json").write_text(evaluation_json.read_text())
    runs = models.collect_runs(tmp_path / "models")
    assert [r.name for r in runs] == [v2, v1] and runs[0].current and not runs[1].current
    # train_log.json is found through the predictor manifest's source_model.path
    log = json.loads((Path(astec_predictor).parent / "model/train_log.json").read_text())
    assert runs[0].train_log == log and runs[1].train_log == log
    ev = json.loads(evaluation_json.read_text())
    rows = models.summary_rows(runs)
    by = {(r["run"], r["source"]): r for r in rows}
    assert by[(v2, "evaluate: eval_test.json")]["P@1"] == round(ev["metrics"]["P@1"], 2)
    assert by[(v2, "evaluate: eval_test.json")]["PSP@5"] == round(ev["metrics"]["PSP@5"], 2)
    valid = log["learners"][0]["modules"]["reranker"]["valid"]
    assert by[(v2, "train_log (validation)")]["P@1"] == valid["P@1"]
    assert by[(v1, "train_log (validation)")]["points"] == 600
    assert (v1, "evaluate: eval_test.json") not in by
    hold = by[(v1, "retrain holdout")]
    assert (hold["P@1"], hold["PSP@5"], hold["points"]) == (41.5, 25.5, 77)
    assert by[(v2, f"retrain holdout: parent {v1}")]["P@1"] == 40.0
    assert (v1, "retrain holdout: parent None") not in by
    vers = models.version_rows(runs)
    assert [(v["version"], v["current"], v["decision"]) for v in vers] == [
        (v2, True, "decision 1"),
        (v1, False, "decision 0"),
    ]
    mods = {(m["learner"], m["module"]): m for m in models.module_rows(runs[0])}
    for name in ("I", "II", "IV", "reranker"):
        assert mods[("0", name)]["seconds"] == log["learners"][0]["modules"][name]["seconds"]


def test_offline_metrics_in_a_plain_run_directory(astec_predictor, evaluation_json, tmp_path):
    run = tmp_path / "runs" / "exp1"
    (run / "model").mkdir(parents=True)
    (run / "model/train_log.json").write_text(
        (Path(astec_predictor).parent / "model/train_log.json").read_text()
    )
    (run / "model/metrics.json").write_text(evaluation_json.read_text())
    (run / "model/notes.json").write_text('{"metrics": "not a table"}')
    runs = models.collect_runs(tmp_path / "runs")
    assert [r.name for r in runs] == ["exp1"]
    assert [p.name for p, _ in runs[0].evaluations] == ["metrics.json"]
    assert runs[0].train_log["num_labels"] == 1880


# ---- users -------------------------------------------------------------------------------------
def test_user_states_read_back_with_names_and_choice(
    redis_settings, astec_predictor, stream_corpus
):
    from engine.predictor import Predictor

    s = redis_settings
    pred = Predictor.load(astec_predictor)
    titles = stream_corpus[0][:6]
    ids, scores = store_visits(s, pred, titles, "u1", k=4)
    client = redis_client(s.redis.url.reveal())
    states, bad = users.read_states(client, s.redis.key_prefix, "u1")
    assert bad == 0 and [st.event_id for st in states] == ["u1-e2", "u1-e3", "u1-e4", "u1-e5"]
    vs = users.visits(states, pred.label_names, policy=None, top=3)
    names = pred.label_names
    for v, i in zip(vs, range(2, 6), strict=True):
        assert v.top_queries[0][0] == names[ids[i][0]]
        assert v.chosen == names[ids[i][int(np.argmax(scores[i]))]]
        assert len(v.top_queries) == 3
    rows = users.visit_rows(vs)
    assert rows[0]["event"] == "u1-e5"  # newest first
    assert rows[0]["time (UTC)"] == "2023-11-14 22:13:25"  # 1.7e9 + 5
    assert "u1" in users.recent_users(client, s.redis.key_prefix)
    # a record the stream did not write is counted, not fatal
    client.lpush(users.states_key(s.redis.key_prefix, "u1"), b"garbage")
    states, bad = users.read_states(client, s.redis.key_prefix, "u1")
    assert bad == 1 and len(states) == 4
    assert users.read_states(client, s.redis.key_prefix, "nobody") == ([], 0)


# ---- stream health -----------------------------------------------------------------------------
def test_consumer_health_totals_versions_and_staleness(redis_settings):
    s = redis_settings
    client = redis_client(s.redis.url.reveal())
    assert health.consumer_health(client, s.redis.key_prefix).rows == []
    publish_metrics(s, "w-a", "v1", 100, 3)
    publish_metrics(s, "w-b", "v2", 50, 2)
    h = health.consumer_health(client, s.redis.key_prefix)
    assert [r["consumer"] for r in h.rows] == ["w-a", "w-b"]
    assert (h.events, h.dead_letters, h.stale) == (150, 5, 0)
    assert h.versions == {"v1": 1, "v2": 1}
    a = h.rows[0]
    assert a["status"] == "live" and a["model_version"] == "v1" and a["events"] == 100
    assert a["e2a_ms_p50"] == pytest.approx(27.5, abs=0.01)
    assert a["no_query"] == 2 and a["batch_ms_p50"] == 20
    assert "updated_at" not in a and "predict_s" not in a  # shown as age_s / stage chart
    # a field a newer worker publishes is shown too, after the known columns
    client.hset(f"{s.redis.key_prefix}:metrics:consumer:w-a", "inflight_batches", "3")
    a = health.consumer_health(client, s.redis.key_prefix).rows[0]
    assert list(a)[-1] == "inflight_batches" and a["inflight_batches"] == 3
    assert h.stages[0]["predict"] == 0.5 and h.stages[0]["redis"] == 0.25
    later = health.consumer_health(client, s.redis.key_prefix, now=time.time() + 60)
    assert later.stale == 2 and {r["status"] for r in later.rows} == {"stale"}
    assert later.events_per_s == 0.0


def test_consumer_without_samples_publishes_nan_shown_as_no_value(redis_settings):
    """Percentiles of a consumer that has seen no event are NaN: published as "nan" (Redis takes
    no float NaN), read back as None (no value), not as a number or the text "nan"."""
    from stream.consumer_metrics import ConsumerMetrics, publish

    s = redis_settings
    client = redis_client(s.redis.url.reveal())
    publish(client, s.redis.key_prefix, ConsumerMetrics("w-idle", model_version="v1"))
    raw = client.hgetall(f"{s.redis.key_prefix}:metrics:consumer:w-idle")
    assert raw[b"e2a_ms_p50"] == b"nan" and raw[b"batch_ms_p99"] == b"nan"
    row = health.consumer_health(client, s.redis.key_prefix).rows[0]
    assert row["e2a_ms_p50"] is None and row["batch_ms_p99"] is None and row["events"] == 0


def test_nan_numbers_are_no_value():
    assert [health._num(v) for v in ("nan", float("nan"), "3.0", "2.5", "x")] == [
        None,
        None,
        3,
        2.5,
        None,
    ]
    assert health._value("events", "nan") is None and health._value("policy", "nan") == "nan"
    pts = offline.pk_points("run", {"P@1": float("nan"), "P@3": 40.0, "P@5": np.float64("nan")})
    assert [(p["k"], p["P@k"]) for p in pts] == [(3, 40.0)]


def test_unreachable_redis_is_a_clear_error_without_the_password():
    url = "redis://:s3cret@127.0.0.1:1/0"
    assert mask_url(url) == "redis://:***@127.0.0.1:1/0"
    with pytest.raises(SourceError, match=r"unreachable.*astec infra up") as e:
        ping(redis_client(url), url)
    assert "s3cret" not in str(e.value)


def test_users_chosen_query_by_a_trained_gru_policy(redis_settings, tmp_path):
    """With a GRU policy, visit i's chosen query is the policy's choice given visits 0..i-1
    (the first visit: cold start, the page's top query), as the stream would have chosen it."""
    from personalization.policy import GruPolicy
    from personalization.train import publish, train_policy
    from stream.state_store import StateStore, connect
    from testkit.policy_data import CFG, synthetic_visits, window_states

    v, rows_w, _, _ = synthetic_visits()
    weights, report = train_policy(v, rows_w, CFG, progress=False)
    publish(tmp_path / "gru", weights, CFG, {"engine_version": "synthetic", "train": report})
    s = redis_settings
    states = window_states(v, 40, 6)
    StateStore(connect(s.redis.url.reveal()), s.redis.key_prefix, k=16).append_batch(
        ["g"] * 6, states
    )
    back, _ = users.read_states(redis_client(s.redis.url.reveal()), s.redis.key_prefix, "g")
    policy = users.load_policy(tmp_path / "gru")
    assert policy is not None and users.load_policy(tmp_path / "absent") is None
    names = [f"q{i}" for i in range(v.n_labels)]
    vs = users.visits(back, names, policy)
    ref = GruPolicy.load(tmp_path / "gru", backend="numpy")
    for i, visit in enumerate(vs):
        q, sc = ref.choose(back[:i], back[i])
        assert visit.chosen == names[q] and visit.chosen_score == pytest.approx(sc, rel=1e-5)
    top = int(back[0].query_ids[int(np.argmax(back[0].scores))])
    assert vs[0].chosen == names[top]


# ---- time series of the stream metrics ----------------------------------------------------------
def test_metrics_series_is_capped_expiring_and_per_interval(redis_settings):
    from stream.consumer_metrics import SERIES_TTL_S, read_all, read_series, series_key

    s = redis_settings
    client = redis_client(s.redis.url.reveal())
    t0 = time.time() - 100
    pts = [(10, 0, [5.0] * 10)] * 5 + [(10, 1, [100.0] * 9 + [400.0])] + [(0, 0, [])]
    publish_series(s, "w-1", pts, t0, series_len=4)
    key = series_key(s.redis.key_prefix, "w-1")
    assert client.llen(key) == 4  # capped: the 7 publishes keep 4 points
    assert 0 < client.ttl(key) <= SERIES_TTL_S  # and it expires
    assert 0 < client.ttl(f"{s.redis.key_prefix}:metrics:consumers") <= SERIES_TTL_S
    series = read_series(client, s.redis.key_prefix)["w-1"]
    assert [p["t"] for p in series] == pytest.approx([t0 + 2 * i for i in range(3, 7)], abs=0.01)
    assert [p["events"] for p in series] == [40, 50, 60, 60]
    assert series[-3]["e2a_ms_p50"] == 5.0  # percentiles of that interval only
    assert series[-2]["e2a_ms_p50"] == 100.0 and series[-2]["e2a_ms_p99"] > 300
    assert series[-1]["e2a_ms_p50"] is None and series[-1]["n_e2a"] == 0
    assert series[-1]["dead_letters"] == 1 and "lag" not in series[-1]
    # the snapshot `astec stream metrics` prints keeps its fields and cumulative percentiles
    snap = read_all(client, s.redis.key_prefix)[0]
    for k in (
        "events",
        "events_per_s",
        "dead_letters",
        "e2a_ms_p50",
        "e2a_ms_p95",
        "e2a_ms_p99",
        "batch_ms_p50",
        "model_version",
        "updated_at",
        "predict_s",
    ):
        assert k in snap
    assert snap["events"] == "60" and float(snap["e2a_ms_p50"]) == 5.0
    # a point that is not JSON (written by something else) is skipped, not fatal
    client.lpush(key, b"not json")
    assert len(read_series(client, s.redis.key_prefix)["w-1"]) == 4


def test_series_frame_rates_and_lag(redis_settings):
    s = redis_settings
    now = time.time()
    m = publish_series(s, "w-a", [(20, 0, [10.0] * 20)] * 10, now - 30, step=2.0)
    m.lag = 7
    from stream.consumer_metrics import publish
    from stream.state_store import connect

    publish(connect(s.redis.url.reveal()), s.redis.key_prefix, m)
    publish_series(s, "w-b", [(10, 0, [30.0] * 10)] * 10, now - 30, step=2.0)
    client = redis_client(s.redis.url.reveal())
    f = health.series_frame(client, s.redis.key_prefix, window_s=600, now=now)
    a = f[f["consumer"] == "w-a"]
    assert a["events_per_s"].iloc[1:10].tolist() == [10.0] * 9  # 20 events per 2 s
    assert a["lag"].dropna().tolist() == [7]
    wide = health.pivot(f, "events_per_s")
    assert {"w-a", "w-b", "all"} <= set(wide.columns)
    assert wide["all"].dropna().max() == pytest.approx(15.0)
    assert health.fleet(f, "e2a_ms_p99", how="max").max() == pytest.approx(30.0)
    old = health.series_frame(client, s.redis.key_prefix, window_s=600, now=now + 3000)
    assert old.empty
    # once the workers stopped, the window can end at their last point instead of now
    last = health.series_frame(
        client, s.redis.key_prefix, window_s=600, now=now + 3000, anchor_last=True
    )
    assert set(last["consumer"]) == {"w-a", "w-b"} and len(last) == 21


# ---- predict: evidence and sources -----------------------------------------------------------
def test_predict_known_words_no_evidence_and_sources(astec_predictor):
    from engine.predictor import Predictor

    pred = Predictor.load(astec_predictor)
    ws = predictions.title_words(pred, "Debian openssh server zzqxv")
    assert [w.word for w in ws] == ["debian", "openssh", "server", "zzqxv"]
    assert [w.known for w in ws] == [True, True, True, False]
    for nothing in ("zzqxv blorfx", "", "   "):
        assert not predictions.has_evidence(pred, nothing)
    assert predictions.has_evidence(pred, "openssh server")
    # without evidence the predictor still answers with its prior labels: shown as such
    rows = predictions.prediction_rows(pred, "zzqxv blorfx", 5)
    assert rows and all(r["proposed by"] == predictions.PRIOR for r in rows)
    rows = predictions.prediction_rows(pred, "Debian -- Details of package openssh-server", 10)
    ids, _ = pred.predict_one("Debian -- Details of package openssh-server", 10)
    assert [r["id"] for r in rows] == ids.tolist()
    assert all(r["proposed by"] != "(re-scored only)" for r in rows)
    assert any(predictions.KNN in r["proposed by"] for r in rows)
    d = predictions.compare(rows, rows[1:] + rows[:1])
    assert d["shared"] == 10 and not d["same_top1"]


# ---- sources: what `astec demo` writes is found ----------------------------------------------
def test_demo_layout_policy_and_logs_found_beside_the_models(tmp_path):
    demo = tmp_path / "var/demo"
    (demo / "models/engine").mkdir(parents=True)
    assert find_policy(demo / "models/engine") is None and find_logs(demo / "models/engine") is None
    (demo / "models/gru/versions").mkdir(parents=True)
    (demo / "live-logs/ad_impressions").mkdir(parents=True)
    assert find_policy(demo / "models/engine") == (demo / "models/gru").absolute()
    assert find_logs(demo / "models/engine") == (demo / "live-logs").absolute()
    (demo / "models/engine/gru").mkdir()  # MODELS/gru wins over the sibling
    assert find_policy(demo / "models/engine") == (demo / "models/engine/gru").absolute()


# ---- users: titles and clicks from the click log ---------------------------------------------
def test_user_visits_show_titles_shown_query_and_clicks(
    redis_settings, astec_predictor, stream_corpus, tmp_path
):
    from engine.predictor import Predictor

    s = redis_settings
    pred = Predictor.load(astec_predictor)
    titles = stream_corpus[0][20:24]
    store_visits(s, pred, titles, "carol", k=8)
    write_click_log(tmp_path / "logs", "carol", titles[:3], 1.7e9, clicked=(1,))
    write_click_log(tmp_path / "logs", "dave", titles[:1], 1.7e9)
    imps, clicks = users.read_user_log(tmp_path / "logs", "carol")
    assert sorted(imps) == ["carol-e0", "carol-e1", "carol-e2"]
    assert imps["carol-e1"]["clicked"] and not imps["carol-e0"]["clicked"]
    assert [c["query"] for c in clicks] == ["shown-1"]
    states, _ = users.read_states(redis_client(s.redis.url.reveal()), s.redis.key_prefix, "carol")
    rows = users.visit_rows(users.visits(states, pred.label_names, None, logged=imps))
    assert [r["title"] for r in rows[1:]] == titles[:3][::-1]  # newest first
    assert rows[0]["title"].startswith("(not in the click log; title hash ")
    assert [r["clicked"] for r in rows] == ["", "no", "yes", "no"]
    assert rows[2]["shown then"] == "shown-1"
    assert users.read_user_log(None, "carol") == ({}, [])


# ---- offline: peers, P@k against k, label-frequency bins ---------------------------------------
def test_bench_rows_and_pk_points(tmp_path):
    (tmp_path / "peers.json").write_text(json.dumps(BENCH))
    (tmp_path / "other.json").write_text(json.dumps({"metrics": {}}))
    assert offline.find_bench(tmp_path) == [tmp_path / "peers.json"]
    rows, problems = offline.bench_rows([tmp_path / "peers.json", tmp_path / "other.json"])
    assert [r["method"] for r in rows] == ["astec", "parabel", "napkinxc-plt"]
    assert rows[1]["PSP@5"] == 31.0 and rows[2]["error"].startswith("exit status 1")
    assert len(problems) == 1 and "other.json" in problems[0]
    pts = offline.pk_points("astec", BENCH[0])
    assert [(p["k"], p["P@k"]) for p in pts] == [(1, 60.0), (3, 40.0), (5, 30.0)]
    # the chart's bars: methods that ran, only the metrics they reported; no bar for a failure
    bars = offline.bench_metric_points(rows)
    assert {b["method"] for b in bars} == {"astec", "parabel"}
    assert all(b["value"] is not None for b in bars)
    assert {"benchmark": "peers.json", "method": "astec", "metric": "PSP@5", "value": 36.0} in bars
    series = {p["series"] for p in offline.bench_pk_points(rows)}
    assert series == {"peer astec · peers.json", "peer parabel · peers.json"}


def test_bin_rows_name_the_evaluation_they_cannot_use(tmp_path):
    """One unreadable evaluation file is reported by name; the others still give their bars."""

    run = SimpleNamespace(
        name="v1", evaluations=[(tmp_path / "good.json", {}), (tmp_path / "bad.json", {})]
    )

    def compute(path):
        if path.name == "bad.json":
            raise ValueError("test file t.tsv is no longer readable")
        return {"bins": [{"bin": 1, "labels": 3, "mean_freq": 0.5, "share": 10.0}]}

    bins, why_not = offline.bin_rows([run], compute)
    assert bins == [
        {
            "version": "v1 · good.json",
            "bin": 1,
            "labels": 3,
            "mean_freq": 0.5,
            "share": 10.0,
            "bin label": "1 (0.5)",
        }
    ]
    assert why_not == ["v1 · bad.json: test file t.tsv is no longer readable"]


def test_label_frequency_bins_add_up_to_p_at_5(evaluation_json):
    ev = json.loads(evaluation_json.read_text())
    res = offline.frequency_bins(ev)
    assert [b["bin"] for b in res["bins"]] == [1, 2, 3, 4, 5]
    assert sum(b["labels"] for b in res["bins"]) == ev["num_labels"]
    means = [b["mean_freq"] for b in res["bins"]]
    assert means == sorted(means) and means[0] < means[-1]  # rarest bin first
    assert res["P@5"] == pytest.approx(ev["metrics"]["P@5"], abs=1e-3)
    assert sum(b["share"] for b in res["bins"]) == pytest.approx(res["P@5"], abs=0.01)
    with pytest.raises(ValueError, match="no longer readable"):
        offline.frequency_bins({**ev, "pred": str(evaluation_json.parent / "gone.txt")})
    with pytest.raises(ValueError, match="--train"):
        offline.frequency_bins({**ev, "train": None})
