"""The readout in a real page: headless Chromium (the system's `chromium`) on a real ComfyUI with the pack.

The page gets a KV Memory Monitor and a KV Offload Settings node; a tiny FLUX.2 graph runs; the widget's text
must change during the run, and at the end match the text the formatting module makes from
`GET /kv_offload/stats`. A screenshot is saved (to $KV_OFFLOAD_SCREENSHOT_DIR if set, else the test's tmp dir).
Chromium is driven over the DevTools protocol with websocket-client; nothing is downloaded.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=...] [CHROMIUM=/usr/bin/chromium] pytest -m browser tests/comfyui
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

from test_integration import graph  # the integration suite's tiny FLUX.2 graph
from procs import stop

websocket = pytest.importorskip("websocket", reason="the browser test drives Chromium with websocket-client")

pytestmark = [pytest.mark.browser, pytest.mark.comfyui]

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--mute-audio", "--window-size=1600,1000",
                  "--no-proxy-server", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]
PAGE_TIMEOUT_S = 120
RUN_TIMEOUT_S = 300
CHANGES_DURING_RUN = 3


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium), and CHROMIUM is unset")
    return path


class Page:
    """The smallest DevTools-protocol client: evaluate JavaScript, take a screenshot."""

    def __init__(self, ws_url: str):
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self._id = 0

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]

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

SETUP_JS = """(async () => {
  const app = window.comfyAPI.app.app;
  const LG = window.LiteGraph ?? window.comfyAPI.litegraph?.LiteGraph;
  app.graph.clear();
  const monitor = LG.createNode("KVMemoryMonitor");
  monitor.pos = [0, 0];
  app.graph.add(monitor);
  monitor.setSize([520, Math.max(monitor.size[1], 560)]);
  const settings = LG.createNode("KVOffloadSettings");
  settings.pos = [560, 0];
  app.graph.add(settings);
  settings.setSize([480, Math.max(settings.size[1], 260)]);
  app.canvas.ds.offset = [400, 110];  // right of the sidebar, below the top bar
  app.canvas.ds.scale = 1;
  app.graph.setDirtyCanvas(true, true);
  const rowsText = (root) => [...root.querySelectorAll(".kvo-row")].map((r) => r.textContent).join("\\n");
  const root = monitor.widgets.find((w) => w.name === "kv_memory").element;
  const compact = settings.widgets.find((w) => w.name === "kv_memory_compact").element;
  window.__kvo = { monitor, root, compact, rowsText, seen: [] };
  new MutationObserver(() => {
    window.__kvo.seen.push({ event: root.dataset.event, text: rowsText(root) });
  }).observe(root, { childList: true, subtree: true, characterData: true });
  return true;
})()"""

RUNNING_CHANGES_JS = """new Set(window.__kvo.seen.filter((s) => s.event === "start" || s.event === "step")
  .map((s) => s.text)).size"""

COMPARE_JS = """(async () => {
  const url = (await (await fetch("/extensions")).json()).find((p) => p.endsWith("/kv_offload_format.js"));
  const fmt = await import(url);
  const snap = await (await fetch("/api/kv_offload/stats", { cache: "no-store" })).json();
  const k = window.__kvo;
  return {
    snap,
    expected: fmt.readoutText(fmt.buildReadout(snap)),
    expectedCompact: fmt.buildCompact(snap).join("\\n"),
    actual: k.rowsText(k.root),
    full: k.root.textContent,
    compact: k.rowsText(k.compact),
    widgetTime: k.root.dataset.time,
    visible: k.root.isConnected && k.root.getBoundingClientRect().height > 0,
  };
})()"""


STILL_THERE_JS = """(() => {
  const app = window.comfyAPI.app.app;
  return app.graph.nodes.includes(window.__kvo.monitor) && window.__kvo.root.isConnected;
})()"""


def _place_nodes(page, settle_s: float = 3.0) -> None:
    """Add our two nodes once the page has stopped replacing its graph (it restores a workflow after start-up)."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while time.monotonic() < deadline:
        assert page.eval(SETUP_JS) is True
        time.sleep(settle_s)
        if page.eval(STILL_THERE_JS):
            return
    raise AssertionError("the page kept replacing its graph; the monitor node did not stay")


