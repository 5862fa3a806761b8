"""An engine install without the stream extras (`pip install 'astec-ads[train]'`) trains,
evaluates, exports and predicts without the broker's, Redis' or Streamlit's clients; a command
that needs them says which extra to install. Simulated here by making those packages
unimportable in a child."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stream.settings import settings_env
from testkit.stream_load import read_all_messages
from testkit.stream_run import produce_paced

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = (
    "import sys\n"
    "for m in ('kafka', 'confluent_kafka', 'redis', 'prometheus_client', 'streamlit'):\n"
    "    sys.modules[m] = None  # import fails as if not installed\n"
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_engine_simulator_and_personalization_import_without_the_stream_extras():
    mods = []
    for pkg in ("engine", "simulator", "personalization"):
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                    mods.append(rel.removesuffix(".__init__"))
    res = run(f"import importlib\nfor m in {sorted(mods)!r}:\n    importlib.import_module(m)\n")
    assert res.returncode == 0, res.stderr[-2000:]


def test_a_stream_command_names_the_extra_it_needs():
    res = run("from infra.cli import main\nsys.argv = ['astec', 'stream', 'metrics']\nmain()\n")
    assert res.returncode == 1
    assert "pip install 'astec-ads[stream]'" in res.stderr and "Traceback" not in res.stderr
    ok = run("from infra.cli import main\nsys.argv = ['astec', 'train', '--help']\nmain()\n")
    assert ok.returncode == 0 and "--train" in ok.stdout


@pytest.mark.services
@pytest.mark.skipif(
    not os.environ.get("ASTEC_WORKER_VENV"),
    reason="needs ASTEC_WORKER_VENV: a venv of `pip install '.[stream]'` (.ci/run makes one)",
)
def test_worker_install_without_torch_answers_page_views(
    stream_settings, astec_predictor, stream_corpus, tmp_path
):
    """The `stream` extra alone (no torch) runs `astec stream run` on an exported predictor and
    a GRU policy exported here (with torch) to its ONNX graph: page views in, ad queries out,
    each chosen by the GRU over the user's stored window (not the page's top query), from the
    installed package (not this checkout)."""
    from engine.manifest import label_space_of
    from engine.predictor import Predictor
    from personalization.train import TrainConfig, publish
    from testkit.policy_data import policy_weights

    venv = Path(os.environ["ASTEC_WORKER_VENV"]).resolve()
    py = venv / "bin" / "python"
    no_torch = subprocess.run([py, "-c", "import torch"], capture_output=True, check=False)
    assert no_torch.returncode != 0, "the worker venv has torch"
    pred = Predictor.load(astec_predictor)
    cfg = TrainConfig(hidden=8, query_dim=4, mlp_hidden=8)
    _, gru = publish(
        tmp_path / "gru", policy_weights(pred), cfg, {"engine_label_space": label_space_of(pred)}
    )
    assert (gru / "model.onnx").is_file()
    s = stream_settings
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        **settings_env(s),
        "ASTEC_LOG_LEVEL": "30",
    }
    argv = ["stream", "run", "--model", astec_predictor, "--policy", "gru"]
    with (tmp_path / "worker.log").open("wb") as log:
        p = subprocess.Popen(
            [venv / "bin" / "astec", *argv, "--policy-model", str(tmp_path / "gru")],
            cwd=tmp_path,  # the installed package, not the checkout's sources
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            ids = produce_paced(s, stream_corpus[0], 200, 20, rate=100, tag="wv")
            want = set(ids)
            served = read_all_messages(
                s,
                s.topics.ad_queries,
                "ad_query",
                until=lambda ms: want <= {m["event_id"] for m in ms},
                timeout=120,
            )
        finally:
            p.send_signal(signal.SIGTERM)
            rc = p.wait(60)
    out = (tmp_path / "worker.log").read_text(errors="replace")[-2000:]
    assert want <= {a["event_id"] for a in served}, out
    assert rc == 0, out
    assert {a["policy"] for a in served} == {"gru"}
    # the GRU's exploring draw: no event got the page's top query with propensity 1 (the
    # fallback's), and later visits were ranked with the queries of the user's earlier pages
    assert max(a["propensity"] for a in served) < 1.0, "an ad came from the top-query fallback"
    assert max(len(a["candidates"]) for a in served) > s.prediction.top_k, (
        "no stored window was read"
    )
