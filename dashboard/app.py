"""Astec ads dashboard (Streamlit): predictions, users, offline metrics, stream health.

Run with `astec dashboard --models DIR` (loopback by default). Reads the model directory and
Redis only; it never trains or writes. Every missing source (no model, Redis down, no
consumers) is reported on the page instead of a traceback.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `streamlit run dashboard/app.py` puts dashboard/ on sys.path
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import health, models, offline, predictions, users
from dashboard.sources import SourceError, Sources, load_sources, ping, redis_client

TITLE = "Astec ads dashboard"
PAGES = ("Predict", "Users", "Offline metrics", "Stream health")


# ---- cached resources (keyed by path + version, so a newly promoted model is picked up) --------
@st.cache_resource(max_entries=3, show_spinner="Loading the predictor ...")
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
    except Exception as e:  # noqa: BLE001 - a corrupt/partial predictor is shown, not raised
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
def _chips(ws) -> str:
    """The title's words as markdown: known ones bold green (with their vocabularies), unknown
    ones grey and struck through."""
    out = []
    for w in ws:
        if w.known:
            where = "/".join(
                n for n, f in (("words", w.encoder), ("ranker", w.ranker), ("names", w.names)) if f
            )
            out.append(f":green[**{w.word}**] :gray[({where})]")
        else:
            out.append(f":gray[~~{w.word}~~]")
    return " · ".join(out) or ":gray[(no words)]"


def _explain(
    pred, version: str, text: str, k: int, key: str, timing: bool = True, narrow: bool = False
) -> list[dict]:
    """Known words, then either the queries with who proposed them, or the no-evidence state.
    Returns the rows shown (empty on no evidence)."""
    ws = predictions.title_words(pred, text)
    known = sum(w.known for w in ws)
    st.markdown(f"**Known words: {known} of {len(ws)}** — " + _chips(ws))
    if not predictions.has_evidence(pred, text):
        st.error(
            f"**No evidence.** No word of this title is known to model version {version}: "
            "it has nothing to go on, so no query is shown (an unrelated ad is worse "
            "than none)."
        )
        with st.expander(
            "What the model would return anyway (its popular prior queries: "
            "NOT evidence, never shown as predictions)"
        ):
            ids, scores = pred.predict_one(text, k)
            st.dataframe(
                pd.DataFrame(
                    [
                        {
                            "query": pred.label_names[i],
                            "score": round(float(s), 4),
                            "evidence": "none (prior)",
                        }
                        for i, s in zip(ids.tolist(), scores.tolist(), strict=True)
                        if i >= 0
                    ]
                ),
                hide_index=True,
                key=f"prior-{key}",
            )
        return []
    t0 = time.perf_counter()
    pred.predict_one(text, k)
    first_ms = (time.perf_counter() - t0) * 1000
    reps = []
    for _ in range(5):  # warm repeats: one title's latency without first-call effects
        t0 = time.perf_counter()
        pred.predict_one(text, k)
        reps.append((time.perf_counter() - t0) * 1000)
    rows = predictions.prediction_rows(pred, text, k, short=narrow)
    if timing:
        c1, c2, c3 = st.columns(3)
        c1.metric("Latency (median of 5, warm)", f"{float(np.median(reps)):.2f} ms")
        c2.metric("First call", f"{first_ms:.2f} ms")
        c3.metric("Queries returned", len(rows))
    if not rows:
        st.warning("The model returned no queries for this text.")
        return []
    st.dataframe(
        pd.DataFrame(rows),
        hide_index=True,
        key=f"pred-{key}",
        column_order=("rank", "query", "score", "proposed by") if narrow else None,
        column_config={
            "query": st.column_config.TextColumn(width="medium"),
            "proposed by": st.column_config.TextColumn(width="medium" if narrow else "large"),
        },
    )
    return rows


def page_predict(src: Sources) -> None:
    st.header("Predict: page title → queries")
    ref, pred = _current_predictor(src)
    if pred is None:
        return
    st.caption(
        f"Model version **{ref.version}** · {pred.num_labels} labels · D={pred.dim} · "
        f"{len(pred.learners)} learner(s) · `{ref.path}`"
    )
    text = st.text_input(
        "Page title",
        key="title",
        placeholder="e.g. Debian -- Details of package openssh-server in bookworm",
    )
    k = st.slider("k (queries shown)", 1, 50, 10, key="k")
    versions = models.version_predictors(src.models_dir)
    compare = len(versions) >= 2 and st.toggle(
        f"Compare two model versions side by side ({len(versions)} in the registry)", key="compare"
    )
    if len(versions) < 2:
        st.caption(
            f"Side-by-side comparison: {len(versions)} model version here; it needs two "
            "(`astec retrain` adds one, `astec demo --retrain` too)."
        )
    if not text.strip():
        st.info(
            "Type a page title to see the queries the model predicts for it, the title's "
            "known words and which index proposed each query."
        )
        return
    if not compare:
        st.caption(
            "'proposed by': the shortlist source that put the query up for scoring — "
            "similar training pages (ANNS^x), label centres (ANNS^μ), the label-name "
            "match, or the always-scored popular prior."
        )
        _explain(pred, ref.version, text, k, "main")
        return
    names = [v.version for v in versions]
    cols = st.columns(2)
    shown: list[list[dict]] = []
    for c, (label, default) in zip(cols, (("Version A", 0), ("Version B", 1)), strict=True):
        with c:
            v = st.selectbox(label, names, index=default, key=f"ver-{label[-1]}")
            vref = versions[names.index(v)]
            try:
                p = _predictor(str(vref.path), vref.version)
            except Exception as e:  # noqa: BLE001 - a refused version is shown, not raised
                st.error(f"{vref.path}: not loadable ({type(e).__name__}: {e})")
                shown.append([])
                continue
            st.caption(f"**{v}**{' (current)' if v == ref.version else ''} · {p.num_labels} labels")
            shown.append(_explain(p, v, text, k, label[-1], timing=False, narrow=True))
    st.caption(
        "proposed by: pages = similar training pages (ANNS^x), centres = label centres "
        "(ANNS^μ), name = label-name match, prior = popular prior. Hidden to fit: the "
        "label ids and the latency (shown with the toggle off)."
    )
    if all(shown):
        d = predictions.compare(*shown)
        diff = "".join(
            f"  \nonly in {w}: " + ", ".join(f"`{q}`" for q in qs)
            for w, qs in (("A", d["only_a"]), ("B", d["only_b"]))
            if qs
        )
        st.markdown(
            f"**A vs B:** {d['shared']} of {len(shown[0])} queries shared; top query "
            f"{'the same' if d['same_top1'] else 'differs'}.{diff}"
        )


def _user_log(src: Sources, uid: str):
    """(impressions by event id, clicks) of a user from the click log, cached on the log's
    newest part files' sizes (a growing log is re-read, an unchanged one is not)."""
    if src.logs_dir is None:
        return {}, []
    stamp = tuple(
        (str(p), p.stat().st_size)
        for p in sorted(Path(src.logs_dir).glob("*/*/part-*.jsonl"))[-12:]
    )
    return _read_user_log(str(src.logs_dir), uid, stamp)


