"""Astec ads dashboard (Streamlit): predictions, users, offline metrics, stream health.

Run with `astec dashboard --models DIR` (loopback by default). Reads the model directory and
Redis only; it never trains or writes. Every missing source (no model, Redis down, no
consumers) is reported on the page instead of a traceback.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # `streamlit run dashboard/app.py` puts dashboard/ on sys.path
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import health, models, users
from dashboard.sources import SourceError, Sources, load_sources, ping, redis_client

TITLE = "Astec ads dashboard"
PAGES = ("Predict", "Users", "Offline metrics", "Stream health")


# ---- cached resources (keyed by path + version, so a newly promoted model is picked up) --------
@st.cache_resource(max_entries=2, show_spinner="Loading the predictor ...")
def _predictor(path: str, version: str):
    return models.load_predictor(models.PredictorRef(Path(path), version, ""))


@st.cache_resource(max_entries=2, show_spinner="Loading the GRU policy ...")
def _policy(path: str):
    return users.load_policy(Path(path))


@st.cache_resource(max_entries=4)
def _client(url: str):
    return redis_client(url)


def _current_predictor(src: Sources):
    """(ref, predictor) or (None, None) after telling the user why there is no model."""
    try:
        ref = models.resolve_predictor(src.models_dir)
    except models.ModelsError as e:
        st.warning(f"No model yet. {e}")
        return None, None
    try:
        return ref, _predictor(str(ref.path), ref.version)
    except Exception as e:   # noqa: BLE001 - a corrupt/partial predictor is shown, not raised
        st.error(f"{ref.path}: the predictor could not be loaded ({type(e).__name__}: {e})")
        return ref, None


def _redis(src: Sources):
    client = _client(src.redis_url)
    try:
        ping(client, src.redis_url)
    except SourceError as e:
        st.error(str(e))
        return None
    return client


# ---- pages ------------------------------------------------------------------------------------
def page_predict(src: Sources) -> None:
    st.header("Predict: page title → queries")
    ref, pred = _current_predictor(src)
    if pred is None:
        return
    st.caption(f"Model version **{ref.version}** · {pred.num_labels} labels · D={pred.dim} · "
               f"{len(pred.learners)} learner(s) · `{ref.path}`")
    text = st.text_input("Page title", key="title",
                         placeholder="e.g. Debian -- Details of package openssh-server in bookworm")
    k = st.slider("k (queries shown)", 1, 50, 10, key="k")
    if not text.strip():
        st.info("Type a page title to see the queries the model predicts for it.")
        return
    t0 = time.perf_counter()
    ids, scores = pred.predict_one(text, k)
    first_ms = (time.perf_counter() - t0) * 1000
    reps = []
    for _ in range(5):   # warm repeats: one title's latency without first-call effects
        t0 = time.perf_counter()
        pred.predict_one(text, k)
        reps.append((time.perf_counter() - t0) * 1000)
    names = pred.label_names
    rows = [{"rank": r + 1, "query": names[i] if 0 <= i < len(names) else f"#{i}",
             "score": round(float(s), 4), "id": int(i)}
            for r, (i, s) in enumerate(zip(ids.tolist(), scores.tolist())) if i >= 0]
    c1, c2, c3 = st.columns(3)
    c1.metric("Latency (median of 5, warm)", f"{float(np.median(reps)):.2f} ms")
    c2.metric("First call", f"{first_ms:.2f} ms")
    c3.metric("Queries returned", len(rows))
    if not rows:
        st.warning("The model returned no queries for this text (no known tokens).")
        return
    st.dataframe(pd.DataFrame(rows), hide_index=True)


def page_users(src: Sources) -> None:
    st.header("Users: last K states")
    client = _redis(src)
    if client is None:
        return
    try:
        recent = users.recent_users(client, src.prefix, limit=20)
    except Exception as e:   # noqa: BLE001 - a listing failure must not hide the lookup box
        recent = []
        st.caption(f"Could not list users: {e}")
    uid = st.text_input("User id", key="user_id").strip()
    if recent:
        st.caption("Users with stored state: " + ", ".join(f"`{u}`" for u in recent))
    if not uid:
        st.info("Enter a user id to see the user's stored visits (newest first).")
        return
    states, bad = users.read_states(client, src.prefix, uid)
    if bad:
        st.warning(f"{bad} stored record(s) of {uid!r} could not be decoded and are skipped.")
    if not states:
        st.warning(f"No stored states for user {uid!r} (key "
                   f"`{users.states_key(src.prefix, uid)}`): unknown user, or the state expired.")
        return
    ref, pred = _current_predictor(src)
    names = pred.label_names if pred is not None else None
    policy, how = None, "top1 (the page's best query)"
    if src.policy_dir is not None:
        try:
            policy = _policy(str(src.policy_dir))
        except Exception as e:   # noqa: BLE001 - fall back to top1, say so
            st.warning(f"{src.policy_dir}: GRU policy not loaded ({e}); showing top1 choices.")
        if policy is not None:
            how = f"GRU policy {policy.version}"
    vs = users.visits(states, names, policy)
    st.write(f"**{len(states)}** stored state(s) for `{uid}`; chosen ad query by **{how}**, "
             "recomputed from the states before each visit.")
    st.caption("Query names from model version "
               f"{ref.version if pred is not None else '(none: ids shown as #id)'}; states "
               "written under an older version with another label set show that version's ids.")
    st.dataframe(pd.DataFrame(users.visit_rows(vs)), hide_index=True)


def page_offline(src: Sources) -> None:
    st.header("Offline metrics")
    try:
        runs = models.collect_runs(src.models_dir)
    except models.ModelsError as e:
        st.warning(f"No model yet. {e}")
        return
    if not runs:
        st.warning(f"{src.models_dir}: no train_log.json (from `astec train`) or evaluation "
                   "JSON (from `astec evaluate --json FILE`) found.")
    else:
        st.subheader("Metrics per run")
        st.dataframe(pd.DataFrame(models.summary_rows(runs)), hide_index=True)
        versions = models.version_rows(runs)
        if versions:
            st.subheader("Registry versions")
            st.dataframe(pd.DataFrame(versions), hide_index=True)
        logged = [r for r in runs if r.train_log]
        if logged:
            st.subheader("Training time per module")
            name = st.selectbox("Run", [r.name for r in logged], key="run")
            run = next(r for r in logged if r.name == name)
            mods = pd.DataFrame(models.module_rows(run))
            if not mods.empty:
                mods["step"] = mods["learner"] + ":" + mods["module"]
                st.bar_chart(mods.set_index("step")["seconds"])
                st.dataframe(mods.drop(columns="step"), hide_index=True)
            with st.expander(f"train_log.json ({run.train_log_path})"):
                st.json(run.train_log)
            for path, ev in run.evaluations:
                with st.expander(f"evaluation {path}"):
                    st.json(ev)
    gru = models.gru_rows(src.policy_dir)
    if gru:
        st.subheader("GRU policy versions")
        st.dataframe(pd.DataFrame(gru), hide_index=True)


def page_health(src: Sources) -> None:
    st.header("Stream health")
    client = _redis(src)
    if client is None:
        return
    auto = st.toggle("Auto-refresh every 2 s", key="auto", value=False)

    @st.fragment(run_every=2.0 if auto else None)
    def body():
        h = health.consumer_health(client, src.prefix, src.metrics_interval_s)
        if not h.rows:
            st.info(f"No consumer has published metrics under `{src.prefix}:metrics:` in the "
                    "last 2 minutes. Start one with `astec stream run`.")
            return
        c = st.columns(5)
        c[0].metric("Consumers (live/stale)", f"{len(h.rows) - h.stale}/{h.stale}")
        c[1].metric("Events", f"{h.events:,}")
        c[2].metric("Events/s (live)", f"{h.events_per_s:,.1f}")
        c[3].metric("Dead letters", f"{h.dead_letters:,}")
        c[4].metric("Model versions", len(h.versions))
        if len(h.versions) > 1:
            st.warning("Consumers serve different model versions: " +
                       ", ".join(f"{v} ({n})" for v, n in sorted(h.versions.items())))
        st.dataframe(pd.DataFrame(h.rows), hide_index=True)
        st.subheader("Where the time goes (cumulative seconds per stage)")
        st.bar_chart(pd.DataFrame(h.stages).set_index("consumer"))
        st.caption(f"Read at {time.strftime('%H:%M:%S')}")

    body()


def main() -> None:
    st.set_page_config(page_title=TITLE, layout="wide")
    src = load_sources()
    st.sidebar.title(TITLE)
    page = st.sidebar.radio("Page", PAGES, key="page")
    st.sidebar.caption(f"Models: `{src.models_dir}`  \nRedis: `{src.redis_display}` "
                       f"(prefix `{src.prefix}`)  \nGRU policy: `{src.policy_dir or 'none'}`")
    {"Predict": page_predict, "Users": page_users, "Offline metrics": page_offline,
     "Stream health": page_health}[page](src)


main()
