"""`astec export`: turn a trained Astec model directory into a torch-free predictor directory.

The predictor (docs/predictor-format.md) holds plain arrays (.npy, memory-mappable), the
feature networks as ONNX graphs whose weights are the same .npy files (ONNX external data, so
nothing is stored twice), hnswlib indexes (built here when the model used exact search, which
is only fast at training time), the TF-IDF tables, label names, alpha/beta and a manifest of
sha256 sums written last. The whole directory is built under a staging name and renamed into
place, so a reader never sees a half-written predictor.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import hnswlib
import numpy as np
import onnx
from onnx import TensorProto, helper
from tqdm import tqdm

from engine.manifest import MANIFEST_NAME, label_space, npy_header, sha256_file, write_manifest

log = logging.getLogger(__name__)
OPSET = 17


class ExportError(ValueError):
    """The model cannot be exported (the message says which file or field)."""


@dataclass
class ExportOptions:
    """Knobs of the exported predictor (search effort and storage), not of the model.

    By default the predictor searches exactly as the model predicts: its serving HNSW graphs
    copied as they are, with the search sizes it chose on its validation split
    (`engine.astec.model.select_search`), so predictions equal the torch model's. Overriding
    knn / kmu / ef trades that parity for speed or recall.
    """

    dtype: str = "float32"  # classifier rows: float32 (exact parity) or float16 (half size)
    knn: int = 0  # training points searched per text (0: the model's)
    kmu: int = 0  # label centres searched per text (0: the model's)
    ef_points: int = 0  # HNSW ef (0: the model's); hnswlib searches with max(ef, k)
    ef_centres: int = 0
    hnsw_m: int = 16  # degree of graphs built here (for a model that searched exactly)
    hnsw_ef_construction: int = 200
    exact_max: int = 2048  # at most this many distinct vectors: exact search, not HNSW
    threads: int = 2  # for building indexes only
    version: str | None = None  # default: "astec-" + sha256(model manifest)[:12]
    backend: str = "numpy"  # default feature backend recorded in predictor.json
    sparse_ranker: bool = True  # False: serve the paper's combination only (as gamma = 1):
    # 0.03-0.08 ms less per title on debian-related, -2 P@1
    label_text: bool = True  # False: serve without the label-name match (weight 0)


# ---- ONNX ------------------------------------------------------------------------------------
def _external(name: str, npy: Path, dims: list[int]) -> TensorProto:
    """An initializer whose data are the raw bytes of an .npy file after its header."""
    shape, dtype, offset = npy_header(npy)
    if list(shape) != list(dims) or np.dtype(dtype) != np.float32:
        raise ExportError(f"{npy}: expected float32{dims}, found {dtype}{shape}")
    t = TensorProto()
    t.name, t.data_type = name, TensorProto.FLOAT
    t.dims.extend(dims)
    t.data_location = TensorProto.EXTERNAL
    for k, v in (
        ("location", npy.name),
        ("offset", str(offset)),
        ("length", str(int(np.prod(dims)) * 4)),
    ):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


def write_encoder_onnx(path: Path, emb_npy: Path, res_npy: Path, vocab: int, dim: int) -> None:
    """ids int64 [n, T], weights float32 [n, T] -> v = ReLU(sum_t w_t E[id_t]), z = v + ReLU(v R^T).

    Pads are (id 0, weight 0). E and R are the .npy files next to the graph (external data).
    """
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["rows"], axis=0),
        helper.make_node("Unsqueeze", ["weights", "axis2"], ["w3"]),
        helper.make_node("Mul", ["rows", "w3"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "axis1"], ["bag"], keepdims=0),
        helper.make_node("Relu", ["bag"], ["v"]),
        helper.make_node("Gemm", ["v", "R"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Add", ["v", "hr"], ["z"]),
    ]
    inits = [
        _external("E", emb_npy, [vocab, dim]),
        _external("R", res_npy, [dim, dim]),
        helper.make_tensor("axis1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("axis2", TensorProto.INT64, [1], [2]),
    ]
    graph = helper.make_graph(
        nodes,
        "astec_encoder",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", "T"]),
            helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["n", "T"]),
        ],
        [
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["n", dim]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", dim]),
        ],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="astec-export"
    )
    model.ir_version = 8
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path))


# ---- indexes ---------------------------------------------------------------------------------
def _ann_files(
    ann, d: Path, rel: str, name: str, k: int, ef: int, opts: ExportOptions, seed: int
) -> dict:
    """Index files for an engine AnnIndex; returns its predictor.json entry.

    A model HNSW index is copied as is (same graph, same results as the model). A model that
    searched exactly gets its distinct vectors (duplicates mapped by `members`) searched exactly
    when there are at most `exact_max` of them, else through a new HNSW graph of degree
    `hnsw_m`. ef 0: the model's for a copied graph, at least 2k for a new one (the model
    searched exactly).
    """
    if ann.kind == "hnsw":
        ann.hnsw.save_index(str(d / f"{name}.hnsw"))
        return {
            "kind": "hnsw",
            "file": f"{rel}/{name}.hnsw",
            "unique": int(ann.count),
            "ef": int(ef or ann.ef_search),
        }
    V = np.ascontiguousarray(ann.vectors, dtype=np.float32)
    n = V.shape[0]
    _, first, inverse = np.unique(V, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.ravel()
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)  # groups in first-seen order
    group = rank[inverse]
    U = V[np.sort(first)]
    entry: dict = {"unique": int(U.shape[0])}
    if U.shape[0] < n:
        members = np.argsort(group, kind="stable")  # ascending original ids per group
        indptr = np.zeros(U.shape[0] + 1, np.int64)
        np.cumsum(np.bincount(group, minlength=U.shape[0]), out=indptr[1:])
        entry["members_indptr"] = f"{rel}/{_save(d / f'{name}_members_indptr.npy', indptr)}"
        entry["members"] = f"{rel}/{_save(d / f'{name}_members.npy', members.astype(np.int32))}"
    if U.shape[0] <= opts.exact_max:
        entry.update(kind="exact", file=f"{rel}/{_save(d / f'{name}_vectors.npy', U)}")
        return entry
    index = hnswlib.Index(space="ip", dim=U.shape[1])
    index.init_index(
        max_elements=U.shape[0],
        M=opts.hnsw_m,
        ef_construction=opts.hnsw_ef_construction,
        random_seed=seed,
    )
    index.add_items(U, np.arange(U.shape[0]), num_threads=opts.threads)
    index.save_index(str(d / f"{name}.hnsw"))
    entry.update(kind="hnsw", file=f"{rel}/{name}.hnsw", ef=int(ef or max(ann.ef_search, 2 * k)))
    return entry


def _save(path: Path, arr: np.ndarray) -> str:
    np.save(path, np.ascontiguousarray(arr), allow_pickle=False)
    return path.name


def _export_learner(lr, d: Path, rel: str, cfg, L: int, opts: ExportOptions, seed: int) -> dict:
    import torch  # export needs the trained torch modules; the predictor never does

    d.mkdir()
    wdt = np.float16 if opts.dtype == "float16" else np.float32

    def encoder(enc, prefix: str) -> dict:
        E = enc.embed.weight.detach().numpy().astype(np.float32)
        R = enc.baked_residual().astype(np.float32)
        _save(d / f"{prefix}embeddings.npy", E)
        _save(d / f"{prefix}residual.npy", R)
        write_encoder_onnx(
            d / f"{prefix}encoder.onnx",
            d / f"{prefix}embeddings.npy",
            d / f"{prefix}residual.npy",
            E.shape[0],
            E.shape[1],
        )
        return {
            "embeddings": f"{rel}/{prefix}embeddings.npy",
            "residual": f"{rel}/{prefix}residual.npy",
            "onnx": f"{rel}/{prefix}encoder.onnx",
        }

    with torch.no_grad():
        out: dict = {
            "alpha": float(lr.alpha),
            "beta": float(lr.beta),
            "encoder": encoder(lr.encoder, ""),
        }
        _save(d / "classifier_w.npy", lr.clf.weight.weight.detach().numpy().astype(wdt))
        _save(
            d / "classifier_b.npy", lr.clf.bias.weight.detach().numpy().ravel().astype(np.float32)
        )
        out["classifier"] = {"weight": f"{rel}/classifier_w.npy", "bias": f"{rel}/classifier_b.npy"}
        if lr.reranker is not None:
            rc = encoder(lr.reranker, "reranker_")
            _save(d / "reranker_w.npy", lr.rr_clf.weight.weight.detach().numpy().astype(wdt))
            _save(
                d / "reranker_b.npy",
                lr.rr_clf.bias.weight.detach().numpy().ravel().astype(np.float32),
            )
            rc.update(weight=f"{rel}/reranker_w.npy", bias=f"{rel}/reranker_b.npy")
            out["reranker"] = rc
    if lr.sparse is not None and opts.sparse_ranker:
        W = lr.sparse.W
        _save(d / "sparse_indptr.npy", W.indptr.astype(np.int64))
        _save(d / "sparse_indices.npy", W.indices.astype(np.int32))
        _save(d / "sparse_values.npy", W.data.astype(np.float32))
        out["sparse_ranker"] = {
            "indptr": f"{rel}/sparse_indptr.npy",
            "indices": f"{rel}/sparse_indices.npy",
            "values": f"{rel}/sparse_values.npy",
            "num_features": int(W.shape[1]),
            "gamma": float(lr.gamma),
        }
    ix = lr.index
    # search sizes: the export's, else the model's (validated choice, else its config's)
    knn, kmu = lr.search_sizes(cfg)
    knn, kmu = int(opts.knn or knn), int(opts.kmu or kmu)
    points = _ann_files(ix.points, d, rel, "points", knn, opts.ef_points, opts, seed)
    centres = _ann_files(ix.centres, d, rel, "centres", kmu, opts.ef_centres, opts, seed)
    P = ix.point_labels.tocsr()
    P.sort_indices()
    _save(d / "point_indptr.npy", P.indptr.astype(np.int64))
    _save(d / "point_labels.npy", P.indices.astype(np.int32))
    _save(d / "point_values.npy", P.data.astype(np.float32))
    _save(d / "centre_owner.npy", np.asarray(ix.centre_owner, np.int32))
    _save(d / "prior.npy", np.asarray(ix.prior, np.int32))
    prior_score = getattr(ix, "prior_score", None)
    if prior_score is None:
        prior_score = np.full(len(ix.prior), 1e-6, np.float32)
    _save(d / "prior_score.npy", np.asarray(prior_score, np.float32))
    out["shortlist"] = {
        "points_index": points,
        "centres_index": centres,
        "num_points": int(ix.points.count),
        "num_centres": int(ix.centres.count),
        "model_index_kinds": [ix.points.kind, ix.centres.kind],
        "point_indptr": f"{rel}/point_indptr.npy",
        "point_labels": f"{rel}/point_labels.npy",
        "point_values": f"{rel}/point_values.npy",
        "centre_owner": f"{rel}/centre_owner.npy",
        "prior": f"{rel}/prior.npy",
        "prior_score": f"{rel}/prior_score.npy",
        "knn": knn,
        "kmu": kmu,
        "knn_power": float(cfg.shortlist.knn_power),
        "centroid_weight": float(cfg.shortlist.centroid_weight),
        "shortlist_size": int(cfg.search.candidates),
    }
    return out


def export_model(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    opts: ExportOptions | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Export MODEL_DIR (verified on load) to OUT_DIR; returns OUT_DIR. Needs torch."""
    from engine.astec import Astec  # torch lives here, on the export side only

    opts = opts or ExportOptions()
    if opts.dtype not in ("float32", "float16"):
        raise ExportError(f"dtype must be float32 or float16, got {opts.dtype!r}")
    model_dir, out = Path(model_dir), Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    t0 = time.time()
    model = Astec.load(model_dir)
    if model.vectorizer is None:
        raise ExportError(
            f"{model_dir}: the model was trained on feature vectors (no "
            "vectorizer/), but the predictor takes texts"
        )
    L = int(model.num_labels)
    cfg = model.config
    stage = out.parent / f".{out.name}.staging-{secrets.token_hex(4)}"
    stage.mkdir(parents=True)
    try:
        model.vectorizer.save(stage / "vectorizer")
        if model.ranker_vectorizer is not None and opts.sparse_ranker:
            model.ranker_vectorizer.save(stage / "ranker_vectorizer")
        names = model.label_names if model.label_names is not None else [str(i) for i in range(L)]
        (stage / "labels.json").write_text(
            json.dumps(list(names), ensure_ascii=False), encoding="utf-8"
        )
        learners = []
        for j, lr in enumerate(tqdm(model.learners, desc="export learners", disable=not progress)):
            learners.append(
                _export_learner(
                    lr, stage / f"learner_{j}", f"learner_{j}", cfg, L, opts, cfg.seed + 1000 * j
                )
            )
        D = int(model.learners[0].encoder.embed.embedding_dim)
        config = {
            "num_labels": L,
            "dim": D,
            "vocab_size": model.vectorizer.num_features,
            "vectorizer": "vectorizer/tfidf.json",
            "label_names": "labels.json",
            "backend": opts.backend,
            "classifier_dtype": opts.dtype,
            "ensemble": model.ensemble,
            "label_text_weight": model.label_text_weight if opts.label_text else 0.0,
            "label_text_min_match": float(cfg.name_match.min_match),
            "learners": learners,
        }
        if model.ranker_vectorizer is not None and opts.sparse_ranker:
            config["ranker_vectorizer"] = "ranker_vectorizer/tfidf.json"
        (stage / "predictor.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        model_sha = sha256_file(model_dir / MANIFEST_NAME)
        import torch

        meta = {
            "version": opts.version or f"astec-{model_sha[:12]}",
            "source_model": {"path": str(model_dir.resolve()), "manifest_sha256": model_sha},
            "label_space": label_space(names),  # what a policy trained on these ids records
            "producer": {
                "numpy": np.__version__,
                "onnx": onnx.__version__,
                "hnswlib": getattr(hnswlib, "__version__", "0.8"),
                "torch": torch.__version__,
            },
            "shapes": {
                "num_labels": L,
                "dim": D,
                "vocab_size": model.vectorizer.num_features,
                "learners": len(learners),
            },
        }
        write_manifest(stage, meta)
        if out.exists():
            trash = out.parent / f".{out.name}.old-{secrets.token_hex(4)}"
            os.replace(out, trash)
            os.replace(stage, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log.info("exported %s -> %s in %.1f s", model_dir, out, time.time() - t0)
    return out