@st.cache_data(max_entries=32, show_spinner="Reading the click log ...")
def _read_user_log(logs: str, uid: str, _stamp):
    return users.read_user_log(Path(logs), uid)


def _flat_note(probs: list[float]) -> str | None:
    """Say so when the GRU hardly prefers its choice: near-equal top probabilities make the
    choice close to a draw among them, which the table alone does not make plain."""
    if len(probs) < 2 or probs[0] <= 0:
        return None
    spread = (probs[0] - probs[-1]) / probs[0]
    if spread >= 0.2:
        return None
    return (
        f"Nearly flat: the GRU's top {len(probs)} probabilities lie within {spread:.0%} of "
        f"each other (at most {probs[0]:.3f}), so it barely prefers its choice; the Astec "
        "scores show which candidates the pages themselves supported."
    )


def page_users(src: Sources) -> None:
    """A user's stored visits: the ad shown at each and why (the visit its query came from and
    the policy's margin over the page's top query), the current policy's choice, the scores
    behind it and the user's clicks."""
    st.header("Users: last K visits and the ad query chosen")
    client = _redis(src)
    if client is None:
        return
    uid = _pick_user(client, src)
    states = _user_states(client, src, uid) if uid else []
    if not states:
        return
    _ref, pred = _current_predictor(src)
    policy, how = _users_policy(src)
    try:
        imps, clicks = _user_log(src, uid)
    except Exception as e:  # noqa: BLE001 - an unreadable log must not hide the states
        imps, clicks = {}, []
        st.warning(f"{src.logs_dir}: click log not readable ({e})")
    vs = users.visits(states, pred.label_names if pred is not None else None, policy, logged=imps)
    _visits_intro(src, uid, vs, how)
    _visits_table(vs)
    _choice_details(vs)
    _clicks_section(src, imps, clicks)


