"""The trainable GRU policy (torch, CPU). Mirrors personalization.scoring exactly.

Only training imports this module; serving runs the exported numpy weights.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from personalization.features import N_FEATURES
from personalization.train_config import GruConfig


class GruPolicyNet(nn.Module):
    """GRU over the window's page features + a candidate scorer.

    The query representation is a learnt projection of the (fixed, L2-normalised) Astec
    classifier rows, so a query never clicked in the logs still gets a sensible vector.
    """

    def __init__(self, cfg: GruConfig, D: int, classifier_rows: np.ndarray, log_pop: np.ndarray):
        super().__init__()
        self.cfg = cfg
        self.cell = nn.GRUCell(D + 1, cfg.hidden)  # z + the block-start channel
        self.user = nn.Linear(cfg.hidden, cfg.query_dim)
        self.query_proj = nn.Linear(classifier_rows.shape[1], cfg.query_dim, bias=False)
        self.mlp1 = nn.Linear(N_FEATURES + cfg.query_dim, cfg.mlp_hidden)
        self.mlp2 = nn.Linear(cfg.mlp_hidden, 1)
        self.lin = nn.Linear(N_FEATURES, 1, bias=False)
        self.register_buffer(
            "rows", torch.from_numpy(np.ascontiguousarray(classifier_rows, np.float32))
        )
        self.register_buffer("log_pop", torch.from_numpy(np.asarray(log_pop, np.float32)))

    def forward(self, z, state_mask, cand_ids, cand_mask, feats):
        """Logits [B,C] (-inf on padding). Inputs are EventBatch fields as tensors."""
        B, K, _ = z.shape
        h = z.new_zeros(B, self.cfg.hidden)
        for t in range(K):
            hn = self.cell(z[:, t], h)
            h = torch.where(state_mask[:, t, None], hn, h)
        u = torch.tanh(self.user(h))
        # project the whole (small) table once, then gather: far cheaper than projecting
        # B*C gathered D-dim rows when many candidates repeat across a batch
        e = self.query_proj(self.rows)[cand_ids.clamp(min=0)]
        x = torch.cat([feats, e * u[:, None, :]], dim=-1)
        logit = self.mlp2(torch.relu(self.mlp1(x)))[..., 0] + self.lin(feats)[..., 0]
        return logit.masked_fill(~cand_mask, float("-inf"))

    @torch.no_grad()
    def start_at(self, lin_w: np.ndarray, bias: float) -> None:
        """Start as the fixed linear ranking feats @ lin_w + bias: the MLP's output layer is
        zeroed, so the user/query term begins as a residual that training grows from 0."""
        self.lin.weight.copy_(torch.from_numpy(np.asarray(lin_w, np.float32))[None])
        self.mlp2.weight.zero_()
        self.mlp2.bias.fill_(float(bias))

    @torch.no_grad()
    def export_weights(self) -> dict[str, np.ndarray]:
        """The flat float32 weight dict that personalization.scoring serves."""

        def npy(t):
            return np.ascontiguousarray(t.detach().cpu().numpy().astype(np.float32))

        return {
            "gru.w_ih": npy(self.cell.weight_ih),
            "gru.b_ih": npy(self.cell.bias_ih),
            "gru.w_hh": npy(self.cell.weight_hh),
            "gru.b_hh": npy(self.cell.bias_hh),
            "user.w": npy(self.user.weight),
            "user.b": npy(self.user.bias),
            "query_table": npy(self.query_proj(self.rows)),
            "log_pop": npy(self.log_pop),
            "mlp.w1": npy(self.mlp1.weight),
            "mlp.b1": npy(self.mlp1.bias),
            "mlp.w2": npy(self.mlp2.weight),
            "mlp.b2": npy(self.mlp2.bias),
            "lin.w": npy(self.lin.weight[0]),
        }
