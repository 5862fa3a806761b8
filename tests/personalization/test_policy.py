"""GRU policy serving: cold start, K boundaries, bad state, corrupt model files, torch-free
serving, torch/numpy/ONNX agreement and hot reload from the GRU registry.

The policy under test is really trained (a few epochs, seconds) on a small synthetic visit log
in which sessions keep one intent topic and a third of the pages are off-intent.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from personalization.artifact import ONNX, WEIGHTS, PolicyFileError
from personalization.features import cluster_lookup
from personalization.policy import BACKENDS, NO_QUERY, GruPolicy
from personalization.train import make_batch, publish, split_rows, train_policy
from testkit.paths import REPO
from testkit.policy_data import CFG, state, synthetic_visits, window_states


@pytest.fixture(scope="module")
def world():
    return synthetic_visits()


@pytest.fixture(scope="module")
def trained(world):
    v, rows_w, _, _ = world
    weights, report = train_policy(v, rows_w, CFG, progress=False)
    return weights, report


@pytest.fixture()
def registry(trained, tmp_path):
    weights, report = trained
    root = tmp_path / "gru"
    version, path = publish(root, weights, CFG, {"engine_version": "synthetic", "train": report})
    return root, version, path


def test_cold_start_gets_current_pages_top_query(registry, world):
    pol = GruPolicy.load(registry[0])
    cur = state(0, world[0].Z[3], [7, 2, 9], [0.2, 0.9, 0.5])
    assert pol.choose([], cur) == (2, pytest.approx(0.9))
    assert pol.choose_batch([[]], [cur]) == [(2, pytest.approx(0.9))]
    empty = state(1, world[0].Z[3], [], [])
    assert pol.choose([], empty) == (NO_QUERY, 0.0)


def test_k_boundaries(registry, world):
    v = world[0]
    pol = GruPolicy.load(registry[2])
    K = pol.K
    long = window_states(v, 40, K + 5)
    cur = long[-1]
    for n_hist in (0, 1, K - 1, K, K + 4):
        hist = long[-1 - n_hist : -1] if n_hist else []
        q, s = pol.choose(hist, cur)
        allowed = set(np.concatenate([st.query_ids for st in [*hist[-(K - 1) :], cur]]).tolist())
        assert q in allowed and 0.0 < s <= 1.0, n_hist
    # only the last K-1 history states count: older ones change nothing
    assert pol.choose(long[:-1], cur) == pol.choose(long[-K:-1], cur)
    ranked = pol.rank_batch([long[-K:-1]], [cur])[0]
    assert len(ranked[0]) == len(np.unique(np.concatenate([st.query_ids for st in long[-K:]])))
    assert np.isclose(ranked[1].sum(), 1.0, atol=1e-5) and np.all(np.diff(ranked[1]) <= 0)


def test_bad_history_states_are_skipped_not_fatal(registry, world):
    v = world[0]
    pol = GruPolicy.load(registry[2])
    good = window_states(v, 30, 3)
    wrong_dim = state(90, np.zeros(7), [1, 2], [0.5, 0.4])
    no_queries = state(91, v.Z[0], [], [])
    out_of_space = state(92, v.Z[0], [10**6, 3], [0.9, 0.1])
    q, _s = pol.choose([wrong_dim, no_queries, good[0], out_of_space, good[1]], good[2])
    assert q >= 0 and q != 10**6
    assert pol.choose([good[0], wrong_dim, good[1]], good[2]) == pol.choose(good[:2], good[2])
    # nothing usable left in the history (expired / corrupt state): the cold-start rule
    top = int(good[2].query_ids[np.argmax(good[2].scores)])
    assert pol.choose([wrong_dim, no_queries], good[2])[0] == top
    # an unusable current page falls back to its own top query (or none), never raises
    assert pol.choose(good[:2], state(93, np.zeros(3), [5, 6], [0.1, 0.8])) == (
        6,
        pytest.approx(0.8),
    )
    assert pol.choose(good[:2], no_queries) == (NO_QUERY, 0.0)


def test_choose_batch_equals_choose(registry, world):
    v = world[0]
    pol = GruPolicy.load(registry[2])
    wins = [window_states(v, r, n) for r, n in ((50, 4), (60, 1), (70, 2), (80, 6))]
    single = [pol.choose(w[:-1], w[-1]) for w in wins]
    batch = pol.choose_batch([w[:-1] for w in wins], [w[-1] for w in wins])
    assert [q for q, _ in single] == [q for q, _ in batch]
    assert np.allclose([s for _, s in single], [s for _, s in batch], atol=1e-6)


def test_torch_numpy_onnx_compiled_agree(trained, world, registry):
    import torch

    from personalization.features import log_popularity
    from personalization.gru import GruPolicyNet
    from personalization.scoring import candidate_logits

    v, rows_w, _, _ = world
    weights, _ = trained
    net = GruPolicyNet(
        CFG.gru_config(),
        rows_w.shape[1],
        rows_w / np.linalg.norm(rows_w, axis=1, keepdims=True),
        weights["log_pop"],
        weights.get("query_cluster"),
    )
    net.load_state_dict({**net.state_dict(), **_state_from_weights(net, weights)})
    b = make_batch(
        v,
        np.arange(5, 400),
        CFG.K,
        CFG.ttl_s,
        weights["log_pop"],
        weights["sim_table"],
        weights["sim_norm"],
        cluster_lookup(dict(weights)),
    )
    with torch.no_grad():
        lt = net(
            *[torch.from_numpy(x) for x in (b.z, b.state_mask, b.cand_ids, b.cand_mask, b.feats)]
        ).numpy()
    ln = candidate_logits(dict(weights), b)
    lo = GruPolicy.load(registry[2], backend="onnx").logits(b)
    lc = GruPolicy.load(registry[2], backend="compiled").logits(b)
    fin = np.isfinite(lt)
    assert (np.isfinite(ln) == fin).all() and (np.isfinite(lo) == fin).all()
    assert (np.isfinite(lc) == fin).all()
    assert np.abs(lt[fin] - ln[fin]).max() < 1e-4
    assert np.abs(lo[fin] - ln[fin]).max() < 1e-4
    assert np.abs(lc[fin] - ln[fin]).max() < 1e-4
    assert log_popularity(np.array([0, 1, 3])).max() == pytest.approx(1.0)


def test_without_recurrence_the_history_reaches_the_policy_only_through_its_features(
    trained, world, tmp_path
):
    """--no-recurrence: the same scorer with the GRU off. Served (ONNX and numpy) its logits
    do not move when the GRU's inputs change and the hand features stay, while the full
    policy's, whose recurrent part was trained from a non-zero start, do."""
    import dataclasses

    v, rows_w, _, _ = world
    cfg = dataclasses.replace(CFG, recurrence=False)
    w_off, rep = train_policy(v, rows_w, cfg, progress=False)
    assert rep["config"]["recurrence"] is False
    assert not np.any(w_off["gru.w_ih"]) and not np.any(w_off["user.w"])
    _, path = publish(tmp_path / "off", w_off, cfg, {"engine_version": "synthetic", "train": rep})
    _, path_on = publish(tmp_path / "on", trained[0], CFG, {"engine_version": "synthetic"})
    for p, moves in ((path, False), (path_on, True)):
        for backend in BACKENDS:
            pol = GruPolicy.load(p, backend=backend)
            b = make_batch(
                v,
                np.arange(5, 400),
                CFG.K,
                CFG.ttl_s,
                pol.weights["log_pop"],
                pol.weights["sim_table"],
                pol.weights["sim_norm"],
                cluster_lookup(pol.weights),
            )
            before = pol.logits(b)
            b.z = np.ascontiguousarray(b.z[::-1])  # other rows' sequences, same hand features
            after = pol.logits(b)
            fin = np.isfinite(before)
            assert (np.abs(after[fin] - before[fin]).max() > 1e-4) == moves, (p, backend)