def _pick_user(client, src: Sources) -> str:
    """The user id typed in the box (with the users that have stored state listed below it);
    "" until one is given."""
    try:
        recent = users.recent_users(client, src.prefix, limit=20)
    except Exception as e:  # noqa: BLE001 - a listing failure must not hide the lookup box
        recent = []
        st.caption(f"Could not list users: {e}")
    uid = st.text_input("User id", key="user_id").strip()
    if recent:
        st.caption("Users with stored state: " + ", ".join(f"`{u}`" for u in recent))
    if not uid:
        st.info("Enter a user id to see the user's stored visits (newest first).")
    return uid


def _user_states(client, src: Sources, uid: str) -> list:
    """The user's decodable states, oldest first, saying so when records were skipped or
    there are none."""
    states, bad = users.read_states(client, src.prefix, uid)
    if bad:
        st.warning(f"{bad} stored record(s) of {uid!r} could not be decoded and are skipped.")
    if not states:
        st.warning(
            f"No stored states for user {uid!r} (key "
            f"`{users.states_key(src.prefix, uid)}`): unknown user, or the state expired."
        )
    return states


def _users_policy(src: Sources):
    """(the GRU policy or None, how the choice is made, in words): top1 when none loads."""
    policy, how = None, "the top1 rule (the page's best query): no GRU policy found"
    if src.policy_dir is not None:
        try:
            policy = _policy(str(src.policy_dir))
        except Exception as e:  # noqa: BLE001 - fall back to top1, say so
            st.warning(f"{src.policy_dir}: GRU policy not loaded ({e}); showing top1 choices.")
        if policy is not None:
            how = f"the GRU policy {policy.version}"
    return policy, how


def _visits_intro(src: Sources, uid: str, vs: list, how: str) -> None:
    """What the table shows and where its titles come from."""
    st.markdown(
        f"**{len(vs)}** stored visit(s) of `{uid}`. *Chosen now*: the query "
        f"**{how}** picks at each visit from the visits before it (recomputed now). "
        "*From*: the visit the query came from (this page, or an earlier one); *margin*: the "
        "policy's probability of it minus that of the page's own top query."
    )
    if src.logs_dir is None:
        st.info(
            "Titles: the Redis state keeps only url/title hashes. Start the dashboard with "
            "`--logs DIR` (the `astec stream log-clicks --out` directory) to see each "
            "visit's title, the ad query shown then and the user's clicks."
        )
    else:
        found = sum(v.logged is not None for v in vs)
        st.caption(
            f"Titles, the query shown then and clicks from the click log "
            f"`{src.logs_dir}` ({found} of {len(vs)} visits found in its newest "
            "partitions)."
        )


