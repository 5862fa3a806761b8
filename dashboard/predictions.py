"""What the Predict page explains about one title: its known words and who proposed each query.

Why: a title with no known word still gets the predictor's prior (most frequent) labels with
confident-looking scores; an operator must see that this is no evidence. And a query is only
as good as the evidence behind it, so each query is shown with the part of Astec's shortlist
that proposed it: the training points' index (ANNS^x: "pages like this one were clicked for
it"), the label centres' index (ANNS^mu: "its centre is near this title"), the prior labels
(always scored, popular) and the label-name match (its name's words are in the title).

Everything is read from the exported predictor's public parts (its vectorizers, learners'
indexes and the label-name table); the searches repeat what prediction does for the first
`knn`/`kmu` hits, so "proposed by" is exact for the indexes and the prior, and the name match
is the δ·m term the predictor adds. The engine is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.text import words

KNN, CENTRES, PRIOR, NAME = (
    "similar pages (ANNS^x)",
    "label centres (ANNS^μ)",
    "prior (popular)",
    "name in title",
)


@dataclass
class Word:
    """One word of the title and which of the model's vocabularies know it."""

    word: str
    encoder: bool  # in the TF-IDF vocabulary of the embeddings (or via char n-grams)
    ranker: bool  # in the sparse ranker's word vocabulary
    names: bool  # a word of some label name
    idf: float | None  # the encoder vocabulary's idf (rarer = more informative)

    @property
    def known(self) -> bool:
        return self.encoder or self.ranker or self.names


def title_words(pred, text: str) -> list[Word]:
    """The title's distinct words in order, each with the vocabularies that know it."""
    vec, rvec, lt = (
        pred.vectorizer,
        getattr(pred, "ranker_vectorizer", None),
        getattr(pred, "label_text", None),
    )
    out, seen = [], set()
    for w in words(text):
        if w in seen:
            continue
        seen.add(w)
        i = vec.vocabulary_.get(w)
        enc = i is not None or (vec.char_ngrams is not None and vec.transform_one(w)[0].size > 0)
        out.append(
            Word(
                w,
                enc,
                rvec is not None and w in rvec.vocabulary_,
                lt is not None and w in lt.vocab,
                float(vec.idf_[i]) if i is not None else None,
            )
        )
    return out


def has_evidence(pred, text: str) -> bool:
    """Whether any feature of the title is known: otherwise the predictor's answer is its prior."""
    return bool(pred.has_evidence([text])[0])


def proposers(pred, text: str, ids) -> list[list[str]]:
    """For each label in `ids`: the shortlist sources that proposed it (any learner)."""
    ids = [int(i) for i in ids]
    found: dict[int, set] = {i: set() for i in ids}
    idx, val = pred.vectorizer.transform_one(text)
    rows = np.zeros(idx.size, np.int64)
    for lr in pred.learners:
        v, _, _ = lr.encode(rows, idx.astype(np.int64), val, 1, reranker=False)
        norm = float(np.linalg.norm(v))
        q = np.ascontiguousarray(v / (norm if norm else 1.0), dtype=np.float32)
        if lr.knn > 0 and lr.points is not None and norm:
            pts, _ = lr.points.query(q, lr.knn, pred.threads)
            for p in pts[0]:
                for lab in lr.point_labels[lr.point_indptr[p] : lr.point_indptr[p + 1]]:
                    if int(lab) in found:
                        found[int(lab)].add(KNN)
        if lr.kmu > 0 and lr.centres is not None and norm:
            cs, _ = lr.centres.query(q, lr.kmu, pred.threads)
            for c in cs[0]:
                lab = int(lr.centre_owner[c])
                if lab in found:
                    found[lab].add(CENTRES)
        for lab in lr.prior.tolist():
            if lab in found:
                found[lab].add(PRIOR)
    lt = getattr(pred, "label_text", None)
    if lt is not None and getattr(pred, "label_text_weight", 0) > 0 and ids:
        m = lt.scores([lt.title_ids(text)], np.zeros(len(ids), np.int64), np.array(ids))
        for i, x in zip(ids, m.tolist(), strict=True):
            if x > 0:
                found[i].add(NAME)
    order = (KNN, CENTRES, NAME, PRIOR)
    return [[s for s in order if s in found[i]] for i in ids]


SHORT = {KNN: "pages", CENTRES: "centres", NAME: "name", PRIOR: "prior"}


def prediction_rows(pred, text: str, k: int, short: bool = False) -> list[dict]:
    """The top-k queries of `text` with their scores and proposers, best first (`short`: the
    proposers' one-word names, for narrow side-by-side tables)."""
    ids, scores = pred.predict_one(text, k)
    keep = [
        (int(i), float(s)) for i, s in zip(ids.tolist(), scores.tolist(), strict=True) if i >= 0
    ]
    who = proposers(pred, text, [i for i, _ in keep])
    names = pred.label_names
    return [
        {
            "rank": r + 1,
            "query": names[i] if i < len(names) else f"#{i}",
            "score": round(s, 4),
            "proposed by": ", ".join(SHORT[x] if short else x for x in w) or "(re-scored only)",
            "id": i,
        }
        for r, ((i, s), w) in enumerate(zip(keep, who, strict=True))
    ]


def compare(rows_a: list[dict], rows_b: list[dict]) -> dict:
    """How two versions' answers for one title differ: shared queries and top-1 agreement."""
    a, b = [r["query"] for r in rows_a], [r["query"] for r in rows_b]
    shared = set(a) & set(b)
    return {
        "shared": len(shared),
        "only_a": [q for q in a if q not in shared],
        "only_b": [q for q in b if q not in shared],
        "same_top1": bool(a and b and a[0] == b[0]),
    }
