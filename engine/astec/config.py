"""Astec's parameters: one typed class per module (PECOS-style), held by AstecConfig.

Defaults follow the paper's supplementary material (D=300, dropout 0.5, batch 255, surrogate lr
in {0.003..0.02}, extreme lr 0.002, 0.05L <= L_hat <= 0.2L, HNSW M/efC/efS) with epochs cut for
2-core CPU training; `AstecConfig.resolve(L)` adapts size-dependent values to tiny label sets.
Each default lives here once: the CLI reads its defaults and help from these classes.

JSON: `to_dict` writes the nested shape ({"surrogate": {"epochs": 20, ...}, "seed": 0});
`from_dict` also reads the flat shape of model directories written before the split
({"surrogate_epochs": 20, ...}), through `FLAT_NAMES`: only there, never at run time.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.ranking_metrics import PROPENSITY_A, PROPENSITY_B

SEED = 0  # AstecConfig.seed's default
TOP_K = 10  # labels a prediction returns unless asked for another number
DEVICES = ("cpu", "cuda", "auto")  # where training runs; "cuda:N" names one of several GPUs
PRECISIONS = ("auto", "bfloat16", "float32")  # of training-time products (TrainingParams)


class ConfigError(ValueError):
    """A configuration names an unknown field or gives a field a value of the wrong kind."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def resolve_threads(n: int | None) -> int:
    """n > 0 as given, else every available core (what TrainingParams.threads = 0 means)."""
    return int(n) if n and n > 0 else available_cores()


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    return device


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX; Linux's cpuinfo):
    there torch's bfloat16 matmul runs several times faster than float32's; elsewhere it is
    emulated and no faster."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str) -> str:
    """ "auto" -> "bfloat16" on a CPU with native bfloat16 products, else "float32"."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bfloat16" if native_bf16() else "float32"
    return precision


def _help(text: str) -> dict[str, str]:
    """Field metadata read by the CLI (engine.cli_options) for the option's help."""
    return {"help": text}


@dataclass
class FeatureParams:
    """TF-IDF features of raw texts (engine.text.TfidfVectorizer)."""

    # 1 = words; 2 adds word pairs, whose rare bigrams hurt v under a random init
    word_ngrams: int = 1
    char_ngrams: tuple[int, ...] = ()  # e.g. (3, 5): character n-grams (the paper's queries)
    min_df: int = 1


@dataclass
class NetworkParams:
    """The encoders v = ReLU(E^T x), z = v + ReLU(R v) with ||R||_2 <= spectral_lambda."""

    embedding_dim: int = 300
    # "random" or "svd": token-label co-occurrence SVD of the training data
    embedding_init: str = "random"
    spectral_lambda: float = 1.0
    dropout: float = 0.5

    def __post_init__(self) -> None:
        if self.embedding_init not in ("random", "svd"):
            raise ConfigError(
                f"network.embedding_init must be 'random' or 'svd', got {self.embedding_init!r}"
            )


@dataclass
class SurrogateParams:
    """Module I: E learnt on a surrogate task whose labels are balanced clusters of labels."""

    # 0 = auto: the power of two nearest max(large_fraction * L, min(cluster_fraction * L,
    # large_from)): 0.1 L up to 1,024 meta-labels, then the paper's lower bound 0.05 L (its
    # range is 0.05 L - 0.2 L), because the dense head costs N * L_hat * D per epoch and the
    # lower bound costs no accuracy there
    num_clusters: int = 0
    cluster_fraction: float = 0.1
    large_fraction: float = 0.05
    large_from: int = 1024
    max_clusters: int = 65536  # the paper's 2^16
    # 20 epochs, lr halved after 70% of them (the reference implementation's 20 epochs with a step
    # at 14), lr 0.02: the value of the paper's grid best on debian-related
    epochs: int = 20
    lr: float = 0.02
    decay: float = 0.7  # > 0: fraction of the epochs after which the lr halves
    # > 0: the validation meta-label P@1 sets the schedule (trainer.train_surrogate): the lr
    # halves after this many epochs without a new best (or at `decay`), training stops after as
    # many more and the best epoch's weights are kept; `epochs` is the cap. 0 (the default):
    # the fixed schedule, the last epoch's weights, because meta P@1 peaks early while what
    # Modules II-IV read of E, its tail, still improves
    patience: int = 0
    # heads of at least `sampled_from` meta-labels (0: none, the default) score a sample each
    # batch (`sampled_head`): every meta-label in the label tree's subtrees of `sampled_block`
    # leaves that hold the batch's meta-labels (their nearest clusters: the hardest negatives)
    # and `sampled_negatives` others drawn uniformly, weighted by the inverse chance of being
    # drawn (the expected gradient is the full head's). Off by default: it trades accuracy for
    # Module I's time at large L
    sampled_from: int = 0
    sampled_block: int = 16
    sampled_negatives: int = 2048


