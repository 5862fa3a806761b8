"""Smoke test in a real browser: `astec dashboard` on a free loopback port, loaded in headless
Chromium, renders its title and the Predict page, and answers a typed title.

Chromium is driven over the DevTools protocol (websocket) with wall-clock waits: Streamlit
renders over its own websocket, which `--dump-dom --virtual-time-budget` does not wait for (it
returns the empty HTML shell). Needs Debian's `chromium` (`make system-deps` installs it).
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

import pytest

from test_dashboard_data import make_registry

REPO = Path(__file__).resolve().parent.parent
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None,
                                reason="Debian's chromium is not installed (make system-deps)")


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
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                         + (f"\n{log()}" if log else ""))


class Chrome:
    """Headless Chromium with one page, driven through the DevTools protocol."""

    def __init__(self, profile: str):
        from websockets.sync.client import connect
        self.proc = subprocess.Popen(
            ["chromium", *CHROME_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(profile) / "DevToolsActivePort"
        wait_until(lambda: port_file.is_file() and port_file.read_text().strip(), 30,
                   "Chromium's DevTools port")
        port = int(port_file.read_text().split()[0])
        pages = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        ws_url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
        self.ws = connect(ws_url, max_size=None, open_timeout=10)
        self.n = 0

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
        return self.call("Runtime.evaluate", expression=js, returnByValue=True)["result"].get("value")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def close(self):
        try:
            self.ws.close()
        finally:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(10)


@pytest.fixture
def dashboard_url(astec_predictor, tmp_path):
    """`astec dashboard` (the real CLI) on a free loopback port over a two-version registry."""
    v1, v2 = make_registry(tmp_path / "models", astec_predictor)
    port = free_port()
    log = tmp_path / "dashboard.log"
    env = {k: v for k, v in os.environ.items() if k not in ("ASTEC_CONFIG", "ASTEC_DASHBOARD_POLICY")}
    env["ASTEC_SERVICES_DIR"] = str(tmp_path / "no-services")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "infra.cli", "dashboard", "--models", str(tmp_path / "models"),
             "--port", str(port), "--redis-url", "redis://127.0.0.1:1/0"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
        yield url, v2
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def test_dashboard_renders_in_chromium_and_predicts(dashboard_url, tmp_path):
    from PIL import Image
    url, version = dashboard_url
    chrome = Chrome(tempfile.mkdtemp(prefix="chrome-", dir=tmp_path))
    try:
        chrome.call("Page.navigate", url=url)
        wait_until(lambda: "Type a page title" in chrome.text() and
                   chrome.eval("document.querySelectorAll('input[type=text]').length") == 1,
                   60, "the Predict page", chrome.text)
        body = chrome.text()
        assert chrome.eval("document.title") == "Astec ads dashboard"
        for expected in ("Astec ads dashboard", "Predict: page title → queries", version,
                         "1880 labels", "Offline metrics", "Stream health"):
            assert expected in body
        chrome.eval("document.querySelector('input[type=text]').focus()")
        chrome.call("Input.insertText", text="Debian -- Details of package openssh-server")
        for kind in ("keyDown", "keyUp"):
            chrome.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                        windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)
        wait_until(lambda: "Latency (median of 5, warm)" in chrome.text(), 60,
                   "the prediction result", chrome.text)
        time.sleep(1.0)   # let the table's canvas paint before the screenshot
        png = base64.b64decode(chrome.call("Page.captureScreenshot", format="png")["data"])
    finally:
        chrome.close()
    shot = tmp_path / "dashboard.png"
    shot.write_bytes(png)
    img = Image.open(io.BytesIO(png)).convert("L")
    assert img.size[0] == 1280 and img.size[1] > 500
    hist = img.histogram()
    dark = sum(hist[:128]) / (img.size[0] * img.size[1])
    assert 0.002 < dark < 0.5, f"{shot}: {dark:.4f} of the pixels are dark (blank page?)"
    assert len([h for h in hist if h]) > 20, f"{shot}: almost no distinct grey levels"
