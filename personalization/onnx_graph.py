"""The policy network as an ONNX graph, built from the exported numpy weights (no torch).

ONNX Runtime's fused GRU runs the K-step recurrence in ~15 us where a numpy loop of tiny
ufuncs costs ~70 us, which is what keeps a serving event under 0.2 ms. The graph takes
left-aligned sequences with their lengths (the GRU op's `sequence_lens`) and returns logits for
every candidate slot; masking padding to -inf stays in numpy.
  inputs : z [T,B,D] float32, seq_lens [B] int32, cand [B,C] int64 (>= 0), feats [B,C,F] float32
  output : logits [B,C] float32
"""

from __future__ import annotations

import numpy as np

OPSET = 17


def build_onnx(w: dict[str, np.ndarray]) -> bytes:
    """Serialized ONNX model equal (to float rounding) to personalization.scoring."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    H = w["gru.w_hh"].shape[1]
    D = w["gru.w_ih"].shape[1]
    F = w["lin.w"].shape[0]
    f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
    init = [
        # torch gate order (r, z, n) -> ONNX order (z, r, h)
        numpy_helper.from_array(f32(_zrh(w["gru.w_ih"], H))[None], "W"),
        numpy_helper.from_array(f32(_zrh(w["gru.w_hh"], H))[None], "R"),
        numpy_helper.from_array(
            f32(np.concatenate([_zrh(w["gru.b_ih"], H), _zrh(w["gru.b_hh"], H)]))[None], "Bgru"
        ),
        numpy_helper.from_array(f32(w["user.w"].T), "Wu"),
        numpy_helper.from_array(f32(w["user.b"]), "bu"),
        numpy_helper.from_array(f32(w["query_table"]), "Qt"),
        numpy_helper.from_array(f32(w["mlp.w1"].T), "W1"),
        numpy_helper.from_array(f32(w["mlp.b1"]), "b1"),
        numpy_helper.from_array(f32(w["mlp.w2"].T), "W2"),
        numpy_helper.from_array(f32(w["mlp.b2"]), "b2"),
        numpy_helper.from_array(f32(w["lin.w"][:, None]), "Wl"),
        numpy_helper.from_array(np.array([0], np.int64), "ax0"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
        numpy_helper.from_array(np.array([-1], np.int64), "axm1"),
    ]
    nodes = [
        helper.make_node(
            "GRU",
            ["z", "W", "R", "Bgru", "seq_lens"],
            ["", "yh"],
            hidden_size=H,
            linear_before_reset=1,
        ),
        helper.make_node("Squeeze", ["yh", "ax0"], ["h"]),
        helper.make_node("MatMul", ["h", "Wu"], ["hu"]),
        helper.make_node("Add", ["hu", "bu"], ["hu_b"]),
        helper.make_node("Tanh", ["hu_b"], ["u"]),
        helper.make_node("Unsqueeze", ["u", "ax1"], ["u3"]),
        helper.make_node("Gather", ["Qt", "cand"], ["e"], axis=0),
        helper.make_node("Mul", ["e", "u3"], ["ue"]),
        helper.make_node("Concat", ["feats", "ue"], ["x"], axis=-1),
        helper.make_node("MatMul", ["x", "W1"], ["x1"]),
        helper.make_node("Add", ["x1", "b1"], ["x1b"]),
        helper.make_node("Relu", ["x1b"], ["hid"]),
        helper.make_node("MatMul", ["hid", "W2"], ["o2"]),
        helper.make_node("Squeeze", ["o2", "axm1"], ["o2s"]),
        helper.make_node("Add", ["o2s", "b2"], ["o2b"]),
        helper.make_node("MatMul", ["feats", "Wl"], ["ol"]),
        helper.make_node("Squeeze", ["ol", "axm1"], ["ols"]),
        helper.make_node("Add", ["o2b", "ols"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "astec_gru_policy",
        [
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["T", "B", D]),
            helper.make_tensor_value_info("seq_lens", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("cand", TensorProto.INT64, ["B", "C"]),
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, ["B", "C", F]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "C"])],
        init,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="astec-personalization"
    )
    model.ir_version = min(model.ir_version, 9)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _zrh(a: np.ndarray, H: int) -> np.ndarray:
    """Reorder the leading 3H axis from torch's (r, z, n) to ONNX's (z, r, h)."""
    return np.concatenate([a[H : 2 * H], a[:H], a[2 * H :]], axis=0)


def session(model_bytes: bytes, threads: int = 1):
    """An ONNX Runtime CPU session tuned for tiny per-event calls."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