def _state_from_weights(net, w):
    """Torch parameters equal to the exported weights (query_table comes from query_proj)."""
    import torch

    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731
    sd = {
        "cell.weight_ih": t(w["gru.w_ih"]),
        "cell.bias_ih": t(w["gru.b_ih"]),
        "cell.weight_hh": t(w["gru.w_hh"]),
        "cell.bias_hh": t(w["gru.b_hh"]),
        "user.weight": t(w["user.w"]),
        "user.bias": t(w["user.b"]),
        "mlp1.weight": t(w["mlp.w1"]),
        "mlp1.bias": t(w["mlp.b1"]),
        "mlp2.weight": t(w["mlp.w2"]),
        "mlp2.bias": t(w["mlp.b2"]),
        "lin.weight": t(w["lin.w"][None]),
    }
    # solve query_proj and the cluster vectors from the exported table:
    # [rows_n, one-hot cluster] @ [P^T; emb] = table (least squares, exact here)
    rows = net.rows.numpy()
    n_cl = net.cluster_emb.weight.shape[0] - 1
    on = net.qc_on.numpy()
    X = np.concatenate([rows, np.eye(n_cl + 1, dtype=np.float32)[net.qc.numpy()] * on], 1)
    sol, *_ = np.linalg.lstsq(X, w["query_table"], rcond=None)
    sd["query_proj.weight"] = t(sol[: rows.shape[1]].T.astype(np.float32))
    sd["cluster_emb.weight"] = t(sol[rows.shape[1] :].astype(np.float32))
    return sd