def _visits_table(vs: list) -> None:
    """One row per visit, newest first (users.visit_rows); wide columns hidden."""
    st.dataframe(
        pd.DataFrame(users.visit_rows(vs)),
        hide_index=True,
        key="visits",
        column_order=(
            "time (UTC)",
            "title",
            "shown then",
            "shown from",
            "shown margin",
            "clicked",
            "chosen now",
            "chosen from",
            "chosen margin",
            "why (GRU probabilities)",
        ),
        column_config={
            "time (UTC)": st.column_config.TextColumn(width=135),
            "title": st.column_config.TextColumn(width="large"),
            "shown then": st.column_config.TextColumn(width="small"),
            "shown from": st.column_config.TextColumn(width="medium"),
            "shown margin": st.column_config.NumberColumn(width=70, format="%+.3f"),
            "clicked": st.column_config.TextColumn(width=60),
            "chosen now": st.column_config.TextColumn(width="small"),
            "chosen from": st.column_config.TextColumn(width="medium"),
            "chosen margin": st.column_config.NumberColumn(width=70, format="%+.3f"),
            "why (GRU probabilities)": st.column_config.TextColumn(width="medium"),
        },
    )
    st.caption(
        "Columns hidden to fit the page: each visit's candidates with their Astec "
        "scores, the chosen query's score, event id and URL (in the details below)."
    )


def _choice_details(vs: list) -> None:
    """Per visit, newest first: the GRU's ranking (a bar chart for the newest), the page's
    own candidates and what was shown then."""
    st.subheader("Scores behind each choice")
    for i, v in enumerate(reversed(vs)):
        lg = v.logged or {}
        title = lg.get("title") or f"title hash {v.title_hash}"
        with st.expander(
            f"{users._when(v.ts)} · {title[:90]} → {v.chosen or '(none)'}"
            + (f" (from {v.chosen_from})" if v.chosen_from else ""),
            expanded=(i == 0),
        ):
            if v.ranking:
                _ranking(v, chart=i == 0, key=f"rank-{i}")
            else:
                st.caption(
                    "No usable history before this visit: the cold-start rule takes "
                    "the page's top Astec query."
                )
            st.dataframe(
                pd.DataFrame(
                    [
                        {"candidate (this page)": n, "Astec score": round(s, 4)}
                        for n, s in v.top_queries
                    ]
                ),
                hide_index=True,
                key=f"cand-{i}",
            )
            st.caption(
                f"event `{v.event_id}` · url {lg.get('url') or v.url_hash}"
                + (
                    f" · shown then: **{lg['query']}** by {lg.get('policy', '?')}"
                    f"{' from ' + v.shown_from if v.shown_from else ''}"
                    f"{' · clicked' if lg.get('clicked') else ''}"
                    if lg
                    else ""
                )
            )


def _ranking(v, chart: bool, key: str) -> None:
    """The GRU's top candidates for one visit as a table (and a bar chart when `chart`)."""
    rk = pd.DataFrame(
        [
            {
                "query": n,
                "GRU probability": round(p, 4),
                "Astec score (best in window)": round(a, 4),
                "chosen": "◀ chosen" if n == v.chosen else "",
            }
            for n, p, a in v.ranking
        ]
    )
    st.dataframe(rk, hide_index=True, key=key)
    flat = _flat_note(rk["GRU probability"].tolist())
    if flat:
        st.caption(flat)
    if chart:
        import altair as alt

        st.altair_chart(
            alt.Chart(rk)
            .mark_bar()
            .encode(
                x=alt.X("GRU probability:Q"),
                y=alt.Y("query:N", sort="-x", title=None, axis=alt.Axis(labelLimit=300)),
                color=alt.condition(
                    alt.datum.chosen != "", alt.value("#d33"), alt.value("#4a90d9")
                ),
                tooltip=["query", "GRU probability", "Astec score (best in window)"],
            ),
            width="stretch",
        )


