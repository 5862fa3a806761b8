"""The trainable GRU policy (torch, CPU). Mirrors personalization.scoring exactly.

Only training imports this module; serving runs the exported numpy weights.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from personalization.features import N_FEATURES, gru_input_dim
from personalization.train_config import GruConfig


class GruPolicyNet(nn.Module):
    """GRU over the window's states (features.EventBatch.z) + a candidate scorer.

    The query representation is a learnt projection of the (fixed, L2-normalised) Astec
    classifier rows plus a learnt vector of the query's cluster (query_cluster [L], -1 = none),
    so a query never clicked in the logs still gets a sensible vector; both fold into the
    exported query_table. With cfg.recurrence off the GRU is not run (its hidden state stays 0
    and exports as zero weights, which keep it at 0): the same scorer without the sequence.
    """

    def __init__(
        self,
        cfg: GruConfig,
        D: int,
        classifier_rows: np.ndarray,
        log_pop: np.ndarray,
        query_cluster: np.ndarray | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        L = classifier_rows.shape[0]
        qc = np.full(L, -1) if query_cluster is None else np.asarray(query_cluster).astype(int)
        n_cl = max(int(qc.max()) + 1, 1)
        # D page features + block start + gap + each cluster's evidence (features.EventBatch.z)
        self.cell = nn.GRUCell(gru_input_dim(D, 0 if query_cluster is None else n_cl), cfg.hidden)
        self.user = nn.Linear(cfg.hidden, cfg.query_dim)
        self.query_proj = nn.Linear(classifier_rows.shape[1], cfg.query_dim, bias=False)
        # the cluster vectors (row n_cl, the "no cluster" row, stays 0 through the mask)
        self.cluster_emb = nn.Embedding(n_cl + 1, cfg.query_dim)
        nn.init.normal_(self.cluster_emb.weight, std=0.1)
        self.register_buffer("qc", torch.from_numpy(np.where(qc < 0, n_cl, qc).astype(np.int64)))
        self.register_buffer("qc_on", torch.from_numpy((qc >= 0).astype(np.float32))[:, None])
        self.mlp1 = nn.Linear(N_FEATURES + cfg.query_dim, cfg.mlp_hidden)
        self.mlp2 = nn.Linear(cfg.mlp_hidden, 1)
        self.lin = nn.Linear(N_FEATURES, 1, bias=False)
        self.register_buffer(
            "rows", torch.from_numpy(np.ascontiguousarray(classifier_rows, np.float32))
        )
        self.register_buffer("log_pop", torch.from_numpy(np.asarray(log_pop, np.float32)))

    def query_table(self) -> torch.Tensor:
        """[L, Q] every query's vector: projected classifier row + its cluster's vector."""
        return self.query_proj(self.rows) + self.cluster_emb(self.qc) * self.qc_on

    def forward(self, z, state_mask, cand_ids, cand_mask, feats):
        """Logits [B,C] (-inf on padding). Inputs are EventBatch fields as tensors."""
        B, K, _ = z.shape
        h = z.new_zeros(B, self.cfg.hidden)
        if self.cfg.recurrence:
            for t in range(K):
                hn = self.cell(z[:, t], h)
                h = torch.where(state_mask[:, t, None], hn, h)
        u = torch.tanh(self.user(h))
        # project the whole (small) table once, then gather: far cheaper than projecting
        # B*C gathered D-dim rows when many candidates repeat across a batch
        e = self.query_table()[cand_ids.clamp(min=0)]
        x = torch.cat([feats, e * u[:, None, :]], dim=-1)
        logit = self.mlp2(torch.relu(self.mlp1(x)))[..., 0] + self.lin(feats)[..., 0]
        return logit.masked_fill(~cand_mask, float("-inf"))

    @torch.no_grad()
    def start_at(self, lin_w: np.ndarray, bias: float, residual_sd: float = 0.0) -> None:
        """Start as the linear ranking feats @ lin_w + bias plus a residual scorer term whose
        output weights are drawn with sd `residual_sd` (0: exactly the linear ranking, as the
        selection's `start` is served). A residual that starts non-zero gets gradients into
        the GRU and the query vectors from the first step; one at zero gets them only once its
        output layer has grown."""
        self.lin.weight.copy_(torch.from_numpy(np.asarray(lin_w, np.float32))[None])
        if residual_sd > 0:
            nn.init.normal_(self.mlp2.weight, std=residual_sd)
        else:
            self.mlp2.weight.zero_()
        self.mlp2.bias.fill_(float(bias))

    @torch.no_grad()
    def export_weights(self) -> dict[str, np.ndarray]:
        """The flat float32 weight dict that personalization.scoring serves."""

        def npy(t):
            return np.ascontiguousarray(t.detach().cpu().numpy().astype(np.float32))

        # without recurrence the hidden state is 0: zero GRU weights keep it there at serving
        on = 1.0 if self.cfg.recurrence else 0.0
        return {
            "gru.w_ih": npy(self.cell.weight_ih * on),
            "gru.b_ih": npy(self.cell.bias_ih * on),
            "gru.w_hh": npy(self.cell.weight_hh * on),
            "gru.b_hh": npy(self.cell.bias_hh * on),
            "user.w": npy(self.user.weight * on),
            "user.b": npy(self.user.bias),
            "query_table": npy(self.query_table()),
            "log_pop": npy(self.log_pop),
            "mlp.w1": npy(self.mlp1.weight),
            "mlp.b1": npy(self.mlp1.bias),
            "mlp.w2": npy(self.mlp2.weight),
            "mlp.b2": npy(self.mlp2.bias),
            "lin.w": npy(self.lin.weight[0]),
        }
