"""The GRU policy's training knobs, torch-free: `astec personalize train` takes its option
defaults from TrainConfig (one home per default) while listing commands, before torch loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from personalization.features import SIM_DIM
from personalization.window import WINDOW


@dataclass
class GruConfig:
    """Sizes of the policy network (recorded in the manifest)."""

    K: int = WINDOW.K  # states in the window, current page included
    hidden: int = 32  # GRU hidden size H
    query_dim: int = 16  # size Q of the user / query vectors
    mlp_hidden: int = 32  # scorer hidden size M
    recurrence: bool = True  # False: the GRU is not run (its state stays 0): the ablation

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainConfig:
    """Training knobs (recorded in the version's manifest)."""

    K: int = WINDOW.K  # states per window (personalization.window)
    topk: int = WINDOW.topk  # predicted queries per page (the stream's top_k)
    hidden: int = GruConfig.hidden
    query_dim: int = GruConfig.query_dim
    mlp_hidden: int = GruConfig.mlp_hidden
    # False: the same policy without its recurrent part (same features, same training), to
    # measure what the sequence model earns
    recurrence: bool = GruConfig.recurrence
    # sd of the scorer's residual output weights at the start of training (0: the residual
    # starts at zero and the GRU gets no gradient until it grows)
    residual_sd: float = 0.05
    # objective dr: True keeps the start's linear ranking (lin.w) as fitted, so the reward
    # model and the policy move only the residual (GRU, query vectors, scorer MLP, bias)
    freeze_start: bool = True
    epochs: int = 4
    rows_per_epoch: int = 60_000  # visits sampled per epoch (0 = all); bounds CPU time
    val_rows: int = 20_000  # held-out visits scored for model selection (0 = all)
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 1e-5
    # defaults: the losses that pick the user's intent (held-out intent hit, README); for the
    # IPS click-through instead: w_click=0, w_later_click=0, w_ips=1, w_future=1
    w_click: float = 1.0
    w_later_click: float = 1.0  # log-loss of clicks on a candidate shown later in the session
    w_ips: float = 0.0
    ips_clip: float = 20.0
    w_future: float = 0.0
    future_horizon: int = 2  # next visits of the session the later/future losses read
    val_frac: float = 0.2
    holdout: float = 0.0  # last share of sessions never read (offline evaluation); 0 = all
    ttl_s: float = WINDOW.ttl_s  # states older than this before a visit are out of its window
    sim_dim: int = SIM_DIM  # size of the query vectors of the sim_* features (0 = off)
    # query clusters behind the intent_mass / page_cluster_share features
    # (personalization.query_clusters): 0 = chosen by personalization.fit_filter, -1 = off
    clusters: int = 0
    # "sim_rank": start as the fixed sim_rank ranking (click-calibrated) and learn a residual;
    # "fitted": start as a ridge logistic fit of the logged clicks on the hand features
    # (train.fit_start); "intent": the fixed intent ranking (train.intent_rank_weights,
    # click-calibrated); "select": the best by validation click likelihood of fitted, intent
    # and fitted_to_intent (train.start_weights); the start
    # is also a candidate of the best-epoch selection. "random": torch's init. "auto"
    # (default): see train.resolve_auto.
    init: str = "auto"
    # "losses": the weighted losses above, epochs chosen by their validation sum.
    # "dr": a reward model P(click | window, candidate) fitted on every logged impression, then
    # the policy trained listwise to maximise the doubly-robust value of the window's
    # candidates, kept by validation DR value (see _train_dr). On `astec simulate logs` (a
    # logger exploring only the true top queries of the session's pages: 13-19% of a policy's
    # choices outside its support) "dr" exploits its reward model where no logged click
    # corrects it and earns less actual CTR than "losses" (docs/decisions.md). It is meant for
    # logs of the exploring served policy.
    # "auto" (default): "dr" when the logger explored the policy's own candidates, else
    # "losses" (resolve_auto; train_policy resolves it): on such logs dr / fitted earns more
    # than losses / sim_rank (docs/personalization.md, Results).
    objective: str = "auto"
    reward_epochs: int = 2
    dr_temperature: float = 0.5  # softmax temperature of the listwise DR objective
    threads: int = 2
    seed: int = 0

    def gru_config(self) -> GruConfig:
        return GruConfig(
            K=self.K,
            hidden=self.hidden,
            query_dim=self.query_dim,
            mlp_hidden=self.mlp_hidden,
            recurrence=self.recurrence,
        )
