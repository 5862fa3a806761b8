"""The top1 policy picks the page's best predicted query and never a padding id (-1)."""

import numpy as np

from stream.policy_handle import Top1Policy, make_policy


def test_top1_picks_best_valid_query():
    ids = np.array([[7, 3, 9], [-1, 4, 5], [-1, -1, -1]])
    scores = np.array([[0.2, 0.9, 0.1], [0.99, 0.5, 0.6], [0.5, 0.4, 0.3]], np.float32)
    q, s, prop = Top1Policy().choose_batch(None, None, ids, scores)
    assert q.tolist() == [3, 5, -1]
    assert np.allclose(s[:2], [0.9, 0.6]) and prop.tolist() == [1.0, 1.0, 1.0]


def test_make_policy_rejects_unknown_and_gru_without_model():
    import pytest

    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")
    with pytest.raises(ValueError, match="--policy-model"):
        make_policy("gru")


def test_served_fields_carry_candidates_and_propensities():
    """What the worker logs: every candidate with its score and propensity; the top1 policy
    is deterministic, and a GRU event it cannot score falls back to the page's top query."""
    from personalization.policy import Served
    from stream.policy_handle import GruStreamPolicy

    ids = np.array([[7, 3, 9], [4, 5, -1]])
    scores = np.array([[0.2, 0.9, 0.1], [0.7, 0.6, 0.0]], np.float32)
    sv = Top1Policy().serve_batch(None, None, ids, scores)
    f = sv.fields(0)
    assert f["query_id"] == 3 and f["propensity"] == 1.0 and f["candidate_ids"] == [7, 3, 9]
    assert f["candidate_propensities"] == [0.0, 1.0, 0.0]

    class Stub:  # the GRU served row 0 by exploring; row 1 had nothing to show
        version = "v1"

        def serve_batch(self, h, c, eps, temp, rng):
            return Served(
                query=np.array([11, -1]),
                score=np.array([0.2, 0.0], np.float32),
                propensity=np.array([0.05, 1.0], np.float32),
                greedy=np.array([False, True]),
                cand_ids=np.array([[12, 11, 13, 14], [-1, -1, -1, -1]]),
                cand_scores=np.array([[0.5, 0.2, 0.2, 0.1], [0, 0, 0, 0]], np.float32),
                cand_prop=np.array([[0.9, 0.05, 0.03, 0.02], [0, 0, 0, 0]], np.float32),
            )

    pol = GruStreamPolicy(Stub())
    q, s, prop = pol.choose_batch([[1], [1]], [None, None], ids, scores)
    assert q.tolist() == [11, 4] and np.allclose(prop, [0.05, 1.0])
    f = pol.serve_batch([[1], [1]], [None, None], ids, scores).fields(1)
    assert f["candidate_ids"] == [4, 5] and f["candidate_propensities"] == [1.0, 0.0]