def _clicks_section(src: Sources, imps: dict, clicks: list) -> None:
    """The user's impressions, clicks and CTR in the click log's newest partitions."""
    st.subheader("Clicks")
    if src.logs_dir is None:
        st.caption("No click log given (--logs).")
        return
    n_imp = len(imps)
    c = st.columns(3)
    c[0].metric("Ad impressions (log)", n_imp)
    c[1].metric("Clicks", len(clicks))
    c[2].metric("CTR", f"{100 * len(clicks) / n_imp:.1f}%" if n_imp else "-")
    if clicks:
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "time (UTC)": users._when(r["ts"]),
                        "query": r["query"],
                        "on page": (imps.get(r["event_id"]) or {}).get("title", ""),
                    }
                    for r in clicks
                ]
            ),
            hide_index=True,
            key="clicks",
        )
    else:
        st.caption("No clicks by this user in the log's newest partitions.")


@st.cache_data(max_entries=16, show_spinner="Computing label-frequency bins ...")
def _bins(path: str, _mtime: float):
    from dashboard.models import _read_json

    return offline.frequency_bins(_read_json(Path(path)) or {})


def _wide_table(df: pd.DataFrame, keep: list[str], key: str) -> None:
    """A table showing `keep` columns unless 'all columns' is on; says what is hidden."""
    hidden = [c for c in df.columns if c not in keep]
    show_all = bool(hidden) and st.toggle("Show all columns", key=f"all-{key}")
    st.dataframe(
        df if show_all else df[[c for c in keep if c in df.columns]], hide_index=True, key=key
    )
    if hidden and not show_all:
        st.caption("Hidden to fit the page: " + ", ".join(hidden) + " ('Show all columns').")


def page_offline(src: Sources) -> None:
    """Offline metrics: Astec against its peers, P@k against k, each label-frequency bin's
    share of P@5, then the runs' tables and the GRU versions; each section says which command
    fills it when its source is missing."""
    st.header("Offline metrics")
    try:
        runs = models.collect_runs(src.models_dir)
    except models.ModelsError as e:
        st.warning(f"No model yet. {e}")
        runs = []
    brows = _offline_peers(src)
    _offline_pk(runs, brows)
    _offline_bins(runs)
    if runs:
        _offline_runs(runs)
    _offline_gru(src)


def _offline_peers(src: Sources) -> list[dict]:
    """Grouped bars and a table of the benchmark JSON files; returns their rows."""
    import altair as alt

    st.subheader("Astec against its peers (benchmark JSON)")
    brows, problems = offline.bench_rows(offline.find_bench(src.models_dir, src.bench_files))
    for p in problems:
        st.warning(p)
    if not brows:
        st.info(
            "No benchmark JSON: run `astec bench peers --train T --test T2 --json-out "
            "peers.json` and start the dashboard with `--bench peers.json` (or put it in "
            "the models directory)."
        )
        return brows
    points = offline.bench_metric_points(brows)
    if points:
        chart = (
            alt.Chart(pd.DataFrame(points))
            .mark_bar()
            .encode(
                x=alt.X(
                    "metric:N",
                    sort=list(offline.BENCH_METRICS),
                    title=None,
                    axis=alt.Axis(labelAngle=0),
                ),
                xOffset="method:N",
                y=alt.Y("value:Q", title="%"),
                color=alt.Color("method:N"),
                tooltip=["benchmark", "method", "metric", "value"],
            )
        )
        st.altair_chart(chart, width="stretch")
    bdf = pd.DataFrame(brows)
    _wide_table(bdf, [*offline.BENCH_TABLE, *(["error"] if "error" in bdf else [])], "bench")
    return brows


