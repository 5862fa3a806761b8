"""Every dashboard page in a real browser: `astec dashboard` (the real CLI) over a directory laid
out as `astec demo` writes it (models/engine, models/gru, live-logs), real Redis with a user's
states and two consumers' metric series, driven in Debian's headless Chromium.

What a person looks for is asserted on the rendered page (a typed title's known words and the
index that proposed each query, the no-evidence state, a visit's title and the GRU named, the
charts drawn), and each page's screenshot is kept as test output: the directory is printed
(`screenshots: ...`) and is the test's tmp_path (pytest keeps the last three runs), or
$ASTEC_SCREENSHOT_DIR when set.

Chromium is driven over the DevTools protocol (websocket) with wall-clock waits: Streamlit
renders over its own websocket, which `--dump-dom --virtual-time-budget` does not wait for (it
returns the empty HTML shell). Needs Debian's `chromium` (`make install` installs it).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from testkit.dashboard_data import (
    BENCH,
    make_registry,
    publish_series,
    store_visits,
    write_click_log,
)
from testkit.paths import REPO

REPO_PATH = Path(REPO)
CHROMIUM = "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else shutil.which("chromium")
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--mute-audio",
]
WIDTH, HEIGHT = 1400, 2000
TITLE = "Debian -- Details of package openssh-server in bookworm"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (make install)"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, what: str, log=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(
        f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{log()}" if log else "")
    )


class Chrome:
    """Headless Chromium with one page and a fresh profile, driven through DevTools."""

    def __init__(self, profile: str):
        from websockets.sync.client import connect

        self.proc = subprocess.Popen(
            [
                CHROMIUM,
                *CHROME_FLAGS,
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                f"--window-size={WIDTH},{HEIGHT}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        port_file = Path(profile) / "DevToolsActivePort"
        wait_until(
            lambda: port_file.is_file() and port_file.read_text().strip(),
            30,
            "Chromium's DevTools port",
        )
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self._conn = connect(ws_url, max_size=None, open_timeout=10)
        self.ws = self._conn.__enter__()
        self.n = 0
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=WIDTH,
            height=HEIGHT,
            deviceScaleFactor=1,
            mobile=False,
        )

    def call(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, js: str):
        return self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"].get(
            "value"
        )

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def type_into(self, label: str, text: str) -> None:
        """Replace the value of the text input labelled `label` and press Enter."""
        js = f"""(() => {{
            const w = [...document.querySelectorAll('[data-testid=stTextInput]')].find(
                e => (e.querySelector('label') || {{innerText: ''}}).innerText.trim()
                     === {json.dumps(label)});
            const i = w && w.querySelector('input');
            if (!i) return false; i.focus(); i.select(); return true; }})()"""
        wait_until(lambda: self.eval(js), 30, f"a text input labelled {label!r}", self.text)
        self.call("Input.insertText", text=text)
        for kind in ("keyDown", "keyUp"):
            self.call(
                "Input.dispatchKeyEvent",
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
                nativeVirtualKeyCode=13,
            )

    def goto_page(self, name: str) -> None:
        """Click the sidebar's page radio labelled `name`."""
        ok = self.eval(f"""(() => {{
            const l = [...document.querySelectorAll('section[data-testid=stSidebar] label')]
                .find(e => e.innerText.trim() === {json.dumps(name)});
            if (!l) return false; l.click(); return true; }})()""")
        assert ok, f"no sidebar page {name!r}"

    def click_toggle(self, label: str) -> None:
        """A real mouse click on the toggle whose label starts with `label` (React ignores a
        scripted click on it)."""
        js = f"""(() => {{
            const w = [...document.querySelectorAll('[data-testid=stCheckbox]')].find(
                e => e.innerText.trim().startsWith({json.dumps(label)}));
            if (!w) return null; const r = w.getBoundingClientRect();
            return [r.left + 12, r.top + r.height / 2]; }})()"""
        x, y = wait_until(lambda: self.eval(js), 30, f"a toggle labelled {label!r}", self.text)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def charts(self) -> int:
        """Charts drawn: vega-embed canvases/SVGs with a non-zero size."""
        return (
            self.eval("""[...document.querySelectorAll('.vega-embed canvas, .vega-embed svg')]
            .filter(e => e.getBoundingClientRect().width > 50 &&
                         e.getBoundingClientRect().height > 50).length""")
            or 0
        )

    def settled(self) -> bool:
        """Streamlit is not running a script (its status widget is gone)."""
        return not self.eval("!!document.querySelector('[data-testid=stStatusWidget]')")

    def screenshot(self, path: Path) -> bytes:
        time.sleep(0.5)  # let tables' canvases and charts paint
        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(png)
        return png

    def close(self):
        try:
            self._conn.__exit__(None, None, None)
        finally:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


def not_blank(png: bytes, where: Path) -> None:
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("L")
    assert img.size == (WIDTH, HEIGHT), (where, img.size)
    hist = img.histogram()
    dark = sum(hist[:128]) / (img.size[0] * img.size[1])
    assert 0.002 < dark < 0.5, f"{where}: {dark:.4f} of the pixels are dark (blank page?)"
    assert len([h for h in hist if h]) > 20, f"{where}: almost no distinct grey levels"