@dataclass
class ShortlistParams:
    """Module II: ANNS^x over training points, ANNS^mu over label centres, and the hard
    negatives their shortlists give each training point."""

    knn_neighbours: int = 40  # neighbours from ANNS^x
    centroid_neighbours: int = 300  # label centres from ANNS^mu (deeper: higher recall)
    centroid_weight: float = 0.5  # s = w * centroid_sim + (1 - w) * knn_score
    knn_power: float = 1.0  # neighbour weight cos^p (p > 1 favours near-duplicates)
    head_centres: int = 4  # k-means centres for head labels
    head_min_points: int = 200  # a label with at least this many points is a head label
    negatives: int = 100  # hard negatives per training point (paper: 500; O(log L) suffices)
    random_negatives: int = 16
    prior_labels: int = 10  # most frequent labels always scored (empty texts get these)
    # exact search up to this many vectors, hnswlib above: real data sets get log-time search, and
    # the exported predictor copies the same graphs, so it gives the model's answers exactly
    exact_max_points: int = 5000
    # training-time searches of the label centres (hard negatives, shortlists of every training
    # point at k = 300-600) are exact up to this many centres: a blocked bfloat16 matmul + top-k
    # beats an HNSW search at ef >= k there and no training-time graph (M = 100, efC = 300) is
    # built; exact grows with the centres, the graph about with their log, so they meet near
    # 2^19 centres. Prediction keeps its HNSW graphs (one title at a time).
    exact_max_centres: int = 524288
    # M, efC, efS for ANNS^x (instances). Degree 16, as the serving graphs (`search.graph_m`):
    # the graph over the fit points serves the search's choice too, and each training search
    # reads a third of the links; efC and efS stay at 100 because lower values lost accuracy
    # at large L
    hnsw_x: tuple[int, ...] = (16, 100, 100)
    # M, efC, efS for ANNS^mu (label centres): the serving graphs (M: `search.graph_m`), and the
    # training-time graphs above `exact_max_centres`
    hnsw_mu: tuple[int, ...] = (100, 300, 300)


@dataclass
class ExtremeParams:
    """Modules III/IV: a new residual R and the 1-vs-all classifier W, trained on each point's
    positives and shortlisted negatives."""

    epochs: int = 6
    lr: float = 0.002
    # True: E is fine-tuned at finetune_lr, then the label centres are computed again and the
    # points graph takes the final v over Module II's links (`AnnIndex.with_vectors`; it is the
    # serving graphs' too); False: E stays as Module I left it (the paper's Module IV trains R
    # and W) and Module II's indexes are kept. True by default: it raised test P@1 on
    # debian-related and changed nothing on the other data sets
    finetune_embeddings: bool = True
    finetune_lr: float = 0.001


@dataclass
class RerankParams:
    """The re-ranker: an independent (E~, R~, W~) trained on the base model's mispredictions,
    at the extreme classifier's learning rates."""

    enabled: bool = True
    epochs: int = 4
    negatives: int = 50  # base model's top mispredictions per training point


@dataclass
class SparseRankerParams:
    """Per-label squared-hinge linear models on TF-IDF words + word pairs (sparse_ranker.py),
    trained on each point's positives and its `negatives` shortlisted labels (cost, threshold:
    liblinear's / Parabel's defaults; 600 negatives: fewer lost P@1, more barely added)."""

    enabled: bool = True
    word_ngrams: int = 2
    negatives: int = 600
    cost: float = 1.0
    threshold: float = 0.1
    iters: int = 10
    # sweeps of the refit on all training points, which starts from the first fit's dual
    # variables (converged on 90% of the pairs), so 3 sweeps do what 10 cold ones do
    refit_iters: int = 3

    def __post_init__(self) -> None:
        if self.word_ngrams not in (1, 2):
            raise ConfigError(f"sparse.word_ngrams must be 1 or 2, got {self.word_ngrams}")


@dataclass
class CombinationParams:
    """Weights of the score combination: alpha (classifier vs shortlist similarity), beta (base
    vs re-ranker), gamma (Astec vs sparse ranker); < 0 chooses from the grid on validation."""

    alpha: float = -1.0
    beta: float = -1.0
    gamma: float = -1.0
    alpha_grid: tuple[float, ...] = (
        0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0,
    )  # fmt: skip
    beta_grid: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    gamma_grid: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass
