"""Reference rows for `astec personalize evaluate --oracle`: the best intent hit reachable on
simulated logs, from the simulator's own generative model (evaluation only, never training).

A session continues its user's last intent or draws afresh from the user's interests w_u(s),
and drifts within the session; each view is on-intent with probability a (a page of s, drawn by
popularity) or else a popular page from anywhere. The posterior over the intent at a visit is
that hidden Markov chain filtered over the window's pages (personalization.intent_filter); with
one intent per session it is P(s | p) ∝ w_u(s) * prod_j (1 + a / (1 - a) * [sub(p_j) = s] /
pop(s)) over the session's pages, pop(s) the summed popularity of the pages of s.

The oracle picks the candidate whose sub-topic has the highest posterior: the Bayes-optimal
intent hit for a policy that sees the same candidates and the same window, but knows every
page's true sub-topic, the session boundaries, the chain's settings and (for "oracle") the
user's true interests. "oracle_no_user" uses a uniform prior (what the window's pages alone
allow). No learnt policy on these logs can beat these rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from personalization.intent_filter import chain_settings, intent_posterior


@dataclass
class OracleModel:
    """World quantities the posterior needs, indexed like the VisitLog and the label space."""

    page_subtopic: np.ndarray  # int64 [P]: sub-topic of each distinct VisitLog page, -1 unknown
    log_lr: np.ndarray  # float64 [S]: log(1 + a / (1 - a) / pop(s))
    log_prior: np.ndarray  # float64 [U, S]: log of each VisitLog user's true interest weights
    label_subtopic: np.ndarray  # int64 [L]
    persist: float = 0.0  # the simulator's intent chain (personalization.intent_filter)
    drift: float = 0.0


def load_oracle(
    world_dir: str | Path,
    log_dir: str | Path,
    titles: list[str],
    user_ids: list[str],
    label_subtopic: np.ndarray,
) -> OracleModel:
    """The oracle's model from the world files and LOG_DIR/simulation.json (its on_intent)."""
    # the world's files are read as data: personalization never imports the simulator
    wdir = Path(world_dir)
    by_title = {t: i for i, t in enumerate(titles)}
    psub = np.full(len(titles), -1, np.int64)
    spop: dict[int, float] = {}
    with open(wdir / "pages.jsonl", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            s_ = int(rec["subtopic"])
            spop[s_] = spop.get(s_, 0.0) + float(rec.get("popularity", 0.0))
            j = by_title.get(rec["title"])
            if j is not None and psub[j] < 0:
                psub[j] = s_
    S = max(max(spop, default=-1), int(np.max(label_subtopic, initial=-1))) + 1
    pop = np.zeros(S)
    pop[list(spop)] = list(spop.values())
    sim_path = Path(log_dir) / "simulation.json"
    sim = json.loads(sim_path.read_text()) if sim_path.is_file() else {}
    a = float(sim.get("settings", {}).get("on_intent", 0.7))
    a = min(max(a, 1e-6), 1 - 1e-6)
    log_lr = np.log1p(a / (1 - a) / np.maximum(pop, 1e-300))
    prior = np.full((len(user_ids), S), 1e-12)
    row = {name: j for j, name in enumerate(user_ids)}
    seen = np.zeros(len(user_ids), bool)
    with open(wdir / "truth" / "user_interests.jsonl", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            j = row.get(rec["user_id"])
            if j is not None:
                prior[j, np.asarray(rec["subtopics"], np.int64)] += rec["weights"]
                seen[j] = True
    prior[~seen] = 1.0
    prior /= prior.sum(1, keepdims=True)
    return OracleModel(
        psub, log_lr, np.log(prior), np.asarray(label_subtopic, np.int64), *chain_settings(sim)
    )


def oracle_keys(
    m: OracleModel, v, rows: np.ndarray, cand_ids: np.ndarray, K: int, ttl_s: float
) -> dict[str, np.ndarray]:
    """Ranking keys [B,C] of the oracle rows for visits `rows` (their window of K states)."""
    chain = (m.page_subtopic, m.log_lr, m.persist, m.drift)
    no_user = intent_posterior(v, rows, K, ttl_s, *chain)
    user = intent_posterior(v, rows, K, ttl_s, *chain, prior=np.exp(m.log_prior[v.user[rows]]))
    csub = np.where(cand_ids >= 0, m.label_subtopic[np.maximum(cand_ids, 0)], -1)
    out = {}
    for name, post in (("oracle", user), ("oracle_no_user", no_user)):
        logpost = np.log(np.maximum(post, 1e-300))
        key = np.take_along_axis(logpost, np.maximum(csub, 0), 1)
        out[name] = np.where(csub >= 0, key, -1e30)
    return out
