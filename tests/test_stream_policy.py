"""The top1 policy picks the page's best predicted query and never a padding id (-1)."""
import numpy as np

from stream.policy import Top1Policy, make_policy


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
