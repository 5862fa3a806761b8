"""Torch-free forward pass of the GRU policy: the serving path and the parity reference.

Weights are a flat dict of float32 numpy arrays (the safetensors file's contents):
  gru.w_ih [3H,D], gru.b_ih [3H], gru.w_hh [3H,H], gru.b_hh [3H]   (torch gate order r, z, n)
  user.w [Q,H], user.b [Q]          GRU state -> the user's vector in query space
  query_table [L,Q]                 projected, normalised Astec classifier row of every query
  log_pop [L]                       normalised log popularity of every query
  mlp.w1 [M,F+Q], mlp.b1 [M], mlp.w2 [1,M], mlp.b2 [1], lin.w [F]   candidate scorer
  sim_table [L,d], sim_norm [2]     unit query vectors and the (mean, sd) of their cosines,
                                    behind the sim_* hand features
A candidate's logit = lin.w . f + mlp([f, u * e_q]) where f are the hand features, u the user
vector and e_q the query's row in query_table.
"""

from __future__ import annotations

import numpy as np

from personalization.features import EventBatch

WEIGHT_SHAPES = (
    "gru.w_ih",
    "gru.b_ih",
    "gru.w_hh",
    "gru.b_hh",
    "user.w",
    "user.b",
    "query_table",
    "log_pop",
    "mlp.w1",
    "mlp.b1",
    "mlp.w2",
    "mlp.b2",
    "lin.w",
    "sim_table",
    "sim_norm",
)


def _gru_fast_weights(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Derived GRU matrices (cached in `w` under "_fast.*"): the r/z biases of both halves
    folded into the input projection and the sigmoid written as 0.5 * (tanh(x / 2) + 1), so a
    step is one small matmul and ~10 vector ufuncs (this loop is the serving cost)."""
    if "_fast.wx" in w:
        return w
    H = w["gru.w_hh"].shape[1]
    half = np.ones(3 * H, np.float32)
    half[: 2 * H] = 0.5
    bx = w["gru.b_ih"].copy()
    bx[: 2 * H] += w["gru.b_hh"][: 2 * H]
    w["_fast.wx"] = np.ascontiguousarray(w["gru.w_ih"].T * half)
    w["_fast.bx"] = (bx * half).astype(np.float32)
    w["_fast.wh"] = np.ascontiguousarray(w["gru.w_hh"].T * 0.5)
    w["_fast.bhn"] = (0.5 * w["gru.b_hh"][2 * H :]).astype(np.float32)
    return w


def gru_final_state(w: dict[str, np.ndarray], z: np.ndarray, state_mask: np.ndarray) -> np.ndarray:
    """Final GRU hidden state [B,H] over right-aligned, masked inputs z [B,K,D].

    Same maths as torch.nn.GRUCell (gates r, z, n; n = tanh(W_in x + b_in + r (W_hn h + b_hn))).
    Right alignment means a row's hidden state is exactly zero until its first real state, so
    masking is one multiply.
    """
    w = _gru_fast_weights(w)
    B, K, D = z.shape
    H = w["gru.w_hh"].shape[1]
    filled = state_mask.any(0)
    start = int(np.argmax(filled)) if filled.any() else K
    T = K - start
    gi = (z[:, start:].reshape(B * T, D) @ w["_fast.wx"]).reshape(B, T, 3 * H)
    gi += w["_fast.bx"]
    wh, bhn = w["_fast.wh"], w["_fast.bhn"]
    m = None if state_mask[:, start:].all() else state_mask[:, start:].astype(np.float32)
    h = np.zeros((B, H), np.float32)
    for t in range(T):  # K sequential steps on [B,H] blocks
        gh = h @ wh  # 0.5 * W_hh h
        a = gi[:, t, : 2 * H] + gh[:, : 2 * H]  # halves of the r, z pre-activations
        np.tanh(a, out=a)
        a += 1.0  # a = [2r, 2u]
        gh_n = gh[:, 2 * H :]
        gh_n += bhn
        n = a[:, :H] * gh_n  # r * (W_hn h + b_hn)
        n += gi[:, t, 2 * H :]
        np.tanh(n, out=n)
        h -= n
        h *= a[:, H:]
        h *= 0.5
        h += n  # h' = n + u (h - n)
        if m is not None:
            h *= m[:, t, None]
    return h


def candidate_logits(w: dict[str, np.ndarray], batch: EventBatch) -> np.ndarray:
    """Logits [B,C] of every candidate (-inf where the candidate slot is padding)."""
    h = gru_final_state(w, batch.z, batch.state_mask)
    u = np.tanh(h @ w["user.w"].T + w["user.b"])  # [B,Q]
    safe = np.where(batch.cand_mask, batch.cand_ids, 0)
    e = w["query_table"][safe]  # [B,C,Q]
    x = np.concatenate([batch.feats, e * u[:, None, :]], axis=-1)  # [B,C,F+Q]
    hid = np.maximum(x @ w["mlp.w1"].T + w["mlp.b1"], 0.0)
    logit = (hid @ w["mlp.w2"].T)[..., 0] + w["mlp.b2"][0] + batch.feats @ w["lin.w"]
    return np.where(batch.cand_mask, logit, -np.inf).astype(np.float32)


def softmax_masked(logits: np.ndarray) -> np.ndarray:
    """Row softmax that ignores -inf slots (rows of all -inf give zeros)."""
    m = np.max(logits, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(logits - m)
    s = e.sum(-1, keepdims=True)
    return e / np.maximum(s, 1e-30)