@pytest.fixture(scope="module")
def gru_root(astec_predictor, tmp_path_factory):
    """A GRU policy registry trained (1 epoch) on simulator logs over the stream corpus, as
    `astec personalize train` publishes it."""
    from engine.predictor import Predictor
    from personalization.train import TrainConfig, publish, train_policy
    from personalization.visits import load_visits
    from simulator.traffic import LogSettings, simulate_logs
    from simulator.world import world_from_dataset
    from testkit.paths import STREAM_DATA

    d = tmp_path_factory.mktemp("gru-dash")
    world = world_from_dataset(STREAM_DATA, n_users=40, seed=5)
    simulate_logs(world, d / "logs", LogSettings(days=1, seed=5))
    pred = Predictor.load(astec_predictor)
    cfg = TrainConfig(epochs=1, threads=1)
    w, report = train_policy(
        load_visits(d / "logs", pred, k=10),
        pred.classifier_rows(np.arange(pred.num_labels)),
        cfg,
        progress=False,
    )
    root = d / "gru"
    publish(root, w, cfg, {"train": report, "engine_version": pred.version})
    return root


@pytest.fixture
def demo_dashboard(astec_predictor, gru_root, evaluation_json, services, stream_corpus, tmp_path):
    """`astec dashboard --models DEMO/models/engine --bench peers.json` on a free port, over a
    directory laid out like the demo's, with Redis holding alice's visits and two consumers'
    metric series. Yields (url, info)."""
    import uuid

    from engine.predictor import Predictor

    demo = tmp_path / "demo"
    engine = demo / "models" / "engine"
    v1, v2 = make_registry(engine, astec_predictor)
    (engine / "versions" / v2 / "eval_test.json").write_text(evaluation_json.read_text())
    shutil.copytree(gru_root, demo / "models" / "gru", symlinks=True)
    titles = stream_corpus[0][100:106]
    s = services.replace(redis_key_prefix=f"astec-dash-{uuid.uuid4().hex[:8]}")
    pred = Predictor.load(astec_predictor)
    store_visits(s, pred, titles, "alice", k=16)
    write_click_log(demo / "live-logs", "alice", titles, 1.7e9, clicked=(3,))
    now = time.time()
    ms = {}
    ms["worker-0"] = publish_series(
        s,
        "worker-0",
        [(40 + (i % 5), int(i % 9 == 0), [15.0 + i % 4] * 40) for i in range(60)],
        now - 120,
        version=v2,
    )
    ms["worker-1"] = publish_series(
        s,
        "worker-1",
        [(35, 0, [18.0 + (i % 10 == 0) * 60] * 35) for i in range(60)],
        now - 120,
        version=v2,
    )
    (tmp_path / "peers.json").write_text(json.dumps(BENCH))
    port = free_port()
    log = tmp_path / "dashboard.log"
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "ASTEC_CONFIG",
            "ASTEC_DASHBOARD_POLICY",
            "ASTEC_DASHBOARD_LOGS",
            "ASTEC_DASHBOARD_BENCH",
        )
    }
    env.update(
        ASTEC_SERVICES_DIR=str(tmp_path / "no-services"), ASTEC_REDIS_KEY_PREFIX=s.redis.key_prefix
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infra.cli",
                "dashboard",
                "--models",
                str(engine),
                "--port",
                str(port),
                "--redis-url",
                s.redis.url.reveal(),
                "--bench",
                str(tmp_path / "peers.json"),
            ],
            cwd=REPO_PATH,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/"

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"astec dashboard exited {proc.returncode}:\n{log.read_text()}")
        try:
            return urllib.request.urlopen(url + "_stcore/health", timeout=2).read() == b"ok"
        except OSError:
            return False

    try:
        wait_until(healthy, 60, "the dashboard's health endpoint", log.read_text)

        def live():
            """One publish by each consumer now, as running workers do every second."""
            for cid in ("worker-0", "worker-1"):
                publish_series(s, cid, [(5, 0, [20.0] * 5)], time.time(), m=ms[cid])

        yield (
            url,
            {
                "v1": v1,
                "v2": v2,
                "titles": titles,
                "log": log.read_text(),
                "demo": demo,
                "live": live,
            },
        )
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_every_page_in_chromium(demo_dashboard, tmp_path, capsys):
    url, info = demo_dashboard
    shots = Path(os.environ.get("ASTEC_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with capsys.disabled():
        print(f"\nscreenshots: {shots}")
    # the CLI found the demo's GRU policy and click log beside the models
    demo = info["demo"]
    assert f"GRU policy: {demo / 'models/gru'}" in info["log"], info["log"]
    assert f"click logs: {demo / 'live-logs'}" in info["log"], info["log"]
    # and says which predictor --models resolved to (engine.model_paths, as every command)
    assert f"predictor: the registry's promoted version {info['v2']}" in info["log"], info["log"]
    chrome = Chrome(tempfile.mkdtemp(prefix="chrome-", dir=tmp_path))
    try:
        drive_every_page(chrome, url, info, shots)
    except BaseException:
        chrome.screenshot(shots / "failure.png")  # what the page showed when it failed
        raise
    finally:
        chrome.close()


def drive_every_page(chrome: Chrome, url: str, info: dict, shots: Path) -> None:
    chrome.call("Page.navigate", url=url)
    # ---- Predict: known words, who proposed each query --------------------------------
    wait_until(lambda: "Type a page title" in chrome.text(), 60, "the Predict page", chrome.text)
    assert chrome.eval("document.title") == "Astec ads dashboard"
    body = chrome.text()
    for expected in (
        "Predict: page title → queries",
        info["v2"],
        "1880 labels",
        "models/gru",
        "found next to the models",
        "live-logs",
    ):
        assert expected in body, expected
    chrome.type_into("Page title", TITLE)
    wait_until(
        lambda: "Latency (median of 5, warm)" in chrome.text() and chrome.settled(),
        60,
        "the prediction",
        chrome.text,
    )
    body = chrome.text()
    assert "Known words: 6 of 8" in body and "openssh" in body
    # the table is a canvas grid: its cells are not in innerText, so check its header row
    png = chrome.screenshot(shots / "1-predict.png")
    not_blank(png, shots / "1-predict.png")
    # ---- Predict: a title with no known word ------------------------------------------
    chrome.type_into("Page title", "zzqxv blorfx")
    wait_until(
        lambda: "No evidence." in chrome.text() and chrome.settled(),
        60,
        "the no-evidence state",
        chrome.text,
    )
    body = chrome.text()
    assert "Known words: 0 of 2" in body and "NOT evidence" in body
    assert "Latency (median of 5, warm)" not in body
    chrome.screenshot(shots / "2-predict-no-evidence.png")
    # ---- Predict: two versions side by side -------------------------------------------
    chrome.type_into("Page title", TITLE)
    wait_until(
        lambda: "Latency (median of 5, warm)" in chrome.text() and chrome.settled(),
        60,
        "the prediction again",
        chrome.text,
    )
    chrome.click_toggle("Compare two model versions")
    # the selectboxes are lazily loaded components: they may mount after the text is there
    wait_until(
        lambda: (
            "A vs B:" in chrome.text()
            and chrome.settled()
            and chrome.eval("document.querySelectorAll('[data-testid=stSelectbox]').length") == 2
        ),
        60,
        "the side-by-side comparison with its two version selectboxes",
        chrome.text,
    )
    body = chrome.text()
    assert info["v1"] in body and info["v2"] in body
    assert body.count("Known words: 6 of 8") == 2
    chrome.screenshot(shots / "2b-predict-compare.png")
    # ---- Users: titles, the GRU named, clicks ----------------------------------------
    chrome.goto_page("Users")
    wait_until(lambda: "Enter a user id" in chrome.text(), 60, "the Users page", chrome.text)
    assert "alice" in chrome.text()
    chrome.type_into("User id", "alice")
    wait_until(
        lambda: (
            "Scores behind each choice" in chrome.text()
            and "CTR" in chrome.text()
            and chrome.settled()
        ),
        60,
        "alice's visits and clicks",
        chrome.text,
    )
    body = chrome.text()
    assert "the GRU policy" in body
    # the newest visit's title heads its expander; the clicked visit's title is listed
    assert info["titles"][-1][:60] in body
    assert info["titles"][3][:60] in body and "CTR" in body
    wait_until(lambda: chrome.charts() >= 1, 30, "the GRU probability chart")
    png = chrome.screenshot(shots / "3-users.png")
    not_blank(png, shots / "3-users.png")
    # ---- Offline metrics: peers, P@k vs k, frequency bins ----------------------------
    chrome.goto_page("Offline metrics")
    wait_until(
        lambda: (
            "Astec against its peers" in chrome.text() and chrome.charts() >= 4 and chrome.settled()
        ),
        60,
        "the offline charts",
        chrome.text,
    )
    body = chrome.text()
    for expected in (
        "P@k against k",
        "Each label-frequency bin's share of P@5",
        "Hidden to fit the page",
        "GRU policy versions",
    ):
        assert expected in body, expected
    png = chrome.screenshot(shots / "4-offline.png")
    not_blank(png, shots / "4-offline.png")
    # ---- Stream health: rates, latency, dead letters over time -----------------------
    info["live"]()
    chrome.goto_page("Stream health")
    wait_until(
        lambda: "Event → ad latency" in chrome.text() and chrome.charts() >= 4 and chrome.settled(),
        60,
        "the stream health charts",
        chrome.text,
    )
    body = chrome.text()
    assert "Consumers (live/stale)" in body and "2/0" in body
    assert "worker-0" in body and "Dead letters" in body
    png = chrome.screenshot(shots / "5-stream-health.png")
    not_blank(png, shots / "5-stream-health.png")