class NameMatchParams:
    """Label-name match (engine/label_text.py): + weight * (idf share of the label's name found
    in the title) on every candidate, the weight chosen on validation (0 in the grid: names that
    are ids cost nothing); it lifts the tail labels (PSP) more than the head."""

    enabled: bool = True
    weight: float = -1.0  # < 0: choose on validation
    grid: tuple[float, ...] = (0.0, 0.02, 0.05, 0.1, 0.2)
    # at a weight > 0, labels whose name a title matches at least this much join its shortlist
    # (0: none), so a named label the indexes miss can still be ranked
    min_match: float = 0.5


@dataclass
class EnsembleParams:
    """Learners trained with seeds seed + 1000 j, joined over the union of their candidates."""

    learners: int = field(default=1, metadata=_help("Ensemble size (Astec-3: 3)."))
    # "mean" (the paper's average; a label one learner alone shortlists gets a third of its score
    # in Astec-3) or "max"; "auto" chooses on validation, because neither won on both halves
    # of one split
    join: str = "auto"

    def __post_init__(self) -> None:
        if self.join not in ("auto", "mean", "max"):
            raise ConfigError(
                f"ensembles.join (ensemble) must be 'auto', 'mean' or 'max', got {self.join!r}"
            )


@dataclass
class SearchParams:
    """Prediction: how many candidates are scored and how hard the indexes are searched."""

    candidates: int = 300  # shortlisted labels scored per text
    # the cheapest of (knn, kmu) x these fractions within `tolerance` points of the full search's
    # validation objective: the search is most of a prediction's cost, and what a smaller one
    # costs in accuracy depends on the data (a fine grid at the small end: each step there is a
    # tenth of a title's time; each fraction costs one scoring of the validation split)
    fractions: tuple[float, ...] = (1 / 10, 1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 1.0)
    tolerance: float = 0.25
    graph_m: int = 16  # HNSW degree of the indexes prediction searches (0: as training)
    batch: int = 2048  # texts per batch of Astec.predict


@dataclass
class ValidationParams:
    """The split carved out of the training data to choose weights and searches, and the
    objective: the mean of `metrics` with propensities A, B."""

    fraction: float = 0.1
    max_points: int = 5000
    metrics: tuple[str, ...] = ("P@1", "P@3", "P@5", "PSP@1", "PSP@3", "PSP@5")
    propensity_a: float = PROPENSITY_A
    propensity_b: float = PROPENSITY_B


@dataclass
class TrainingParams:
    """How training runs: batch, threads, device and kernels."""

    batch_size: int = 255
    threads: int = field(
        default=0,
        metadata=_help(
            "torch/numba/hnswlib threads; 0 = every core this process may use (its affinity)."
        ),
    )
    # Module II's indexes, the sparse ranker and prediction always run on the CPU
    device: str = field(
        default="cpu",
        metadata=_help(
            "Where Modules I-IV and the re-ranker train: cpu, cuda (needs a GPU) or auto (cuda "
            "when torch sees one). The model and its CPU predictor are the same kind."
        ),
    )
    # on the CPU, the classifier of Modules III/IV and the re-ranker is scored and updated by
    # the CPU's compiled classifier kernels (fused.py) and hand-written encoder backward
    # (encoder_step.py); false runs the torch path a GPU runs (same loss and optimiser)
    fused_kernels: bool = True
    # the products of the training work that tolerates bfloat16 on the CPU: the exact searches
    # of the label centres (hard negatives, candidate pools) and Module I's dense surrogate head
    # and its encoder's residual products (weights, Adam and the loss stay float32); Module IV
    # and the re-ranker stay float32, where bfloat16 cost test PSP@5.
    # "auto": bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX), else float32.
    # Prediction, the exported predictor and a GPU's batches always compute in float32.
    precision: str = field(
        default="auto",
        metadata=_help(
            "auto, bfloat16 or float32: products of the label-centre searches and of Module I's "
            "head and residual while training on the CPU (auto: bfloat16 where the CPU has it "
            "natively)."
        ),
    )

    def __post_init__(self) -> None:
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ConfigError(
                f"training.device must be 'cpu', 'cuda[:N]' or 'auto', got {self.device!r}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"training.precision must be one of {PRECISIONS}, got {self.precision!r}"
            )