def _offline_pk(runs: list, brows: list[dict]) -> None:
    """One P@k-against-k line per run's metrics source and per benchmarked method."""
    import altair as alt

    st.subheader("P@k against k")
    pts = offline.run_pk_points(runs) + offline.bench_pk_points(brows)
    if not pts:
        st.info(
            "No P@k values: train logs, `astec evaluate --json-out` files or retrain "
            "held-out metrics give them."
        )
        return
    chart = (
        alt.Chart(pd.DataFrame(pts))
        .mark_line(point=True)
        .encode(
            x=alt.X("k:O", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("P@k:Q", title="P@k (%)"),
            color=alt.Color(
                "series:N", legend=alt.Legend(orient="bottom", columns=2, labelLimit=400)
            ),
            tooltip=["series", "k", "P@k"],
        )
    )
    st.altair_chart(chart, width="stretch")
    st.caption(
        "Series come from different data (validation splits, evaluation files, "
        "held-out days, a benchmark's test set): compare lines of the same data."
    )


def _offline_bins(runs: list) -> None:
    """Each label-frequency bin's share of P@5, per evaluation whose files are still readable."""
    import altair as alt

    st.subheader("Each label-frequency bin's share of P@5")
    bins, why_not = offline.bin_rows(runs, lambda p: _bins(str(p), p.stat().st_mtime))
    if bins:
        chart = (
            alt.Chart(pd.DataFrame(bins))
            .mark_bar()
            .encode(
                x=alt.X(
                    "bin label:N",
                    title="label bin, rarest first (mean training frequency)",
                    sort=None,
                    axis=alt.Axis(labelAngle=0),
                ),
                xOffset="version:N",
                y=alt.Y("share:Q", title="share of P@5 (%)"),
                color=alt.Color("version:N", legend=alt.Legend(orient="bottom", labelLimit=500)),
                tooltip=["version", "bin", "labels", "mean_freq", "share"],
            )
        )
        st.altair_chart(chart, width="stretch")
        st.caption(
            "Labels sorted by training frequency and cut into five equal-sized bins (as "
            "in the DeepXML paper's supplementary figure); the bins of a version add up "
            "to its P@5."
        )
    else:
        st.info(
            "No evaluation with readable test, prediction and training files: run `astec "
            "evaluate --test T --pred P --train TR --json-out MODELS/versions/V/eval.json`."
        )
    for w in why_not:
        st.caption(f"bins not computed for {w}")


def _offline_runs(runs: list) -> None:
    """The runs' metrics, the registry's versions and, per run, its training time per module."""
    st.subheader("Metrics per run")
    _wide_table(
        pd.DataFrame(models.summary_rows(runs)),
        ["run", "current", "source", "P@1", "P@3", "P@5", "PSP@1", "PSP@5"],
        "summary",
    )
    versions = models.version_rows(runs)
    if versions:
        st.subheader("Registry versions")
        _wide_table(
            pd.DataFrame(versions),
            ["version", "current", "created (UTC)", "promoted", "decision"],
            "versions",
        )
    logged = [r for r in runs if r.train_log]
    if not logged:
        return
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


def _offline_gru(src: Sources) -> None:
    """The GRU policy's versions, when a policy registry is known."""
    gru = models.gru_rows(src.policy_dir)
    if gru:
        st.subheader("GRU policy versions")
        gdf = pd.DataFrame(gru)
        _wide_table(gdf, list(gdf.columns[:8]), "gru")


WINDOWS = {"2 min": 120, "5 min": 300, "10 min": 600}  # the series keeps 600 points (10 min at 1 s)


def page_health(src: Sources) -> None:
    st.header("Stream health")
    client = _redis(src)
    if client is None:
        return
    c = st.columns([1, 1, 3])
    auto = c[0].toggle("Auto-refresh every 2 s", key="auto", value=False)
    window = c[1].selectbox("Window", list(WINDOWS), index=2, key="window")

    @st.fragment(run_every=2.0 if auto else None)
    def body():
        h = health.consumer_health(client, src.prefix, src.metrics_interval_s)
        live = len(h.rows) > h.stale
        series = health.series_frame(client, src.prefix, WINDOWS[window], anchor_last=not live)
        if not h.rows and series.empty:
            st.info(
                f"No consumer has published metrics under `{src.prefix}:metrics:` in the "
                "last hour. Start one with `astec stream run`."
            )
            return
        c = st.columns(6)
        c[0].metric("Consumers (live/stale)", f"{len(h.rows) - h.stale}/{h.stale}")
        c[1].metric("Events", f"{h.events:,}")
        c[2].metric("Events/s (live)", f"{h.events_per_s:,.1f}")
        c[3].metric("Dead letters", f"{h.dead_letters:,}")
        c[4].metric("Visits sent no query", f"{sum(r.get('no_query') or 0 for r in h.rows):,}")
        c[5].metric("Model versions", len(h.versions))
        if not live and not series.empty:
            st.warning(
                f"No live consumer: the charts show the {window} before the last point "
                f"published ({series['time'].max():%H:%M:%S} UTC); series are kept for "
                "an hour after a consumer stops."
            )
        if len(h.versions) > 1:
            st.warning(
                "Consumers serve different model versions: "
                + ", ".join(f"{v} ({n})" for v, n in sorted(h.versions.items()))
            )
        if series.empty:
            st.info("No time series yet (workers publish one point per second).")
        else:
            g = st.columns(2)
            with g[0]:
                st.markdown("**Events/s** (per consumer and all)")
                st.line_chart(health.pivot(series, "events_per_s"), height=220)
            with g[1]:
                st.markdown(
                    "**Event → ad latency, ms** (p50 and p99 of each interval, worst consumer)"
                )
                lat = pd.DataFrame(
                    {q: health.fleet(series, f"e2a_ms_{q}", how="max") for q in ("p50", "p99")}
                )
                if lat.dropna(how="all").empty:
                    st.caption("No events in this window.")
                else:
                    st.line_chart(lat, height=220, color=["#1f6fd1", "#e0463a"])
            g = st.columns(2)
            with g[0]:
                st.markdown("**Dead letters** (cumulative)")
                dead = health.pivot(series, "dead_letters")
                if dead.empty or not (dead.fillna(0).to_numpy() > 0).any():
                    st.caption("None in this window: every event was answered or skipped.")
                else:
                    st.line_chart(dead, height=200)
            with g[1]:
                st.markdown("**Consumer lag** (messages behind the partitions' ends)")
                lag = health.pivot(series, "lag")
                if lag.empty:
                    st.caption(
                        "The workers do not publish their lag yet (stream.consumer_metrics "
                        "ConsumerMetrics.lag is unset)."
                    )
                else:
                    st.line_chart(lag, height=200)
        if h.rows:
            st.subheader("Consumers now")
            _wide_table(
                pd.DataFrame(h.rows),
                [
                    "consumer",
                    "status",
                    "model_version",
                    "events",
                    "events_per_s",
                    "dead_letters",
                    "no_query",
                    "e2a_ms_p50",
                    "e2a_ms_p99",
                    "age_s",
                ],
                "consumers",
            )
            st.subheader("Where the time goes (cumulative seconds per stage)")
            st.bar_chart(pd.DataFrame(h.stages).set_index("consumer"), height=220)
        st.caption(f"Read at {time.strftime('%H:%M:%S')}")

    body()


def main() -> None:
    st.set_page_config(page_title=TITLE, layout="wide")
    src = load_sources()
    st.sidebar.title(TITLE)
    page = st.sidebar.radio("Page", PAGES, key="page")
    st.sidebar.caption(
        f"Models: `{src.models_dir}`  \nRedis: `{src.redis_display}` (prefix `{src.prefix}`)"
        f"  \nGRU policy: `{src.policy_dir or 'none (top1 rule; --policy)'}`"
        + (f" ({src.policy_how})" if src.policy_how else "")
        + f"  \nClick logs: `{src.logs_dir or 'none (--logs)'}`"
        + (f" ({src.logs_how})" if src.logs_how else "")
    )
    {
        "Predict": page_predict,
        "Users": page_users,
        "Offline metrics": page_offline,
        "Stream health": page_health,
    }[page](src)


main()
