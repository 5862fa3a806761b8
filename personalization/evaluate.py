"""Offline evaluation of the GRU policy against baselines on held-out (later) sessions.

Every policy picks one query per visit from the same candidates (the union of the window's
top-k queries); cold-start visits get the current page's top query under every policy.
Policies: gru, top1 (current page's best query), most_frequent (the query in most of the last K
pages' top-k, ties by mean score), popularity (the most searched/clicked query in the training
period among the candidates). Reference rows, not baselines: sim_rank (a fixed, untrained
ranking: the candidate's sim_block cosine plus 0.1 x frac_states plus 0.1 x mean window score;
weights chosen on a validation split of the training period) and, with an oracle model, the
Bayes-optimal rows of personalization.oracle.
Metrics (per visit, then averaged):
  intent_hit     the chosen query is in the session's latent intent sub-topic (simulator truth)
  intent_R@5     |intent candidates in the top 5| / min(5, |intent candidates|)
  intent_MRR     1 / rank of the first intent candidate (0 if none)
  click_hit      on visits whose shown ad was clicked: the chosen query is that query
  click_R@5, click_MRR   rank of the clicked query in the policy's ranking (same visits)
  ips_ctr        inverse-propensity estimate of the policy's click-through rate from the logged
                 epsilon-greedy impressions (0 credit when the logger never showed the choice)
  actual_ctr     (simulated logs) the exact click probability of the greedy choice
  served_ctr     (simulated logs) the expected click probability as served: the epsilon-mixture
                 of the greedy choice and the softmax of the policy's key at the stream's
                 exploration (personalization.policy.EPSILON, TEMPERATURE), cold-start visits
                 exploring over 8 x score_current like the GRU. The GRU's key is its logits,
                 click log-odds; a baseline's ranking key is put on the same scale first
                 (explore_scales), or its exploration would depend on the key's arbitrary unit
With strong baselines (personalization.baselines, fitted on the training period only):
session_knn, fitted_no_intent and intent_rule are baselines beside the four.
With a scenario that tires users (ad fatigue), each policy's choices tire its own users: a
choice repeating one of the user's previous `window` greedy choices earns the factor.
The GRU reads what the user was shown at its window's earlier visits (shown_recent): on the
held-out visits that is its own earlier greedy choice (replay_shown), as the stream stores what
it served, never the logger's.
A bootstrap over users gives a 95% interval of the relative lift of gru over the best baseline.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from personalization.features import N_KERNEL, EventBatch, F, cluster_lookup, sim_rank_weights
from personalization.visits import VisitLog

log = logging.getLogger(__name__)

POLICIES = ("gru", "top1", "most_frequent", "popularity")
BASELINES = POLICIES[1:]  # intent-hit baselines (the old protocol)
REFERENCES = ("sim_rank",)  # a fixed ranking: a baseline for CTR (VALUE_BASELINES)
VALUE_BASELINES = ("top1", "most_frequent", "popularity", "sim_rank")
STRONG_BASELINES = ("session_knn", "fitted_no_intent", "intent_rule")  # personalization.baselines
ORACLES = ("oracle", "oracle_no_user")  # --oracle rows (personalization.oracle)
# with a click judge (simulated logs): the best CTR on the same candidates knowing the visit's
# intent, and the Bayes-optimal CTR given the window's true page sub-topics (uniform prior)
# ... and that filter told two things a window's pages do not hold: each earlier visit's ad and
# its click outcome (bayes_clicks), the user's earlier history as its prior (bayes_profile)
VALUE_ORACLES = ("knows_intent", "bayes_window", "bayes_clicks", "bayes_profile")


@dataclass
class Truth:
    """Simulator ground truth: each session's intent sub-topic and each label's sub-topic."""

    session_intent: dict[str, int]
    label_subtopic: np.ndarray  # int64 [L], -1 for labels not in the world


def simulation_world(log_dir: str | Path) -> str | None:
    """The world directory recorded in LOG_DIR/simulation.json, if any."""
    sim = Path(log_dir) / "simulation.json"
    return json.loads(sim.read_text()).get("world") if sim.is_file() else None


def load_truth(
    log_dir: str | Path, label_names: list[str], world_dir: str | Path | None = None
) -> Truth | None:
    """Truth from LOG_DIR/truth/intents.jsonl and the world's queries.tsv, or None if absent."""
    log_dir = Path(log_dir)
    ipath = log_dir / "truth" / "intents.jsonl"
    if not ipath.is_file():
        return None
    if world_dir is None:
        world_dir = simulation_world(log_dir)
    if not world_dir or not (Path(world_dir) / "queries.tsv").is_file():
        raise FileNotFoundError(
            f"{ipath} exists but the world's queries.tsv was not found "
            f"(world: {world_dir!r}); pass --world WORLD_DIR"
        )
    intents = {}
    with open(ipath, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                intents[rec["session_id"]] = int(rec["subtopic"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{ipath}:{n}: expected {{session_id, subtopic}}: {e}") from e
    qpath = Path(world_dir) / "queries.tsv"
    sub_of = {}
    with open(qpath, encoding="utf-8") as f:
        next(f, None)
        for n, line in enumerate(f, 2):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 5:
                raise ValueError(f"{qpath}:{n}: expected 5 tab-separated fields")
            sub_of[parts[1]] = int(parts[3])
    label_sub = np.array([sub_of.get(name, -1) for name in label_names], np.int64)
    return Truth(intents, label_sub)


class OverlapError(ValueError):
    """A policy whose training/validation data may include the sessions being evaluated."""


def iso_time(ts: float | None) -> str:
    import datetime as dt

    if ts is None:
        return "?"
    return dt.datetime.fromtimestamp(float(ts), dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_held_out(
    manifest: dict, version: str | None, eval_split_ts: float | None, val_frac: float
) -> None:
    """Refuse (OverlapError) a policy that read any session starting at or after the
    evaluation's split, or that does not record what it read: an offline figure is only honest
    when the evaluated sessions were neither trained nor validated on. With
    `eval_split_ts=None` only the presence of the record is checked."""
    tr = manifest.get("train")
    if not isinstance(tr, dict):
        tr = {}
    last = tr.get("last_session_start_ts")
    if last is None:
        raise OverlapError(
            f"policy {version}: its manifest records no training data range "
            f"(train.last_session_start_ts; trained before --holdout existed), so it may have "
            f"been trained or validated on the evaluated sessions; retrain with "
            f"`astec personalize train --holdout {val_frac:g}` (or larger) and evaluate that"
        )
    if eval_split_ts is not None and float(last) >= eval_split_ts:
        raise OverlapError(
            f"policy {version} read sessions starting up to {iso_time(last)} (its data end "
            f"{iso_time(tr.get('data_end_ts'))}, holdout {tr.get('holdout', 0)}), but this "
            f"evaluation scores the sessions starting from {iso_time(eval_split_ts)} "
            f"(--val-frac {val_frac:g}): its training/validation data overlaps the evaluated "
            f"sessions; retrain with `astec personalize train --holdout {val_frac:g}` "
            f"(or larger) on these logs"
        )


def baseline_keys(b: EventBatch) -> dict[str, np.ndarray]:
    """Ranking keys [B,C] (higher = better) of the baselines from the shared features."""
    f = b.feats

    def col(name):
        return f[..., F[name]]

    return {
        "top1": col("score_current") * 4 + col("recency_score"),
        "most_frequent": col("frac_states") * 4 + col("mean_score_window"),
        "popularity": col("log_popularity") * 4 + col("mean_score_window"),
    }


def sim_rank_key(b: EventBatch, sim_norm: np.ndarray) -> np.ndarray:
    """The sim_rank reference ranking [B,C] (features.SIM_RANK: raw sim_block cosine + 0.1
    frac_states + 0.1 mean window score), from the policy's standardised features."""
    return b.feats @ sim_rank_weights(sim_norm)


def explore_scales(
    policy, v: VisitLog, train_rows: np.ndarray, log_pop, baselines=None, n: int = 20_000
) -> dict[str, float]:
    """{baseline: the scale that turns its ranking key into click log-odds}: a logistic fit
    of the logged clicks on the key of the shown query (personalization.train
    calibrate_ranking) over up to n visits with history of the training period's validation
    carve-out (personalization.baselines.carve_out, where session-kNN has not read the
    clicks). Served, a baseline then explores as the GRU does with its logits: by what a
    candidate's key says about its click odds. A key whose fitted slope is negative explores
    uniformly (scale 0), never towards the candidates it ranks last."""
    from personalization.baselines import carve_out
    from personalization.train import calibrate_ranking, make_batch

    K, ttl_s, w = policy.K, policy.ttl_s, policy.weights
    _, val = carve_out(v, train_rows)
    _, mask = v.window(val, 2, ttl_s)
    val = val[mask[:, 0] & (v.shown[val] >= 0)]
    r_all = np.sort(np.random.default_rng(0).choice(val, min(n, len(val)), replace=False))
    at: dict[str, list[np.ndarray]] = {}
    ys = []
    for a in range(0, len(r_all), 4096):
        r = r_all[a : a + 4096]
        b = make_batch(v, r, K, ttl_s, log_pop, w["sim_table"], w["sim_norm"], cluster_lookup(w))
        keys = baseline_keys(b) | {"sim_rank": sim_rank_key(b, w["sim_norm"])}
        if baselines is not None:
            keys |= baselines.keys(b, v, r, K, ttl_s, validation=True)
        eq = (b.cand_ids == v.shown[r][:, None]) & b.cand_mask
        has = np.flatnonzero(eq.any(1))
        col = eq[has].argmax(1)
        for name, key in keys.items():
            at.setdefault(name, []).append(key[has, col])
        ys.append(v.clicked[r][has].astype(np.float64))
    y = np.concatenate(ys) if ys else np.zeros(0)
    out = {}
    for name, parts in at.items():
        scale, _ = calibrate_ranking(np.concatenate(parts)[:, None], y, np.ones(1))
        out[name] = max(float(scale), 0.0)
    return out


def _ranks(key: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Candidate order [B,C] best first (padding last)."""
    return np.argsort(-np.where(mask, key, -np.inf), axis=1, kind="stable")


def _ranks_or_top1(
    key: np.ndarray, mask: np.ndarray, cold: np.ndarray, top1: np.ndarray
) -> np.ndarray:
    """_ranks of `key`, but a cold-start visit (no history) gets the top-1 rule's order (the
    current page's top query), whatever the key."""
    o = _ranks(key, mask)
    o[cold] = top1[cold]
    return o


@dataclass
class EvalResult:
    metrics: dict  # policy -> metric -> value
    per_visit: dict  # policy -> metric -> float array over the evaluated visits
    users: np.ndarray  # user index per evaluated visit
    n_visits: int
    n_cold: int
    cold: np.ndarray  # bool per evaluated visit: no history (answered by the top-1 rule)
    chosen: dict  # policy -> chosen query id per evaluated visit
    rows: np.ndarray | None = None  # the evaluated VisitLog rows
    x_chosen: dict | None = None  # policy -> [N, F+1] reward-model features of its choice
    x_shown: np.ndarray | None = None  # [N, F+1] those of the logged (shown) query


def evaluate_policies(
    policy,
    v: VisitLog,
    rows: np.ndarray,
    log_pop: np.ndarray,
    K: int,
    ttl_s: float,
    truth: Truth | None,
    batch: int = 2048,
    progress: bool = True,
    oracle=None,
    judge=None,
    baselines=None,
    exploration: tuple[float, float] | None = None,
    scales: dict[str, float] | None = None,
) -> EvalResult:
    """Score every policy on the visits `rows` (see the module docstring for the metrics);
    plus the REFERENCES rows and, with `oracle` (personalization.oracle.OracleModel), the
    ORACLES rows; with `baselines` (personalization.baselines.Baselines) STRONG_BASELINES.
    `exploration` (epsilon, temperature) of the served CTR: default the stream's; `scales`
    (explore_scales) multiply a baseline's key before its softmax (1 where not given)."""
    from personalization.oracle import oracle_keys
    from personalization.policy import EPSILON, TEMPERATURE
    from personalization.scoring import softmax_masked
    from personalization.train import make_batch

    eps, temp = exploration or (EPSILON, TEMPERATURE)
    shown_hist = replay_shown(policy, v, rows, log_pop, K, ttl_s, batch)
    names = (
        POLICIES
        + REFERENCES
        + (STRONG_BASELINES if baselines is not None else ())
        + (ORACLES if oracle is not None else ())
        + (VALUE_ORACLES if judge is not None else ())
    )
    served_names = POLICIES + REFERENCES + (STRONG_BASELINES if baselines is not None else ())
    soft_p: dict[str, list[np.ndarray]] = {p: [] for p in served_names}  # eps-part terms
    cand_all: list[np.ndarray] = []
    per: dict[str, dict[str, list[np.ndarray]]] = {
        p: {
            m: []
            for m in (
                "intent_hit",
                "intent_R@5",
                "intent_MRR",
                "click_hit",
                "click_R@5",
                "click_MRR",
                "ips_ctr",
                "has_click",
                "has_intent_cand",
                "actual_ctr",
                "in_support",
            )
        }
        for p in names
    }
    xs_all: dict[str, list[np.ndarray]] = {p: [] for p in names}
    x_shown_all = []
    n_cold = 0
    colds: list[np.ndarray] = []
    chosen_all: dict[str, list[np.ndarray]] = {p: [] for p in names}
    sess_intent = label_sub = None
    if truth is not None:
        sess_intent = np.array([truth.session_intent.get(s, -2) for s in v.session_ids], np.int64)
        label_sub = truth.label_subtopic
    for a in tqdm(
        range(0, len(rows), batch), desc="evaluate", unit="batch", leave=False, disable=not progress
    ):
        r = rows[a : a + batch]
        b = make_batch(
            v,
            r,
            K,
            ttl_s,
            log_pop,
            policy.weights["sim_table"],
            policy.weights["sim_norm"],
            cluster_lookup(policy.weights),
            shown_hist[a : a + batch],
        )
        cold = b.state_mask.sum(1) <= 1
        n_cold += int(cold.sum())
        colds.append(cold)
        keys = baseline_keys(b)
        orders = {name: _ranks(key, b.cand_mask) for name, key in keys.items()}

        # this batch's arrays bound now, not looked up when called (ruff B023)
        ranked_or_top1 = partial(_ranks_or_top1, mask=b.cand_mask, cold=cold, top1=orders["top1"])
        keys["sim_rank"] = sim_rank_key(b, policy.weights["sim_norm"])
        keys["gru"] = policy.logits(b)
        orders["sim_rank"] = ranked_or_top1(keys["sim_rank"])
        orders["gru"] = ranked_or_top1(softmax_masked(keys["gru"]))
        if baselines is not None:
            for name, key in baselines.keys(b, v, r, K, ttl_s).items():
                keys[name] = key
                orders[name] = ranked_or_top1(key)
        if oracle is not None:
            for name, key in oracle_keys(oracle, v, r, b.cand_ids, K, ttl_s).items():
                orders[name] = ranked_or_top1(key + 1e-6 * b.feats[..., F["mean_score_window"]])
        if judge is not None:
            p_true = judge.p_click(r, b.cand_ids)
            cand_all.append(b.cand_ids)
            for name in served_names:
                lg = keys[name] if name == "gru" else (scales or {}).get(name, 1.0) * keys[name]
                soft_p[name].append(_explore_part(lg, b, cold, temp) * p_true)
            orders["knows_intent"] = ranked_or_top1(
                np.where(b.cand_mask, p_true, -1.0) + 1e-6 * b.feats[..., F["mean_score_window"]]
            )
            for name, kw in (
                ("bayes_window", {}),
                ("bayes_clicks", {"clicks": True}),
                ("bayes_profile", {"profile": True}),
            ):
                post = judge.window_posterior(v, r, K, ttl_s, **kw)
                orders[name] = ranked_or_top1(
                    np.where(b.cand_mask, judge.p_click(r, b.cand_ids, intent=post), -1.0)
                    + 1e-6 * b.feats[..., F["mean_score_window"]]
                )
        ranked = {name: np.take_along_axis(b.cand_ids, o, 1) for name, o in orders.items()}
        shown, clicked = v.shown[r], v.clicked[r]
        x_shown_all.append(_reward_features(b, shown))
        prop = v.propensity[r]
        if sess_intent is not None and label_sub is not None:
            intent = sess_intent[v.session[r]]
            if judge is not None:  # the intent at the visit (it drifts within sessions)
                intent = np.where(judge.visit_intent[r] >= 0, judge.visit_intent[r], -2)
            sub = np.where(b.cand_ids >= 0, label_sub[np.maximum(b.cand_ids, 0)], -3)
        for name, ids in ranked.items():
            d = per[name]
            chosen = ids[:, 0]
            chosen_all[name].append(chosen)
            xs_all[name].append(_reward_features(b, chosen))
            d["in_support"].append(v.in_logged(r, chosen))
            if judge is not None:
                d["actual_ctr"].append(judge.p_click(r, chosen))
            d["click_hit"].append((chosen == shown) & clicked)
            d["has_click"].append(clicked)
            d["ips_ctr"].append(((chosen == shown) & clicked) / prop)
            pos = np.argmax(ids == shown[:, None], axis=1)
            found = (ids == shown[:, None]).any(1) & clicked
            d["click_R@5"].append(found & (pos < 5))
            d["click_MRR"].append(np.where(found, 1.0 / (pos + 1), 0.0))
            if sess_intent is not None:
                rel = np.take_along_axis(sub, orders[name], 1) == intent[:, None]
                n_rel = rel.sum(1)
                d["has_intent_cand"].append(n_rel > 0)
                d["intent_hit"].append(rel[:, 0])
                d["intent_R@5"].append(rel[:, :5].sum(1) / np.maximum(np.minimum(n_rel, 5), 1))
                first = np.argmax(rel, axis=1)
                d["intent_MRR"].append(np.where(n_rel > 0, 1.0 / (first + 1), 0.0))
    per_visit = {
        p: {m: np.concatenate(x).astype(np.float64) for m, x in d.items() if x}
        for p, d in per.items()
    }
    if judge is not None and len(rows):
        rows_a = np.asarray(rows)
        chosen_c = {p: np.concatenate(c) for p, c in chosen_all.items()}
        window, factor = judge.fatigue
        cands = _pad_concat(cand_all, -1)
        for p in names:
            pv = per_visit[p]
            tired = None
            if window > 0:
                prev = _previous_choices(v.user[rows_a], v.ts[rows_a], chosen_c[p], window)
                again = (chosen_c[p][:, None] == prev).any(1) & (chosen_c[p] >= 0)
                pv["actual_ctr"] = pv["actual_ctr"] * np.where(again, factor, 1.0)
                tired = (cands[:, :, None] == prev[:, None, :]).any(2) & (cands >= 0)
            if p in soft_p:
                sp_ = _pad_concat(soft_p[p], 0.0)
                if tired is not None:
                    sp_ = sp_ * np.where(tired, factor, 1.0)
                pv["served_ctr"] = (1.0 - eps) * pv["actual_ctr"] + eps * sp_.sum(1)
    metrics = {}
    for p, pv in per_visit.items():
        m: dict[str, float] = {}
        hc = pv["has_click"].astype(bool)
        for k in (
            "intent_hit",
            "intent_R@5",
            "intent_MRR",
            "ips_ctr",
            "actual_ctr",
            "served_ctr",
            "in_support",
        ):
            if k in pv:
                m[k] = float(pv[k].mean())
        for k in ("click_hit", "click_R@5", "click_MRR"):
            m[k] = float(pv[k][hc].mean()) if hc.any() else float("nan")
        if "has_intent_cand" in pv:
            m["intent_in_candidates"] = float(pv["has_intent_cand"].mean())
        metrics[p] = m
    return EvalResult(
        metrics,
        per_visit,
        v.user[rows],
        len(rows),
        n_cold,
        np.concatenate(colds) if colds else np.zeros(0, bool),
        {p: np.concatenate(c) if c else np.zeros(0, np.int64) for p, c in chosen_all.items()},
        rows=np.asarray(rows),
        x_chosen={p: np.concatenate(x) for p, x in xs_all.items() if x},
        x_shown=np.concatenate(x_shown_all) if x_shown_all else None,
    )


def _gru_greedy(policy, b: EventBatch) -> np.ndarray:
    """[B] the GRU's greedy choice as evaluate_policies takes it (cold start: the top-1 rule)."""
    from personalization.scoring import softmax_masked

    cold = b.state_mask.sum(1) <= 1
    top1 = _ranks(baseline_keys(b)["top1"], b.cand_mask)
    o = _ranks_or_top1(softmax_masked(policy.logits(b)), b.cand_mask, cold, top1)
    return b.cand_ids[np.arange(len(o)), o[:, 0]]


def replay_shown(
    policy, v: VisitLog, rows: np.ndarray, log_pop: np.ndarray, K: int, ttl_s: float, batch=2048
) -> np.ndarray:
    """int64 [N, K]: for each evaluated visit, the query the GRU itself chose (greedy) at each
    of its window's earlier evaluated visits, -1 elsewhere (visits before the evaluated ones,
    and the current slot). The policy reads what it showed; replaying each user's visits in
    order (one step per visit rank, all users at once) gives it its own choices, as the stream
    would store them, and not the logger's. `rows` sorted by (user, ts), as VisitLog rows are."""
    from personalization.train import make_batch

    rows = np.asarray(rows, np.int64)
    n = len(rows)
    idx, mask = v.window(rows, K, ttl_s)
    pos = np.minimum(np.searchsorted(rows, idx), max(n - 1, 0))
    hpos = np.where(mask & (n > 0) & (rows[pos] == idx), pos, -1) if n else idx
    hpos[:, -1] = -1
    u = v.user[rows]
    first = np.r_[True, u[1:] != u[:-1]] if n else np.zeros(0, bool)
    at = np.arange(n)
    step = at - np.maximum.accumulate(np.where(first, at, 0)) if n else at
    chosen = np.full(n, -1, np.int64)
    w = policy.weights
    cl = cluster_lookup(w)
    for s in range(int(step.max()) + 1 if n else 0):
        sel = np.flatnonzero(step == s)
        for a in range(0, len(sel), batch):
            c = sel[a : a + batch]
            sh = np.where(hpos[c] >= 0, chosen[np.maximum(hpos[c], 0)], -1)
            b = make_batch(v, rows[c], K, ttl_s, log_pop, w["sim_table"], w["sim_norm"], cl, sh)
            chosen[c] = _gru_greedy(policy, b)
    return np.where(hpos >= 0, chosen[np.maximum(hpos, 0)], -1)


def _explore_part(key: np.ndarray, b: EventBatch, cold: np.ndarray, temp: float) -> np.ndarray:
    """[B, C] softmax(key / temperature) over the candidates: the exploring share's choice
    probabilities (cold-start visits: over 8 x score_current, the GRU's cold-start logits)."""
    from personalization.scoring import softmax_masked

    lg = np.where(cold[:, None], 8.0 * b.feats[..., F["score_current"]], key)
    lg = np.where(b.cand_mask, lg, -np.inf)
    has = b.cand_mask.any(1)
    lg[~has, 0] = 0.0
    out = softmax_masked(lg / max(temp, 1e-6))
    out[~has] = 0.0
    return out


def _pad_concat(parts: list[np.ndarray], fill) -> np.ndarray:
    """Row-concatenate [B_i, C_i] arrays, padding the columns to the widest."""
    C = max((p.shape[1] for p in parts), default=0)
    return (
        np.concatenate(
            [np.pad(p, ((0, 0), (0, C - p.shape[1])), constant_values=fill) for p in parts]
        )
        if parts
        else np.zeros((0, 0))
    )


def _previous_choices(user, ts, chosen, window: int) -> np.ndarray:
    """[N, window] the same user's previous `window` choices (time order; -1 where none)."""
    o = np.lexsort((ts, user))
    u, c = user[o], chosen[o]
    prev = np.full((len(o), window), -1, np.int64)
    for lag in range(1, window + 1):  # one vectorised shift per lag
        same = u[lag:] == u[:-lag]
        prev[lag:, lag - 1] = np.where(same, c[:-lag], -1)
    out = np.empty_like(prev)
    out[o] = prev
    return out


def _reward_features(b: EventBatch, q: np.ndarray) -> np.ndarray:
    """[B, F+1] hand features of query q[b] among the visit's candidates (zeros and a 0
    indicator when it is not one): the inputs of the evaluation's DR reward model. Only the
    page-history columns (the kernel's): shown_recent holds the GRU's own replayed choices here
    (replay_shown), which say nothing of what the logged query's user had been shown."""
    eq = (b.cand_ids == q[:, None]) & (q[:, None] >= 0)
    has = eq.any(1)
    x = b.feats[np.arange(len(q)), eq.argmax(1)][:, :N_KERNEL] * has[:, None]
    return np.concatenate([x, has[:, None].astype(np.float32)], 1)


def value_summary(res: EvalResult, v: VisitLog, n_boot: int = 1000, seed: int = 0) -> dict:
    """Per policy: actual CTR (when judged), SNIPS and DR with intervals, support share and
    ESS; the GRU against each value baseline (paired, user-clustered)."""
    from personalization.value import crossfit_reward, mean_ci, off_policy, paired_bootstrap

    rows, x_shown, x_chosen = res.rows, res.x_shown, res.x_chosen
    if rows is None or x_shown is None or x_chosen is None:
        raise ValueError("value_summary needs evaluate_policies' rows and reward features")
    users = res.users
    names = list(res.chosen)
    shown, clicked, prop = v.shown[rows], v.clicked[rows], v.propensity[rows]
    has = shown >= 0
    out: dict = {"policies": {}, "vs_baselines": {}}
    r_shown, r_ch = crossfit_reward(x_shown, clicked, has, users, [x_chosen[p] for p in names])
    judged = "actual_ctr" in res.per_visit["gru"]
    for p, rc in zip(names, r_ch, strict=True):
        d = res.per_visit[p]
        rec = {"intent_hit": res.metrics[p].get("intent_hit", float("nan"))}
        if judged:
            est, lo, hi = mean_ci(d["actual_ctr"], users, n_boot, seed)
            rec.update(actual_ctr=est, actual_ctr_ci95=[lo, hi])
            if "served_ctr" in d:
                est, lo, hi = mean_ci(d["served_ctr"], users, n_boot, seed)
                rec.update(served_ctr=est, served_ctr_ci95=[lo, hi])
        if has.any():
            rec.update(
                off_policy(
                    res.chosen[p][has],
                    shown[has],
                    clicked[has],
                    prop[has],
                    d["in_support"][has].astype(bool),
                    rc[has],
                    r_shown[has],
                    users[has],
                    n_boot,
                    seed,
                )
            )
            if judged:
                rec["dr_covers_actual"] = bool(
                    rec["dr_ci95"][0] <= rec["actual_ctr"] <= rec["dr_ci95"][1]
                )
        out["policies"][p] = rec
    if judged:
        bases = [b for b in VALUE_BASELINES + STRONG_BASELINES if b in res.per_visit]
        for bname in bases:
            out["vs_baselines"][bname] = paired_bootstrap(
                res.per_visit["gru"]["actual_ctr"],
                res.per_visit[bname]["actual_ctr"],
                users,
                n_boot,
                seed,
            )
        pol = out["policies"]
        best = max(bases, key=lambda n: pol[n]["actual_ctr"])
        out["best_baseline"] = best
        if "served_ctr" in pol["gru"]:  # the targets are judged on what is served
            sbest = max(bases, key=lambda n: pol[n]["served_ctr"])
            out["served_best_baseline"] = sbest
            out["served_vs_best"] = paired_bootstrap(
                res.per_visit["gru"]["served_ctr"],
                res.per_visit[sbest]["served_ctr"],
                users,
                n_boot,
                seed,
            )
        if "bayes_window" in pol:
            gap = pol["bayes_window"]["actual_ctr"] - pol[best]["actual_ctr"]
            out["gap_closed"] = (
                (pol["gru"]["actual_ctr"] - pol[best]["actual_ctr"]) / gap
                if gap > 0
                else float("nan")
            )
        out["targets"] = {
            "ctr_ratio_vs_best": pol["gru"]["actual_ctr"] / max(pol[best]["actual_ctr"], 1e-12),
            "paired_lo_vs_best": out["vs_baselines"][best]["diff_ci95"][0],
            "intent_hit_minus_sim_rank": pol["gru"]["intent_hit"] - pol["sim_rank"]["intent_hit"],
        }
        if "served_best_baseline" in out:
            sb = out["served_best_baseline"]
            out["targets"].update(
                served_ratio_vs_best=pol["gru"]["served_ctr"] / max(pol[sb]["served_ctr"], 1e-12),
                served_paired_lo_vs_best=out["served_vs_best"]["diff_ci95"][0],
            )
        if "knows_intent" in pol:
            out["targets"]["headroom"] = pol["knows_intent"]["actual_ctr"] / max(
                pol[best]["actual_ctr"], 1e-12
            )
        # what seeing the window's true page sub-topics would earn; with the user's history
        for ref, key in (
            ("bayes_window", "window_headroom"),
            ("bayes_profile", "profile_headroom"),
        ):
            if ref in pol:
                out["targets"][key] = pol[ref]["actual_ctr"] / max(pol[best]["actual_ctr"], 1e-12)
    return out


def bootstrap_lift(
    num: np.ndarray, den: np.ndarray, users: np.ndarray, n_boot: int = 1000, seed: int = 0
) -> dict:
    """Relative lift mean(num)/mean(den) - 1 with a 95% percentile interval, resampling users."""
    u, inv = np.unique(users, return_inverse=True)
    sn = np.bincount(inv, weights=num, minlength=len(u))
    sd = np.bincount(inv, weights=den, minlength=len(u))
    rng = np.random.default_rng(seed)
    lifts = np.empty(n_boot)
    for i in range(n_boot):  # each draw is one vectorised resample of all users
        w = np.bincount(rng.integers(0, len(u), len(u)), minlength=len(u))
        lifts[i] = (w @ sn) / max(float(w @ sd), 1e-12) - 1.0
    point = sn.sum() / max(sd.sum(), 1e-12) - 1.0
    lo, hi = np.percentile(lifts, [2.5, 97.5])
    return {
        "lift": float(point),
        "ci95": [float(lo), float(hi)],
        "users": len(u),
        "bootstrap": n_boot,
    }


def summarize(res: EvalResult, metric: str = "intent_hit") -> dict:
    """Best baseline on `metric` and the gru's relative lift over it with a bootstrap CI."""
    if metric not in res.per_visit["gru"]:
        return {}
    best = max(BASELINES, key=lambda p: res.metrics[p][metric])
    num, den = res.per_visit["gru"][metric], res.per_visit[best][metric]
    users = res.users
    if metric.startswith("click_"):
        keep = res.per_visit["gru"]["has_click"].astype(bool)
        num, den, users = num[keep], den[keep], users[keep]
    return {
        "metric": metric,
        "best_baseline": best,
        "gru": res.metrics["gru"][metric],
        "baseline": res.metrics[best][metric],
        **bootstrap_lift(num, den, users),
    }
