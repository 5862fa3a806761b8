"""Search click logs -> a `title -> queries` training set in the text TSV format.

A page (url) becomes one data point whose text is its title; its labels are the queries whose
clicks led to it at least `min_clicks` times (one stray click is noise, not a label). Pages with
the same normalised title are merged, so one text never lands in both splits. The split is by
page and comes from a hash of the title: a page keeps its split as the logs grow, so a retrain's
test pages were never training pages of an earlier version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from engine.clicklog import ReadReport, read_log
from engine.formats import write_label_names, write_text_tsv

log = logging.getLogger(__name__)
_WS = re.compile(r"\s+")


def normalize_text(s: str) -> str:
    """Collapse whitespace (tabs/newlines too) and lowercase: the key pages and queries merge on."""
    return _WS.sub(" ", s).strip().lower()


@dataclass
class ClickTable:
    """Click counts of (title, query) pairs, titles and queries as normalised, distinct strings."""

    titles: list[str]
    queries: list[str]
    pair_title: np.ndarray
    pair_query: np.ndarray
    pair_clicks: np.ndarray
    records: int
    skipped_empty: int

    def filtered(self, min_clicks: int) -> ClickTable:
        keep = self.pair_clicks >= min_clicks
        return ClickTable(
            self.titles,
            self.queries,
            self.pair_title[keep],
            self.pair_query[keep],
            self.pair_clicks[keep],
            self.records,
            self.skipped_empty,
        )


def aggregate_clicks(records: Iterable[dict]) -> ClickTable:
    """Count clicks per (page, query); a page is known by its url, shown by its latest title."""
    url_id: dict[str, int] = {}
    q_id: dict[str, int] = {}
    url_title: list[str] = []
    pu: list[int] = []
    pq: list[int] = []
    n = skipped = 0
    for r in records:
        n += 1
        title, query = normalize_text(r["title"]), normalize_text(r["query"])
        if not title or not query:
            skipped += 1
            continue
        u = url_id.setdefault(r["url"], len(url_id))
        if u == len(url_title):
            url_title.append(title)
        else:
            url_title[u] = title
        pu.append(u)
        pq.append(q_id.setdefault(query, len(q_id)))
    # pages with the same title are one data point
    titles, page_of_url = (
        np.unique(np.array(url_title, dtype=object), return_inverse=True)
        if url_title
        else (np.array([], dtype=object), np.zeros(0, np.int64))
    )
    pt = page_of_url[np.asarray(pu, np.int64)] if pu else np.zeros(0, np.int64)
    qq = np.asarray(pq, np.int64)
    Q = max(len(q_id), 1)
    keys, counts = np.unique(pt * Q + qq, return_counts=True)
    return ClickTable(list(titles), list(q_id), keys // Q, keys % Q, counts, n, skipped)


def _split_hash(titles: list[str], seed: int) -> np.ndarray:
    """A stable uniform number in [0, 1) per title (blake2b of seed + title)."""
    salt = str(seed).encode()
    return (
        np.array(
            [
                int.from_bytes(hashlib.blake2b(salt + t.encode(), digest_size=8).digest(), "big")
                for t in titles
            ],
            np.float64,
        )
        / 2.0**64
    )


def table_to_points(
    table: ClickTable, label_names: list[str] | None = None
) -> tuple[list[str], sp.csr_matrix, list[str]]:
    """Texts, a binary label matrix and label names; labels outside `label_names` are dropped
    when it is given (evaluating a model on its own label space), else labels = clicked queries
    ordered by total clicks."""
    if label_names is None:
        tot = np.bincount(table.pair_query, weights=table.pair_clicks, minlength=len(table.queries))
        used = np.nonzero(tot > 0)[0]
        used = used[np.lexsort((used, -tot[used]))]
        label_names = [table.queries[i] for i in used]
    index = {normalize_text(n): i for i, n in enumerate(label_names)}
    lab = np.array([index.get(q, -1) for q in table.queries], np.int64)
    pl = lab[table.pair_query] if len(table.pair_query) else np.zeros(0, np.int64)
    ok = pl >= 0
    rows, cols = table.pair_title[ok], pl[ok]
    points = np.unique(rows)
    r = np.searchsorted(points, rows)
    Y = sp.csr_matrix(
        (np.ones(len(r), np.float32), (r, cols)), shape=(len(points), len(label_names))
    )
    Y.sum_duplicates()
    Y.data[:] = 1
    return [table.titles[i] for i in points], Y, list(label_names)


def build_training_set(
    log_dir: str | Path,
    out_dir: str | Path,
    min_clicks: int = 2,
    test_fraction: float = 0.2,
    seed: int = 0,
    since: str | None = None,
    until: str | None = None,
) -> dict:
    """Write OUT/train.tsv, test.tsv, labels.txt and clicks_dataset.json from LOG_DIR/search_clicks.

    Returns the statistics (also in clicks_dataset.json), including the reader's corrupt-line
    counts: a bad line is skipped and counted, never fatal.
    """
    if min_clicks < 1:
        raise ValueError(f"min_clicks must be >= 1, got {min_clicks}")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    report = ReadReport("search_clicks")
    table = aggregate_clicks(read_log(log_dir, "search_clicks", report, since=since, until=until))
    if table.records == 0:
        raise ValueError(f"{log_dir}: no valid search clicks ({report.summary()})")
    kept = table.filtered(min_clicks)
    texts, Y, names = table_to_points(kept)
    test = _split_hash(texts, seed) < test_fraction
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tr, te = np.nonzero(~test)[0], np.nonzero(test)[0]
    write_text_tsv(out / "train.tsv", [texts[i] for i in tr], Y[tr])
    write_text_tsv(out / "test.tsv", [texts[i] for i in te], Y[te])
    write_label_names(out / "labels.txt", names)
    train_freq = np.asarray(Y[tr].sum(axis=0)).ravel()
    stats = {
        "log_dir": str(log_dir),
        "min_clicks": min_clicks,
        "test_fraction": test_fraction,
        "seed": seed,
        "read": report.to_dict(),
        "clicks": table.records,
        "skipped_empty_text": table.skipped_empty,
        "pairs": len(table.pair_clicks),
        "pairs_kept": len(kept.pair_clicks),
        "pages": len(table.titles),
        "points_train": len(tr),
        "points_test": len(te),
        "labels": len(names),
        "labels_without_train_point": int((train_freq == 0).sum()),
        "avg_labels_per_point": round(float(Y.sum() / max(Y.shape[0], 1)), 3),
    }
    (out / "clicks_dataset.json").write_text(json.dumps(stats, indent=1) + "\n")
    log.info(
        "%s -> %s: %d train / %d test points, %d labels (%s)",
        log_dir,
        out,
        len(tr),
        len(te),
        len(names),
        report.summary(),
    )
    return stats
