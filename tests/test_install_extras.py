"""An engine-only install (`pip install astec-ads`, no extras) trains, evaluates, exports and
predicts without the broker's, Redis' or Streamlit's clients; a command that needs them says
which extra to install. Simulated here by making those packages unimportable in a child."""

import os
import subprocess
import sys

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
