"""Astec hyper-parameters: one dataclass, JSON round-trip, defaults from the paper adapted to size."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path


# fields that models saved by earlier versions may carry, with the one value that still means
# today's behaviour (such a config loads; any other value is refused as unknown)
_RETIRED = {"classifier_init": "xavier"}


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def resolve_threads(n: int | None) -> int:
    """The one home of the thread default: n > 0 as given, else every available core."""
    return int(n) if n and n > 0 else available_cores()


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    return device


@dataclass
class AstecConfig:
    """All knobs of one Astec learner (an ensemble repeats them with different seeds).

    Defaults follow the paper's supplementary material (D=300, dropout 0.5, batch 255, surrogate
    lr in {0.003..0.02}, extreme lr 0.002, 0.05L <= L_hat <= 0.2L, HNSW M/efC/efS) with epochs cut
    for 2-core CPU training; `resolve(L, N)` adapts size-dependent values to tiny label sets.
    """

    # features (passed to engine.text.TfidfVectorizer when training from raw text)
    word_ngrams: int = (
        1  # 1 = words (2 adds word pairs: rare bigrams hurt v with random init, -4 recall)
    )
    char_ngrams: tuple = ()  # e.g. (3, 5) for character n-grams (the paper's query features)
    min_df: int = 1
    embedding_dim: int = 300
    # Module I: surrogate task on balanced label clusters
    num_clusters: int = 0  # 0 = auto: power of two nearest cluster_fraction * L
    cluster_fraction: float = 0.1
    max_clusters: int = 65536  # the paper's 2^16
    # 20 epochs, lr halved after 70% of them (the reference implementation's 20 epochs with a step
    # at 14), lr 0.02 from the paper's grid. debian-related 90/10 split, against 10 epochs at a
    # constant 0.01: shortlist recall@300 77.7 -> 78.2, P@1 66.5 -> 66.7, P@5 35.3 -> 36.0,
    # PSP@5 23.2 -> 25.6 (training-time graphs, full search); 0.03 lost P@1, 0.01 lost PSP
    surrogate_epochs: int = 20
    surrogate_lr: float = 0.02
    surrogate_decay: float = 0.7  # > 0: fraction of surrogate epochs after which the lr halves
    embedding_init: str = (
        "random"  # "random" or "svd": token-label co-occurrence SVD of the training data
    )
    # residual blocks
    spectral_lambda: float = 1.0
    dropout: float = 0.5
    batch_size: int = 255
    # Module II: negatives / shortlist
    knn_neighbours: int = 40  # neighbours from ANNS^x
    centroid_neighbours: int = (
        300  # label centres from ANNS^mu (100 -> 300: valid recall 70.7 -> 76.1)
    )
    centroid_weight: float = 0.5  # s = w * centroid_sim + (1 - w) * knn_score
    knn_power: float = 1.0  # neighbour weight cos^p (p > 1 favours near-duplicates)
    head_centres: int = 4  # k-means centres for head labels
    head_min_points: int = 200  # a label with at least this many points is a head label
    shortlist_size: int = 100  # hard negatives per training point (paper: 500; O(log L) suffices)
    predict_shortlist: int = 300  # candidates scored per test point
    random_negatives: int = 16
    prior_labels: int = 10  # most frequent labels always scored (empty texts get these)
    # exact search up to this many vectors, hnswlib above: real data sets get log-time search, and
    # the exported predictor copies the same graphs, so it gives the model's answers exactly
    exact_knn_max_points: int = 5000
    hnsw_x: tuple = (50, 100, 100)  # M, efC, efS for ANNS^x (instances)
    hnsw_mu: tuple = (100, 300, 300)  # M, efC, efS for ANNS^mu (label centres)
    # Modules III/IV: extreme classifier
    extreme_epochs: int = 6
    extreme_lr: float = 0.002
    finetune_embeddings: bool = True
    finetune_lr: float = 0.001
    # re-ranker
    reranker: bool = True
    reranker_epochs: int = 4
    reranker_negatives: int = 50  # base model's top mispredictions per training point
    # sparse ranker (sparse_ranker.py): per-label squared-hinge linear models on TF-IDF words +
    # word pairs, trained on each point's positives and its `sparse_negatives` shortlisted labels
    # (C, threshold: liblinear's / Parabel's defaults); joins the score combination with gamma.
    # debian-related 90/10 split, the ranker alone: 300 negatives P@1 66.4, 600: 68.0, 1000: 68.1
    sparse_ranker: bool = True
    sparse_word_ngrams: int = 2
    sparse_negatives: int = 600
    sparse_cost: float = 1.0
    sparse_threshold: float = 0.1
    sparse_iters: int = 10
    # score combination, chosen on the validation split
    alpha_grid: tuple = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    beta_grid: tuple = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    gamma_grid: tuple = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    alpha: float = -1.0  # < 0: choose on validation
    beta: float = -1.0
    gamma: float = -1.0  # weight of Astec's score against the sparse ranker's
    select_metrics: tuple = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5")
    # how an ensemble joins its learners' scores over the union of their candidates: "mean" (the
    # paper's average; a label one learner alone shortlists gets a third of its score in Astec-3)
    # or "max"; "auto" chooses on the validation split. debian-related 90/10, Astec-3, half of
    # the split each: P@1 67.84 -> 68.44 and 70.32 -> 70.07, PSP@5 25.39 -> 26.02 and 25.99 -> 26.61
    ensemble: str = "auto"
    # label-name match (engine/label_text.py): + weight * (idf share of the label's name found in
    # the title) on every candidate, the weight chosen on validation (0 in the grid: names that
    # are ids cost nothing). debian-related 90/10, half of the split each, 0.05 against 0: P@1
    # 67.05 -> 67.05 and 71.02 -> 71.07, PSP@5 26.42 -> 26.84 and 25.97 -> 26.53
    label_text: bool = True
    label_text_weight: float = -1.0  # < 0: choose on validation
    label_text_grid: tuple = (0.0, 0.02, 0.05, 0.1, 0.2)
    # at a weight > 0, labels whose name a title matches at least this much join its shortlist
    # (0: none). debian-related 90/10, weight 0.05, halves: PSP@5 26.84 -> 27.36 and 26.53 ->
    # 26.92, P@1 67.05 -> 67.20 and 71.07 -> 71.12, +3.5 candidates per title
    label_text_min_match: float = 0.5
    # prediction search: the cheapest of (knn, kmu) x these fractions within `search_tolerance`
    # points of the full search's validation objective (debian-related: 1/3 matched the full)
    search_fractions: tuple = (1 / 3, 1 / 2, 1.0)
    search_tolerance: float = 0.25
    predict_graph_m: int = 16  # HNSW degree of the indexes prediction searches (0: as training)
    valid_fraction: float = 0.1
    max_valid_points: int = 5000
    propensity_a: float = 0.55
    propensity_b: float = 1.5
    # run
    learners: int = 1
    seed: int = 0
    num_threads: int = 0  # torch / numba / hnswlib threads; 0 = the cores this process may use
    # where Modules I-IV and the re-ranker train: "cpu", "cuda" (a GPU; same model directory and
    # CPU predictor) or "auto" (cuda when torch sees one). Module II's indexes, the sparse ranker
    # and prediction always run on the CPU.
    device: str = "cpu"
    # on the CPU, the classifier of Modules III/IV and the re-ranker is scored and updated by
    # compiled kernels (fused.py); false runs the torch path a GPU runs (same loss and optimiser)
    fused_kernels: bool = True
    predict_batch: int = 2048

    def __post_init__(self):
        if self.embedding_init not in ("random", "svd"):
            raise ValueError(
                f"embedding_init must be 'random' or 'svd', got {self.embedding_init!r}"
            )
        if self.ensemble not in ("auto", "mean", "max"):
            raise ValueError(f"ensemble must be 'auto', 'mean' or 'max', got {self.ensemble!r}")
        if self.device not in ("cpu", "cuda", "auto") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}")
        if self.sparse_word_ngrams not in (1, 2):
            raise ValueError(f"sparse_word_ngrams must be 1 or 2, got {self.sparse_word_ngrams}")

    def resolve(self, num_labels: int) -> "AstecConfig":
        """Return a copy with size-dependent values fixed for L labels (tiny L never breaks)."""
        c = dataclasses.replace(self)
        L = max(int(num_labels), 1)
        if c.num_clusters <= 0:
            target = max(c.cluster_fraction * L, 1.0)
            c.num_clusters = int(2 ** round(math.log2(target)))
        c.num_clusters = int(max(1, min(c.num_clusters, c.max_clusters, L)))
        c.shortlist_size = int(min(c.shortlist_size, L))
        c.predict_shortlist = int(min(c.predict_shortlist, L))
        c.centroid_neighbours = int(min(c.centroid_neighbours, L))
        c.prior_labels = int(min(c.prior_labels, L))
        c.random_negatives = int(min(c.random_negatives, L))
        c.reranker_negatives = int(min(c.reranker_negatives, L))
        c.sparse_negatives = int(min(c.sparse_negatives, L))
        c.num_threads = resolve_threads(c.num_threads)
        return c

    def to_dict(self) -> dict:
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "AstecConfig":
        names = {f.name: f for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if not (k in _RETIRED and v == _RETIRED[k])}
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(
                f"{source}: unknown AstecConfig field(s) {unknown}; known: {sorted(names)}"
            )
        kw = {}
        for k, v in d.items():
            default = names[k].default
            if isinstance(default, tuple):
                if not isinstance(v, (list, tuple)):
                    raise ValueError(f"{source}: field {k!r} must be a list, got {v!r}")
                v = tuple(v)
            elif isinstance(default, bool):
                if not isinstance(v, bool):
                    raise ValueError(f"{source}: field {k!r} must be true/false, got {v!r}")
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ValueError(f"{source}: field {k!r} must be a number, got {v!r}")
                v = type(default)(v) if isinstance(default, float) or float(v).is_integer() else v
            kw[k] = v
        return cls(**kw)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "AstecConfig":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}: invalid JSON config: {e.msg}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{p}: config must be a JSON object")
        return cls.from_dict(d, source=str(p))
