"""Headless Chromium on the test ComfyUI: the `page` fixture and the smallest DevTools-protocol client.

Chromium is the system's (`chromium`, or $CHROMIUM), driven with websocket-client over loopback; nothing is
downloaded. Without either the browser tests skip, with the reason.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from procs import stop

websocket = pytest.importorskip("websocket", reason="the browser test drives Chromium with websocket-client")

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--mute-audio", "--window-size=1600,1000",
                  "--no-proxy-server", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]
PAGE_TIMEOUT_S = 120


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium), and CHROMIUM is unset")
    return path


class Page:
    """The smallest DevTools-protocol client: evaluate JavaScript, take a screenshot, keep the events."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self._id = 0
        self.events: list = []

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]
            if "method" in msg:
                self.events.append(msg)

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"page error: {json.dumps(result['exceptionDetails'])[:2000]}")
        return result["result"].get("value")

    def until(self, expression: str, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    def jpeg(self, path: Path, clip: dict, width: int, quality: int = 80) -> Path:
        """The page region `clip` (CSS pixels) as a JPEG `width` pixels wide."""
        clip = {**clip, "scale": width / clip["width"]}
        data = self.call("Page.captureScreenshot", format="jpeg", quality=quality, clip=clip)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        print(f"screenshot: {path}")
        return path


@pytest.fixture
def page(comfy, tmp_path):
    exe = _chromium()
    cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", comfy.url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise AssertionError(f"chromium exited with {proc.returncode}")
            if "DevTools listening on ws://" in line:
                port = int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        assert port, "chromium did not report its DevTools port"
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
        with no_proxy.open(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = [t for t in json.load(r) if t.get("type") == "page"]
        yield Page(targets[0]["webSocketDebuggerUrl"])
    finally:
        stop(proc, 15)


READY_JS = """(() => {
  const app = window.comfyAPI?.app?.app;
  const LG = window.LiteGraph ?? window.comfyAPI?.litegraph?.LiteGraph;
  return !!(app?.graph && app.extensions?.some((e) => e.name === "kv_offload.memory")
    && LG?.registered_node_types?.KVMemoryMonitor && LG.registered_node_types.KVOffloadSettings);
})()"""


def shots_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("KV_OFFLOAD_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def close_dialogs(page) -> None:
    """Escape closes the templates browser of a fresh profile and error dialogs, so screenshots show the canvas."""
    for kind in ("keyDown", "keyUp"):
        page.call("Input.dispatchKeyEvent", type=kind, key="Escape", code="Escape", windowsVirtualKeyCode=27)