@pytest.mark.parametrize(
    "damage",
    [
        "flip_weights",
        "flip_onnx",
        "truncate_manifest",
        "missing_weights",
        "wrong_format",
        "cluster_factors_disagree",
    ],
)
def test_corrupt_model_is_refused_with_the_file_named(registry, damage):
    vdir = registry[2]
    if damage == "flip_weights" or damage == "flip_onnx":
        p = vdir / (WEIGHTS if damage == "flip_weights" else ONNX)
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        p.write_bytes(bytes(raw))
        match = f"{p.name}.*sha256"
    elif damage == "truncate_manifest":
        p = vdir / "manifest.json"
        p.write_text(p.read_text()[:40])
        match = "manifest.json.*not valid JSON"
    elif damage == "missing_weights":
        (vdir / WEIGHTS).unlink()
        match = f"{WEIGHTS}: missing"
    elif damage == "cluster_factors_disagree":  # intact file, factors for one cluster too many
        from safetensors.numpy import load_file, save_file

        from personalization.artifact import sha256_file

        p = vdir / WEIGHTS
        w = load_file(str(p))
        n = int(w["query_cluster"].max()) + 1
        w["cluster_kappa"] = np.ones(n + 1, np.float32)
        save_file(w, str(p))
        mp = vdir / "manifest.json"
        m = json.loads(mp.read_text())
        m["files"][WEIGHTS] = sha256_file(p)
        mp.write_text(json.dumps(m))
        match = f"{WEIGHTS}: cluster_kappa has shape"
    else:
        p = vdir / "manifest.json"
        m = json.loads(p.read_text())
        m["format"] = "something-else/9"
        p.write_text(json.dumps(m))
        match = "field 'format'"
    with pytest.raises(PolicyFileError, match=match):
        GruPolicy.load(vdir)
    with pytest.raises(PolicyFileError):  # through the registry root too
        GruPolicy.load(registry[0])


