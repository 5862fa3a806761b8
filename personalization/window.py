"""The window a GRU policy reads per event: the one home of its K and top-k defaults.

Training (TrainConfig, GruConfig) and `astec personalize train` take their defaults from WINDOW;
a published version records its own K, topk and ttl_s in its manifest config, and the stream checks
them against its `state_k` / `top_k` settings when it starts (stream.policy_handle.check_window).
No imports: the CLI reads it while listing commands.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    """K states per event (the current page included), each with the page's top-k queries."""

    K: int = 8  # at most the stream's state_k (the states Redis keeps per user)
    topk: int = 10  # the stream's top_k: features are learnt on that many queries per page
    # states older than this before a visit are out of its window (training masks them, serving
    # drops them: personalization.state.serving_window); at most the stream's state_ttl_s
    ttl_s: float = 30 * 86400.0


WINDOW = Window()
