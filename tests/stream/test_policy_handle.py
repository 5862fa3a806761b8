"""The top1 policy picks the page's best predicted query and never a padding id (-1); a GRU
policy whose window does not fit the stream's settings is an error at start and refused on
reload."""

import numpy as np
import pytest

from stream.policy_handle import Top1Policy, make_policy


def test_top1_picks_best_valid_query():
    ids = np.array([[7, 3, 9], [-1, 4, 5], [-1, -1, -1]])
    scores = np.array([[0.2, 0.9, 0.1], [0.99, 0.5, 0.6], [0.5, 0.4, 0.3]], np.float32)
    q, s, prop = Top1Policy().choose_batch(None, None, ids, scores)
    assert q.tolist() == [3, 5, -1]
    assert np.allclose(s[:2], [0.9, 0.6]) and prop.tolist() == [1.0, 1.0, 1.0]


def test_make_policy_rejects_unknown_and_gru_without_model():
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
    q, _, prop = pol.choose_batch([[1], [1]], [None, None], ids, scores)
    assert q.tolist() == [11, 4] and np.allclose(prop, [0.05, 1.0])
    f = pol.serve_batch([[1], [1]], [None, None], ids, scores).fields(1)
    assert f["candidate_ids"] == [4, 5] and f["candidate_propensities"] == [1.0, 0.0]


def tiny_gru(root, K=8, topk=10):
    """A GRU policy version (untrained, small) published and promoted under `root`."""
    from personalization.features import sim_table_from_rows
    from personalization.gru import GruPolicyNet
    from personalization.train import TrainConfig, publish

    cfg = TrainConfig(K=K, topk=topk, hidden=4, query_dim=2, mlp_hidden=4)
    rows = np.random.default_rng(0).normal(size=(20, 8)).astype(np.float32)
    w = GruPolicyNet(cfg.gru_config(), 8, rows, np.zeros(20, np.float32)).export_weights()
    w["sim_table"], w["sim_norm"] = sim_table_from_rows(rows, 4), np.array([0, 1], np.float32)
    return publish(root, w, cfg, {})[0]


def test_window_checks_name_both_settings_and_the_fix():
    from stream.policy_handle import PolicyMismatch, check_window
    from stream.settings import Settings

    s = Settings().replace(state_k=16, top_k=10)
    check_window(s, 16, 10, "gru/v1")  # fits: K = state_k, topk = top_k
    check_window(s, 8, None, "gru/v1")  # a version that did not record its topk
    with pytest.raises(PolicyMismatch) as e:
        check_window(s, 20, 10, "gru/v1")
    msg = str(e.value)
    assert "gru/v1" in msg and "K=20" in msg and "state_k=16" in msg and "--K 16" in msg
    assert "\n" not in msg
    with pytest.raises(PolicyMismatch) as e:
        check_window(s, 8, 5, "gru/v1")
    msg = str(e.value)
    assert "topk=5" in msg and "top_k=10" in msg and "set top_k = 5" in msg
    assert "--topk 10" in msg and "\n" not in msg


def test_gru_that_does_not_fit_the_stream_fails_at_start_and_is_refused_on_reload(tmp_path):
    from stream.policy_handle import PolicyMismatch
    from stream.settings import Settings

    root = tmp_path / "gru"
    v1 = tiny_gru(root, K=8, topk=10)
    with pytest.raises(PolicyMismatch, match="state_k=4"):
        make_policy("gru", root, settings=Settings().replace(state_k=4))
    with pytest.raises(PolicyMismatch, match="top_k=3"):
        make_policy("gru", root, settings=Settings().replace(top_k=3))
    pol = make_policy("gru", root, settings=Settings(), check_every_s=0.0)
    assert pol.version == v1 and pol.gru.K == 8 and pol.gru.topk == 10
    v2 = tiny_gru(root, K=32)  # more states than the stream keeps: refused, v1 kept
    assert not pol.maybe_reload() and not pol.maybe_reload()
    assert pol.version == v1 and list(pol.refused) == [v2] and "K=32" in pol.refused[v2]
    v3 = tiny_gru(root, K=16)
    assert pol.maybe_reload() and pol.version == v3 and pol.gru.K == 16


def test_stream_run_refuses_a_gru_that_does_not_fit_before_any_worker_starts(
    astec_predictor, tmp_path, monkeypatch
):
    """`astec stream run` checks the policy before the broker or a worker: one line, exit 1."""
    from click.testing import CliRunner

    from stream.cli_stream import stream

    root = tmp_path / "gru"
    tiny_gru(root, K=8)
    monkeypatch.setenv("ASTEC_SERVICES_DIR", str(tmp_path))  # no services: nothing to reach
    monkeypatch.setenv("ASTEC_STATE_K", "4")
    args = ["run", "--model", astec_predictor, "--policy", "gru", "--policy-model", str(root)]
    r = CliRunner().invoke(stream, args)
    assert r.exit_code == 1, r.output
    assert "K=8" in r.output and "state_k=4" in r.output and "ASTEC_STATE_K" in r.output