def test_hot_reload_switches_version_and_refuses_a_corrupt_one(registry, trained):
    root, v1, _ = registry
    weights, report = trained
    pol = GruPolicy.load(root, reload_every_s=0.0)
    assert pol.version == v1 and not pol.maybe_reload()
    w2 = dict(weights, **{"mlp.b2": weights["mlp.b2"] + 1.0})
    v2, _ = publish(root, w2, CFG, {"engine_version": "synthetic", "train": report})
    assert pol.maybe_reload() and pol.version == v2
    assert np.allclose(pol.weights["mlp.b2"], w2["mlp.b2"])
    _v3, p3 = publish(root, weights, CFG, {"engine_version": "synthetic", "train": report})
    (p3 / WEIGHTS).write_bytes(b"garbage")
    assert not pol.maybe_reload()  # refused: keeps serving v2
    assert pol.version == v2


def test_serving_never_imports_torch(registry, world):
    v = world[0]
    z = v.Z[v.page[:3]].astype(float).tolist()
    ids = v.IDS[v.page[:3]].tolist()
    sc = v.SC[v.page[:3]].tolist()
    code = textwrap.dedent(f"""
        import sys
        from personalization.policy import GruPolicy
        from personalization.state import UserState
        z, ids, sc = {z!r}, {ids!r}, {sc!r}
        st = [UserState(f"e{{i}}", 1.7e9 + i, 1, 2, z[i], ids[i], sc[i]) for i in range(3)]
        for backend in ("compiled", "onnx", "numpy"):
            p = GruPolicy.load({str(registry[0])!r}, backend=backend)
            q, s = p.choose(st[:2], st[2])
            assert q in ids[0] + ids[1] + ids[2], q
        assert "torch" not in sys.modules, "serving imported torch"
        print("ok")
    """)
    res = _fresh_python(code, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def _fresh_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    """`code` run by a new interpreter in the repository (nothing imported or compiled yet)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_time_split_holds_out_later_sessions(world):
    v = world[0]
    tr, te, t = split_rows(v, 0.25)
    assert len(tr) and len(te) and len(tr) + len(te) == v.n
    first = np.r_[True, v.session[1:] != v.session[:-1]]
    start = v.ts[first][v.session]
    assert start[tr].max() < t <= start[te].min()


def test_serving_explores_over_exactly_the_ranked_candidates(registry, world):
    """The served policy logs every candidate it ranked, with propensities that sum to 1 and
    match how often each query is really shown; epsilon 0 is the greedy choice."""
    v = world[0]
    pol = GruPolicy.load(registry[2])
    win = window_states(v, 45, 4)
    ids, probs = pol.rank_batch([win[:-1]], [win[-1]])[0]
    n = 4000
    sv = pol.serve_batch(
        [win[:-1]] * n, [win[-1]] * n, epsilon=0.3, temperature=1.0, rng=np.random.default_rng(0)
    )
    m = sv.cand_ids[0] >= 0
    assert sv.cand_ids[0][m].tolist() == ids.tolist()  # same candidates, best first
    np.testing.assert_allclose(sv.cand_scores[0][m], probs, atol=1e-5)
    assert np.isclose(sv.cand_prop[0].sum(), 1.0, atol=1e-5) and (sv.cand_prop[0][m] > 0).all()
    freq = (sv.query[:, None] == ids[None, :]).mean(0)
    np.testing.assert_allclose(freq, sv.cand_prop[0][m], atol=0.03)
    col = np.argmax(sv.cand_ids == sv.query[:, None], 1)
    np.testing.assert_allclose(sv.propensity, sv.cand_prop[np.arange(n), col], atol=1e-6)
    assert 0.6 < sv.greedy.mean() < 0.85
    g = pol.serve_batch([win[:-1]], [win[-1]], epsilon=0.0)
    assert g.query[0] == ids[0] and g.propensity[0] == pytest.approx(1.0) and g.greedy[0]
    rec = g.fields(0)
    assert rec["candidate_ids"] == ids.tolist() and rec["explored"] is False
    assert len(rec["candidate_scores"]) == len(rec["candidate_propensities"]) == len(ids)


def test_serving_cold_start_and_empty_pages_with_exploration(registry, world):
    pol = GruPolicy.load(registry[0])
    cur = state(0, world[0].Z[3], [7, 2, 9], [0.2, 0.9, 0.5])
    empty = state(1, world[0].Z[3], [], [])
    sv = pol.serve_batch([[], []], [cur, empty], epsilon=0.0)
    assert sv.query.tolist() == [2, NO_QUERY] and sv.propensity[0] == pytest.approx(1.0)
    assert sorted(sv.cand_ids[0][sv.cand_ids[0] >= 0].tolist()) == [2, 7, 9]
    sv = pol.serve_batch([[]] * 2000, [cur] * 2000, epsilon=0.5, rng=np.random.default_rng(1))
    assert set(sv.query.tolist()) == {2, 7, 9} and np.isclose(sv.cand_prop[0].sum(), 1.0)


def test_loading_compiles_every_serving_kernel_before_the_first_event(registry):
    """A consumer's first event must not wait for numba (seconds on a fresh install, past its
    max.poll.interval): load() has compiled or cache-loaded every kernel serving calls."""
    code = textwrap.dedent(f"""
        from personalization import explain, feature_kernels, logit_kernel, serve_kernels
        from personalization.policy import GruPolicy
        kernels = (logit_kernel.logits, serve_kernels.serve_rows, feature_kernels.features,
                   explain.page_top, explain.sources)
        assert not any(k.signatures for k in kernels)
        p = GruPolicy.load({str(registry[0])!r})
        assert all(k.signatures for k in kernels), [k for k in kernels if not k.signatures]
        assert p.fallbacks == 0
        print("ok")
    """)
    res = _fresh_python(code, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_an_empty_batch_serves_nothing(registry):
    s = GruPolicy.load(registry[0]).serve_batch([], [])
    assert s.query.shape == (0,) and s.cand_ids.shape[0] == 0 and s.source_event == []


def test_garbage_states_never_stop_serving(registry, world):
    """The compiled kernels run without bounds checks: whatever a stored state holds (ids out
    of range or negative, NaN / inf features, scores and times, lengths that disagree, shown
    ids from nowhere, objects that are not states), a batch is served with a query from its
    events' own pages or none, and valid probabilities."""
    v = world[0]
    pol = GruPolicy.load(registry[0])
    rng = np.random.default_rng(7)
    D, L = pol.feature_dim, pol.n_labels
    weird = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0, 1.0])

    def junk(i):
        kind = rng.integers(8)
        k = int(rng.integers(0, 12))
        ids = rng.integers(-(10**9), 10**9, k) if kind == 0 else rng.integers(-2, L + 3, k)
        z = v.Z[rng.integers(len(v.Z))].astype(float)
        if kind == 1:
            z = rng.choice(weird, D)
        if kind == 2:
            z = np.zeros(int(rng.integers(0, 2 * D)))
        sc = rng.choice(weird, k) if kind == 3 else rng.random(k)
        ts = float(rng.choice(weird)) if kind == 4 else 1.7e9 + 30 * i
        if kind == 5:
            return object()
        s = state(i, z, ids, sc, ts)
        if kind == 6:
            s.shown = int(rng.integers(-(10**9), 10**9))
        if kind == 7:
            s.ts = "not a time"
        return s

    for _ in range(150):
        n = int(rng.integers(1, 6))
        hists = [[junk(j) for j in range(int(rng.integers(0, 12)))] for _ in range(n)]
        curs = [junk(99) for _ in range(n)]
        served = pol.serve_batch(hists, curs, rng=rng)
        for b, cur in enumerate(curs):
            q = int(served.query[b])
            pages = [s for s in [*hists[b], cur] if hasattr(s, "query_ids")]
            assert q == NO_QUERY or any(q in s.query_ids for s in pages), q
            assert 0 <= q < L or q == NO_QUERY
            assert 0.0 <= served.propensity[b] <= 1.0 and np.isfinite(served.propensity[b])