# section name -> its class, in the order config.json lists them
SECTIONS: dict[str, type] = {
    "features": FeatureParams,
    "network": NetworkParams,
    "surrogate": SurrogateParams,
    "shortlist": ShortlistParams,
    "extreme": ExtremeParams,
    "rerank": RerankParams,
    "sparse": SparseRankerParams,
    "combination": CombinationParams,
    "name_match": NameMatchParams,
    "ensembles": EnsembleParams,
    "search": SearchParams,
    "validation": ValidationParams,
    "training": TrainingParams,
}

# the single-class config's names where they differ from the section's field names
_RENAMED: dict[tuple[str, str], str] = {
    ("surrogate", "epochs"): "surrogate_epochs",
    ("surrogate", "lr"): "surrogate_lr",
    ("surrogate", "decay"): "surrogate_decay",
    ("surrogate", "patience"): "surrogate_patience",
    ("surrogate", "sampled_from"): "surrogate_sampled_from",
    ("surrogate", "sampled_block"): "surrogate_sampled_block",
    ("surrogate", "sampled_negatives"): "surrogate_sampled_negatives",
    ("surrogate", "large_fraction"): "surrogate_large_fraction",
    ("surrogate", "large_from"): "surrogate_large_from",
    ("shortlist", "negatives"): "shortlist_size",
    ("shortlist", "exact_max_points"): "exact_knn_max_points",
    ("extreme", "epochs"): "extreme_epochs",
    ("extreme", "lr"): "extreme_lr",
    ("rerank", "enabled"): "reranker",
    ("rerank", "epochs"): "reranker_epochs",
    ("rerank", "negatives"): "reranker_negatives",
    ("sparse", "enabled"): "sparse_ranker",
    ("sparse", "word_ngrams"): "sparse_word_ngrams",
    ("sparse", "negatives"): "sparse_negatives",
    ("sparse", "cost"): "sparse_cost",
    ("sparse", "threshold"): "sparse_threshold",
    ("sparse", "iters"): "sparse_iters",
    ("sparse", "refit_iters"): "sparse_refit_iters",
    ("name_match", "enabled"): "label_text",
    ("name_match", "weight"): "label_text_weight",
    ("name_match", "grid"): "label_text_grid",
    ("name_match", "min_match"): "label_text_min_match",
    ("ensembles", "join"): "ensemble",
    ("search", "candidates"): "predict_shortlist",
    ("search", "fractions"): "search_fractions",
    ("search", "tolerance"): "search_tolerance",
    ("search", "graph_m"): "predict_graph_m",
    ("search", "batch"): "predict_batch",
    ("validation", "fraction"): "valid_fraction",
    ("validation", "max_points"): "max_valid_points",
    ("validation", "metrics"): "select_metrics",
    ("training", "threads"): "num_threads",
}

# flat name -> (section, field): every field of every section, under the single-class name
# (read by `from_dict` only, for model directories saved before the sections)
FLAT_NAMES: dict[str, tuple[str, str]] = {
    _RENAMED.get((s, f.name), f.name): (s, f.name)
    for s, cls in SECTIONS.items()
    for f in dataclasses.fields(cls)
}
_FIELD_COUNT = sum(len(dataclasses.fields(c)) for c in SECTIONS.values())
if len(FLAT_NAMES) != _FIELD_COUNT or set(FLAT_NAMES) & {*SECTIONS, "seed"}:
    # a flat name meaning two things would misread the configs saved in the flat shape
    raise RuntimeError("engine.astec.config: a flat name repeats or shadows a section")

# fields that models saved by earlier versions may carry, with the one value that still means
# today's behaviour (such a config loads; any other value is refused as unknown)
_RETIRED = {"classifier_init": "xavier"}