def _screenshot_path(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("KV_OFFLOAD_SCREENSHOT_DIR") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "kv_memory_monitor.png"


WIDGET_TYPES = {"INT", "FLOAT", "BOOLEAN", "STRING", "COMBO"}

SERIALIZE_JS = """(async () => {
  const app = window.comfyAPI.app.app;
  const workflow = app.graph.serialize();
  const prompt = await app.graphToPrompt();
  return { values: Object.fromEntries(workflow.nodes.map((n) => [n.type, n.widgets_values ?? []])),
           inputs: Object.fromEntries(Object.values(prompt.output).map((n) => [n.class_type, Object.keys(n.inputs)])) };
})()"""


def _check_widgets_stay_out_of_workflow_and_prompt(comfy, page) -> None:
    """The readouts are displays: they add no value to a saved workflow and no input to a queued prompt."""
    _, info = comfy.request("GET", "/object_info/KVOffloadSettings")
    spec = info["KVOffloadSettings"]["input"]
    declared = {**spec.get("required", {}), **spec.get("optional", {})}
    widget_inputs = [name for name, (kind, *_) in declared.items() if isinstance(kind, list) or kind in WIDGET_TYPES]
    got = page.eval(SERIALIZE_JS)
    assert len(got["values"]["KVOffloadSettings"]) == len(widget_inputs)
    assert got["values"]["KVMemoryMonitor"] == []
    assert sorted(got["inputs"]["KVOffloadSettings"]) == sorted(widget_inputs)  # the MODEL link is unconnected
    assert got["inputs"].get("KVMemoryMonitor", []) == []


def _close_dialogs(page) -> None:
    """A fresh profile opens the templates browser; Escape closes it so the screenshot shows the canvas."""
    for kind in ("keyDown", "keyUp"):
        page.call("Input.dispatchKeyEvent", type=kind, key="Escape", code="Escape", windowsVirtualKeyCode=27)


def _compare(page) -> dict:
    result = page.eval(COMPARE_JS)
    assert result["actual"] == result["expected"], "the widget does not show the route's snapshot"
    assert result["compact"] == result["expectedCompact"], "the Settings node does not show the route's snapshot"
    assert float(result["widgetTime"]) == result["snap"]["time"]
    return result


def test_readout_changes_during_a_run_and_ends_on_the_route_snapshot(comfy, page, tmp_path):
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    _place_nodes(page)
    _check_widgets_stay_out_of_workflow_and_prompt(comfy, page)
    # 1. A long run, stopped once the widget has changed a few times: the check does not depend on CPU speed,
    #    and it covers the final snapshot of an interrupted run.
    code, body = comfy.submit(graph(mode="ram_sync", steps=5000, size=4, seed=int(time.time())))
    assert code == 200, body
    try:
        page.until(f"{RUNNING_CHANGES_JS} >= {CHANGES_DURING_RUN}", RUN_TIMEOUT_S, "the readout to change during the run")
    finally:
        comfy.request("POST", "/interrupt")
    page.until("window.__kvo.root.dataset.event === 'final'", RUN_TIMEOUT_S, "the final snapshot in the widget")
    running = page.eval("window.__kvo.seen.filter((s) => s.event === 'step').map((s) => s.text)")
    assert running and all(text.startswith("run: running") for text in running)
    interrupted = _compare(page)["snap"]
    # 2. A short run to its end: the widget ends on that run's final snapshot, the one the route serves.
    comfy.run(graph(mode="ram_sync", steps=4, size=4, seed=int(time.time()) + 1))
    page.until(f"window.__kvo.root.dataset.event === 'final' && window.__kvo.root.dataset.time !== "
               f"'{interrupted['time']}'", RUN_TIMEOUT_S, "the second run's final snapshot")
    result = _compare(page)
    snap = result["snap"]
    assert snap["event"] == "final" and snap["run"]["active"] is False and snap["run"]["id"] != interrupted["run"]["id"]
    # independent of the formatter: the run's store and the scopes are on screen
    [store] = snap["stores"]
    assert store["tier"] == "ram_sync" and store["name"] in result["full"]
    assert f"last run finished \u00b7 {snap['run']['forwards']} forwards" in result["actual"]
    assert "last run finished" in result["compact"]
    assert "RSS [this process]" in result["actual"] and "RAM available [whole system]" in result["actual"]
    assert result["visible"], "the readout widget is not on screen"
    # the sidebar tab shows the same readout
    page.eval("window.comfyAPI.app.app.extensionManager.sidebarTab.toggleSidebarTab('kv_offload.memory'), true")
    sidebar = page.until("(() => { const el = document.querySelector('[data-kv-offload=sidebar]');"
                         " return el && window.__kvo.rowsText(el); })()", 30, "the sidebar readout")
    assert sidebar == result["expected"]
    _close_dialogs(page)
    time.sleep(0.5)
    shot = page.call("Page.captureScreenshot", format="png")
    path = _screenshot_path(tmp_path)
    path.write_bytes(base64.b64decode(shot["data"]))
    print(f"screenshot: {path}")
    assert path.stat().st_size > 10_000
