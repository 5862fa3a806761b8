"""Training data for the GRU from the click logs alone: visits, their Astec states and targets.

Page views (the browsing sequences) are joined with ad impressions + clicks (by event_id) and
with the user's search clicks; every distinct page title goes through the engine's predictor
once to get its state (z, top-k query ids, scores). Everything is columnar numpy, sorted by
(user, ts), so a visit's window of the last K states is a contiguous slice.

Targets (no ground-truth intent is used; queries are matched to label ids by their text):
  click   the ad query shown at this visit, if it was clicked
  search  queries the same user searched in the same session from this visit on (within
          `search_horizon_s`): the queries the user actually had in mind
  future  queries predicted for the user's next pages in the same session (weak, self-supervised)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engine.clicklog import ReadReport, ad_outcomes, read_log
from engine.manifest import label_space_of
from personalization.features import BLOCK_GAP_S
from personalization.gap_valley import gap_valley

log = logging.getLogger(__name__)


@dataclass
class VisitLog:
    """Page views sorted by (user, ts) with their states and log-derived targets."""

    user: np.ndarray  # int64 [N] user index
    user_ids: list[str]
    ts: np.ndarray  # float64 [N]
    session: np.ndarray  # int64 [N] session index (unique across users)
    session_ids: list[str]  # per session index: the logged session_id (or user/first-visit)
    event_ids: list[str]
    page: np.ndarray  # int64 [N] index into the page tables below
    Z: np.ndarray  # float16 [P, D] Astec features per distinct title
    IDS: np.ndarray  # int64 [P, k] top-k query ids, best first
    SC: np.ndarray  # float32 [P, k] scores
    shown: np.ndarray  # int64 [N] ad query id shown at the visit, -1 if none / unknown
    clicked: np.ndarray  # bool [N]
    propensity: np.ndarray  # float64 [N] logging policy's probability of the shown query
    search_indptr: np.ndarray  # int64 [N+1] CSR: queries searched by the user from this visit on
    search_ids: np.ndarray  # int64
    pop_q: np.ndarray  # int64: query id of every search click and clicked ad (popularity)
    pop_ts: np.ndarray  # float64: their times
    n_labels: int = 0
    titles: list[str] = field(default_factory=list)  # [P] the distinct page titles
    reports: dict = field(default_factory=dict)
    engine_version: str = ""
    label_space: str = ""  # engine.manifest.label_space of the engine that predicted IDS
    logged_indptr: np.ndarray | None = None  # int64 [N+1] CSR: candidates the logger chose among
    logged_ids: np.ndarray | None = None  # int64 label ids (-1: a name the engine lacks)
    logged_prob: np.ndarray | None = None  # float64: logger's probability of each (NaN: unlogged)
    # seconds: the gap that started a new session where the logs had no session ids (the valley
    # of the log's own gaps, personalization.gap_valley); None: sessions are the logged ones
    session_gap_s: float | None = None

    @property
    def n(self) -> int:
        return len(self.ts)

    def window(self, rows: np.ndarray, K: int, ttl_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(visit indices [B,K], mask [B,K]) of each row's last K visits (itself last) by the
        same user no older than ttl_s: what the stream's Redis state holds at that visit."""
        rows = np.asarray(rows, np.int64)
        idx = rows[:, None] - np.arange(K - 1, -1, -1)[None, :]
        safe = np.maximum(idx, 0)
        mask = (
            (idx >= 0)
            & (self.user[safe] == self.user[rows][:, None])
            & (self.ts[rows][:, None] - self.ts[safe] <= ttl_s)
        )
        # keep the mask right-aligned: a gap older than the TTL cuts everything before it
        mask = np.flip(np.cumprod(np.flip(mask, 1), axis=1), 1).astype(bool)
        return np.where(mask, idx, 0), mask

    def states(self, rows: np.ndarray, K: int, ttl_s: float):
        """Padded (z [B,K,D] float32, ids [B,K,k], scores [B,K,k], mask [B,K]) for visits."""
        idx, mask = self.window(rows, K, ttl_s)
        pg = self.page[idx]
        z = self.Z[pg].astype(np.float32)
        ids = np.where(mask[..., None], self.IDS[pg], -1)
        sc = np.where(mask[..., None], self.SC[pg], 0.0).astype(np.float32)
        return z * mask[..., None], ids, sc, mask

    def in_logged(self, rows: np.ndarray, q: np.ndarray) -> np.ndarray:
        """bool [B]: query q[b] was among the logger's candidates at visit rows[b] (inside its
        support: an exploring logger could have shown it)."""
        rows = np.asarray(rows, np.int64)
        if self.logged_indptr is None or self.logged_ids is None:
            return np.zeros(len(rows), bool)
        cnt = self.logged_indptr[rows + 1] - self.logged_indptr[rows]
        b = np.repeat(np.arange(len(rows)), cnt)
        start = np.repeat(self.logged_indptr[rows] - np.r_[0, np.cumsum(cnt)[:-1]], cnt)
        ids = self.logged_ids[start + np.arange(cnt.sum())]
        hit = np.zeros(len(rows), bool)
        hit[b[ids == np.asarray(q)[b]]] = True
        return hit & (np.asarray(q) >= 0)

    def popularity(self, before_ts: float = np.inf) -> np.ndarray:
        """Per query id: search clicks + ad clicks logged before `before_ts`."""
        keep = self.pop_ts < before_ts
        return np.bincount(self.pop_q[keep], minlength=self.n_labels).astype(np.float64)

    def future_ids(self, rows: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [B, horizon*k], scores) predicted for the next `horizon` visits of the session."""
        rows = np.asarray(rows, np.int64)
        nxt = rows[:, None] + np.arange(1, horizon + 1)[None, :]
        safe = np.minimum(nxt, self.n - 1)
        ok = (nxt < self.n) & (self.session[safe] == self.session[rows][:, None])
        pg = self.page[safe]
        ids = np.where(ok[..., None], self.IDS[pg], -1).reshape(len(rows), -1)
        sc = np.where(ok[..., None], self.SC[pg], 0.0).reshape(len(rows), -1)
        return ids, sc


def session_codes(
    user: np.ndarray, ts: np.ndarray, sid: list[str | None]
) -> tuple[np.ndarray, float | None]:
    """(session index per visit, the gap that cut them): the logged session_id where every view
    has one (gap None), else a new session after a gap at the valley of the users' gaps
    between consecutive views (gap_valley; the features' default block gap without a valley)."""
    n = len(ts)
    new = np.ones(n, bool)
    gap = None
    if n > 1:
        same_user = user[1:] == user[:-1]
        have = np.array([s is not None for s in sid])
        if have.all():
            same = np.array([a == b for a, b in zip(sid[1:], sid[:-1], strict=True)])
        else:
            d = ts[1:] - ts[:-1]
            gap = gap_valley(d[same_user])
            gap = float(BLOCK_GAP_S) if gap is None else gap
            same = d <= gap
        new[1:] = ~(same_user & same)
    return np.cumsum(new) - 1, gap


def load_visits(
    log_dir: str | Path,
    predictor,
    k: int = 10,
    search_horizon_s: float = 1800.0,
    since: str | None = None,
    until: str | None = None,
    batch: int = 2048,
    progress: bool = True,
) -> VisitLog:
    """Read the logs under log_dir and compute every visited page's state with `predictor`."""
    log_dir = Path(log_dir)
    reports = {
        kind: ReadReport(kind)
        for kind in ("page_views", "ad_impressions", "ad_clicks", "search_clicks")
    }
    views = list(read_log(log_dir, "page_views", reports["page_views"], since, until))
    if not views:
        raise FileNotFoundError(
            f"{log_dir / 'page_views'}: no page-view records ({reports['page_views'].summary()})"
        )
    name_to_id = {n: i for i, n in enumerate(predictor.label_names)}
    # --- visits sorted by (user, ts)
    uids = sorted({v["user_id"] for v in views})
    uidx = {u: i for i, u in enumerate(uids)}
    user = np.array([uidx[v["user_id"]] for v in views], np.int64)
    ts = np.array([v["ts"] for v in views], np.float64)
    order = np.lexsort((ts, user))
    views = [views[i] for i in order]
    user, ts = user[order], ts[order]
    sid = [v.get("session_id") for v in views]
    session, session_gap_s = session_codes(user, ts, sid)
    session_ids = [
        sid[i] or f"{views[i]['user_id']}/{i}"
        for i in np.flatnonzero(np.r_[True, session[1:] != session[:-1]])
    ]
    event_ids = [v["event_id"] for v in views]
    # --- ad impressions and clicks: joined to their visit by event id, else to the user's
    # latest visit at or before the impression (same title when logged)
    shown = np.full(len(views), -1, np.int64)
    clicked = np.zeros(len(views), bool)
    propensity = np.ones(len(views), np.float64)
    pos = {e: i for i, e in enumerate(event_ids)}
    imps = list(ad_outcomes(log_dir, reports))
    vi = np.array([pos.get(r["event_id"], -1) for r in imps], np.int64)
    miss = np.flatnonzero(vi < 0)
    if len(miss):
        iu = np.array([uidx.get(imps[j]["user_id"], -1) for j in miss], np.int64)
        its = np.array([imps[j]["ts"] for j in miss], np.float64)
        key = user * 1e10 + ts  # sorted: visits are sorted by (user, ts)
        cand = np.searchsorted(key, iu * 1e10 + its, side="right") - 1
        ok = (iu >= 0) & (cand >= 0)
        ok &= user[np.maximum(cand, 0)] == iu
        titles_ok = np.array(
            [
                imps[j].get("title") in (None, views[max(c, 0)]["title"])
                for j, c in zip(miss, cand, strict=True)
            ],
            bool,
        )
        vi[miss] = np.where(ok & titles_ok, cand, -1)
    unknown_q = 0
    cand_of: dict[int, tuple[list, list]] = {}
    for r, i in zip(imps, vi.tolist(), strict=True):
        if i < 0:
            continue
        q = name_to_id.get(r["query"], -1)
        unknown_q += q < 0
        shown[i] = q
        clicked[i] = r["clicked"] and q >= 0
        propensity[i] = r.get("propensity") or 1.0
        names = r.get("candidates") or []
        probs = r.get("candidate_propensities")
        cand_of[i] = (
            [name_to_id.get(n, -1) for n in names],
            probs
            if isinstance(probs, list) and len(probs) == len(names)
            else [np.nan] * len(names),
        )
    cnt = np.zeros(len(views), np.int64)
    for i, (c, _) in cand_of.items():
        cnt[i] = len(c)
    logged_indptr = np.r_[0, np.cumsum(cnt)].astype(np.int64)
    logged_ids = np.full(logged_indptr[-1], -1, np.int64)
    logged_prob = np.full(logged_indptr[-1], np.nan)
    for i, (c, pr) in cand_of.items():  # one slice assignment per impression
        logged_ids[logged_indptr[i] : logged_indptr[i + 1]] = c
        logged_prob[logged_indptr[i] : logged_indptr[i + 1]] = pr
    # --- searches by the same user: each visit gets the ones in [ts, ts + horizon] and session
    s_user, s_ts, s_q, p_q, p_ts = [], [], [], [], []
    for rec in read_log(log_dir, "search_clicks", reports["search_clicks"], since, until):
        q = name_to_id.get(rec["query"], -1)
        if q < 0:
            continue
        p_q.append(q)
        p_ts.append(rec["ts"])
        u = uidx.get(rec.get("user_id") or "")
        if u is not None:
            s_user.append(u)
            s_ts.append(rec["ts"])
            s_q.append(q)
    p_q += shown[clicked].tolist()
    p_ts += ts[clicked].tolist()
    search_indptr, search_ids = _search_targets(
        user,
        ts,
        session,
        np.array(s_user, np.int64),
        np.array(s_ts, np.float64),
        np.array(s_q, np.int64),
        search_horizon_s,
    )
    # --- states of every distinct title
    titles = [v["title"] for v in views]
    uniq, page = np.unique(np.array(titles, dtype=object).astype(str), return_inverse=True)
    D = predictor.dim
    P = len(uniq)
    Z = np.zeros((P, D), np.float16)
    IDS = np.full((P, k), -1, np.int64)
    SC = np.zeros((P, k), np.float32)
    for a in tqdm(
        range(0, P, batch), desc="astec states", unit="batch", leave=False, disable=not progress
    ):
        ids, sc, z = predictor.predict_with_features(uniq[a : a + batch].tolist(), k)
        IDS[a : a + batch, : ids.shape[1]] = ids
        SC[a : a + batch, : sc.shape[1]] = sc
        Z[a : a + batch] = z
    if unknown_q:
        log.warning("%d logged ad queries are not in the engine's label names (ignored)", unknown_q)
    return VisitLog(
        user=user,
        user_ids=uids,
        ts=ts,
        session=session,
        session_ids=session_ids,
        event_ids=event_ids,
        page=page.astype(np.int64),
        Z=Z,
        IDS=IDS,
        SC=SC,
        shown=shown,
        clicked=clicked,
        propensity=propensity,
        logged_indptr=logged_indptr,
        logged_ids=logged_ids,
        logged_prob=logged_prob,
        search_indptr=search_indptr,
        search_ids=search_ids,
        pop_q=np.array(p_q, np.int64),
        pop_ts=np.array(p_ts, np.float64),
        n_labels=len(predictor.label_names),
        titles=uniq.tolist(),
        reports={k_: r.to_dict() for k_, r in reports.items()},
        engine_version=str(getattr(predictor, "version", "")),
        label_space=label_space_of(predictor),
        session_gap_s=session_gap_s,
    )


def _search_targets(user, ts, session, s_user, s_ts, s_q, horizon):
    """CSR (indptr, ids): per visit the user's searches in [ts, ts + horizon], same session."""
    n = len(ts)
    if len(s_q) == 0:
        return np.zeros(n + 1, np.int64), np.zeros(0, np.int64)
    o = np.lexsort((s_ts, s_user))
    s_user, s_ts, s_q = s_user[o], s_ts[o], s_q[o]
    # session end per visit: the ts of the session's last visit (sessions are contiguous, 0..S-1)
    last_idx = np.r_[np.flatnonzero(session[1:] != session[:-1]), n - 1]
    sess_end = ts[last_idx[session]]
    hi_t = np.minimum(ts + horizon, sess_end + 1.0)
    key = s_user.astype(np.float64) * 1e10 + s_ts
    lo = np.searchsorted(key, user * 1e10 + ts - 1.0, side="left")
    hi = np.searchsorted(key, user * 1e10 + hi_t, side="right")
    cnt = np.maximum(hi - lo, 0)
    indptr = np.r_[0, np.cumsum(cnt)]
    take = np.repeat(lo, cnt) + (np.arange(indptr[-1]) - np.repeat(indptr[:-1], cnt))
    return indptr.astype(np.int64), s_q[take].astype(np.int64)


def time_split(v: VisitLog, val_frac: float, before_ts: float = np.inf) -> float:
    """Timestamp t such that sessions starting at or after t are held out (the last val_frac of
    the sessions that start before `before_ts`)."""
    start = np.r_[True, v.session[1:] != v.session[:-1]]
    starts = v.ts[start]
    starts = starts[starts < before_ts]
    if len(starts) == 0:
        raise ValueError(f"no session starts before {before_ts}: nothing to split")
    return float(np.quantile(starts, 1.0 - val_frac))


def session_start_ts(v: VisitLog) -> np.ndarray:
    """Per visit, the ts of its session's first visit."""
    first = np.flatnonzero(np.r_[True, v.session[1:] != v.session[:-1]])
    return v.ts[first][v.session]


def targets_for(
    v: VisitLog,
    rows: np.ndarray,
    cand_ids: np.ndarray,
    weights: Sequence[float],
    future_horizon: int = 3,
) -> np.ndarray:
    """Target mass [B,C] over candidates: w_click * clicked ad + w_search * searched queries +
    w_future * (score of the candidate on the session's next pages)."""
    w_click, w_search, w_future = weights
    rows = np.asarray(rows, np.int64)
    B, C = cand_ids.shape
    T = np.zeros((B, C), np.float32)
    if w_click:
        q = np.where(v.clicked[rows], v.shown[rows], -2)
        T += w_click * (cand_ids == q[:, None])
    if w_search:
        cnt = v.search_indptr[rows + 1] - v.search_indptr[rows]
        if cnt.sum():
            b = np.repeat(np.arange(B), cnt)
            start = np.repeat(v.search_indptr[rows], cnt)
            q = v.search_ids[start + np.arange(cnt.sum()) - np.repeat(np.cumsum(cnt) - cnt, cnt)]
            hit = (cand_ids[b] == q[:, None]).astype(np.float32)
            np.add.at(T, b, w_search * hit)
    if w_future:
        fid, fsc = v.future_ids(rows, future_horizon)
        # (B, C, F) match of each candidate against the next pages' predicted queries
        m = (cand_ids[:, :, None] == fid[:, None, :]) & (cand_ids[:, :, None] >= 0)
        T += w_future * (m * fsc[:, None, :]).sum(-1)
    return T * (cand_ids >= 0)