def _coerce(value: Any, default: Any, where: str) -> Any:
    """value as JSON gave it, checked against the kind of the field's default."""
    if isinstance(default, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(value)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true/false, got {value!r}")
        return value
    if isinstance(default, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        if isinstance(default, float) or float(value).is_integer():
            return type(default)(value)
        return value
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


@dataclass(slots=True)  # slots: a misspelt field (cfg.num_thread = 1) is an error
class AstecConfig:
    """All parameters of one Astec model (an ensemble repeats them with seeds seed + 1000 j).

    Build it from sections (`AstecConfig(training=TrainingParams(threads=1))`) or from JSON
    (`from_dict`, `load`), which also reads the flat names of the single-class config that
    model directories saved before the sections hold (`FLAT_NAMES`).
    """

    features: FeatureParams = field(default_factory=FeatureParams)
    network: NetworkParams = field(default_factory=NetworkParams)
    surrogate: SurrogateParams = field(default_factory=SurrogateParams)
    shortlist: ShortlistParams = field(default_factory=ShortlistParams)
    extreme: ExtremeParams = field(default_factory=ExtremeParams)
    rerank: RerankParams = field(default_factory=RerankParams)
    sparse: SparseRankerParams = field(default_factory=SparseRankerParams)
    combination: CombinationParams = field(default_factory=CombinationParams)
    name_match: NameMatchParams = field(default_factory=NameMatchParams)
    ensembles: EnsembleParams = field(default_factory=EnsembleParams)
    search: SearchParams = field(default_factory=SearchParams)
    validation: ValidationParams = field(default_factory=ValidationParams)
    training: TrainingParams = field(default_factory=TrainingParams)
    seed: int = field(
        default=SEED, metadata=_help("Random seed (learner j of an ensemble uses seed + 1000 j).")
    )

    def __post_init__(self) -> None:
        for s, cls in SECTIONS.items():
            value = getattr(self, s)
            if not isinstance(value, cls):
                raise ConfigError(f"AstecConfig: {s} must be a {cls.__name__}, got {value!r}")
            # a section given by the caller is copied: changing it later leaves this config
            setattr(self, s, copy.deepcopy(value))

    def copy(self) -> AstecConfig:
        """A deep copy: changing its sections leaves this config as it is."""
        return copy.deepcopy(self)

    def resolve(self, num_labels: int) -> AstecConfig:
        """A copy with size-dependent values fixed for L labels (tiny L never breaks) and the
        thread count made explicit."""
        c = self.copy()
        L = max(int(num_labels), 1)
        sur, sl = c.surrogate, c.shortlist
        if sur.num_clusters <= 0:
            target = max(sur.large_fraction * L, min(sur.cluster_fraction * L, sur.large_from), 1.0)
            sur.num_clusters = int(2 ** round(math.log2(target)))
        sur.num_clusters = int(max(1, min(sur.num_clusters, sur.max_clusters, L)))
        sl.negatives = int(min(sl.negatives, L))
        sl.centroid_neighbours = int(min(sl.centroid_neighbours, L))
        sl.prior_labels = int(min(sl.prior_labels, L))
        sl.random_negatives = int(min(sl.random_negatives, L))
        c.search.candidates = int(min(c.search.candidates, L))
        c.rerank.negatives = int(min(c.rerank.negatives, L))
        c.sparse.negatives = int(min(c.sparse.negatives, L))
        c.training.threads = resolve_threads(c.training.threads)
        return c

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The nested shape: {section: {field: value}}, tuples as lists, plus "seed"."""
        out: dict[str, Any] = {
            s: {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(getattr(self, s)).items()
            }
            for s in SECTIONS
        }
        out["seed"] = self.seed
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> AstecConfig:
        """Read the nested shape, the flat one, or a mix (a field set twice is an error);
        absent fields keep their defaults. Errors name `source` and the field."""
        given: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
        seen: dict[tuple[str, str], str] = {}

        def put(s: str, f: str, v: Any, name: str) -> None:
            if (s, f) in seen:
                raise ConfigError(f"{source}: field {name!r} sets {s}.{f} again ({seen[s, f]!r})")
            seen[s, f] = name
            default = getattr(SECTIONS[s](), f)
            given[s][f] = _coerce(v, default, f"{source}: field {name!r}")

        seed = SEED
        for k, v in d.items():
            if k in _RETIRED and v == _RETIRED[k]:
                continue
            if k == "seed":
                seed = _coerce(v, SEED, f"{source}: field 'seed'")
            elif k in SECTIONS:
                if not isinstance(v, dict):
                    raise ConfigError(f"{source}: field {k!r} must be an object, got {v!r}")
                names = {f.name for f in dataclasses.fields(SECTIONS[k])}
                bad = sorted(set(v) - names)
                if bad:
                    raise ConfigError(
                        f"{source}: unknown field(s) {[f'{k}.{b}' for b in bad]}; "
                        f"{k} has {sorted(names)}"
                    )
                for f, x in v.items():
                    put(k, f, x, f"{k}.{f}")
            elif k in FLAT_NAMES:
                put(*FLAT_NAMES[k], v, k)
            else:
                raise ConfigError(
                    f"{source}: unknown AstecConfig field {k!r}; known: sections "
                    f"{sorted(SECTIONS)}, 'seed', or the flat names {sorted(FLAT_NAMES)}"
                )
        try:
            return cls(seed=seed, **{s: SECTIONS[s](**kw) for s, kw in given.items()})
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> AstecConfig:
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}:{e.lineno}: invalid JSON config: {e.msg}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: config must be a JSON object")
        return cls.from_dict(d, source=str(p))
