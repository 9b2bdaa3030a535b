"""The readout in a real page: headless Chromium (the system's `chromium`) on a real ComfyUI with the pack.

The page loads the integration suite's tiny FLUX.2 graph (so its KV Offload Settings node is the one that
runs), a KV Memory Monitor and a second Settings node that does not run, all at their default sizes. Runs
are queued from the page. Checked: no readout row overflows its width, the compact readout is two lines,
the bars and the timeline change during a run, a store is shown while the capture step is still running,
the final snapshot's transfer count is the engine's (its log line), each Settings node shows its own run,
a bad mode gives one message, on `mode`, nothing is fetched while idle, and nothing of the readout enters
the workflow or the prompt. Screenshots at default size are saved to $KV_OFFLOAD_SCREENSHOT_DIR if set, else
to the test's tmp dir. Chromium is driven over the DevTools protocol with websocket-client; nothing is
downloaded.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=...] [CHROMIUM=/usr/bin/chromium] pytest -m browser tests/comfyui
"""

from __future__ import annotations

import json
import re
import time

import pytest

from chromium import PAGE_TIMEOUT_S, READY_JS, close_dialogs, page, shots_dir  # noqa: F401  (`page`: the fixture)
from graph_helpers import graph  # the tiny FLUX.2 graph of the integration suite

pytestmark = [pytest.mark.browser, pytest.mark.comfyui]

RUN_TIMEOUT_S = 300
IDLE_S = 5.0
# A large reference makes the capture step (the forward that sees the reference tokens) take seconds on a
# CPU, as it does on a real model, while the cached steps stay fast.
SLOW_CAPTURE_REF = 32

# Load the API graph (node ids kept: its Settings node is "kvo"), add a monitor and a second Settings node,
# all at their default sizes; record every state the readouts pass through.
SETUP_JS = """(async (apiGraph) => {
  const app = window.comfyAPI.app.app;
  const LG = window.LiteGraph ?? window.comfyAPI.litegraph?.LiteGraph;
  await app.loadApiJson(apiGraph, "kv_offload_browser_test");
  const kvo = app.graph.getNodeById("kvo");
  if (!kvo) return null;  // the page replaced the graph meanwhile: try again
  for (const n of app.graph.nodes) if (n !== kvo) n.pos = [1400 + 40 * n.id.length, 900];  // out of view
  const monitor = LG.createNode("KVMemoryMonitor");
  const other = LG.createNode("KVOffloadSettings");
  app.graph.add(monitor);
  app.graph.add(other);
  monitor.pos = [0, 0];
  kvo.pos = [monitor.size[0] + 40, 0];
  other.pos = [monitor.size[0] + 40, 300];  // below kvo once its readout has grown
  app.canvas.ds.offset = [400, 110];  // right of the sidebar, below the top bar
  app.canvas.ds.scale = 1;
  app.graph.setDirtyCanvas(true, true);
  const widget = (node, name) => node.widgets.find((w) => w.name === name).element;
  const rowsText = (root) => [...root.querySelectorAll(".kvo-row:not([data-row=timeline])")].map((r) => r.textContent).join("\\n");
  const k = { monitor, kvo, other, root: widget(monitor, "kv_memory"), compact: widget(kvo, "kv_memory_compact"),
              otherCompact: widget(other, "kv_memory_compact"), rowsText, seen: [] };
  window.__kvo = k;
  const state = () => ({
    event: k.root.dataset.event, capturing: k.root.dataset.capturing, text: rowsText(k.root),
    sections: [...k.root.querySelectorAll(".kvo-section")].map((s) => s.textContent),
    bars: [...k.root.querySelectorAll(".kvo-stack")].map((b) => `${b.dataset.bar}=${b.dataset.widths}`).join(";"),
    timeline: k.root.querySelector(".kvo-timeline")?.dataset.d ?? "",
    compact: rowsText(k.compact),
  });
  new MutationObserver(() => k.seen.push(state())).observe(k.root, { childList: true, subtree: true, characterData: true });
  return { monitor: monitor.size, kvo: kvo.size, other: other.size };
})"""

STILL_THERE_JS = """(() => {
  const app = window.comfyAPI.app.app;
  return app.graph.nodes.includes(window.__kvo.monitor) && window.__kvo.root.isConnected;
})()"""

# Every row of every readout: its width against the room it has, and for the compact ones the line count.
LAYOUT_JS = """(() => {
  const k = window.__kvo;
  const rows = (root) => [...root.querySelectorAll(".kvo-row, .kvo-section, .kvo-timeline")];
  const over = [];
  for (const [name, root] of [["monitor", k.root], ["kvo", k.compact], ["other", k.otherCompact]]) {
    if (root.scrollWidth > root.clientWidth) over.push(`${name}: the readout itself (${root.scrollWidth} > ${root.clientWidth})`);
    for (const r of rows(root)) {
      if (r.scrollWidth > r.clientWidth || r.getBoundingClientRect().right > root.getBoundingClientRect().right + 0.5)
        over.push(`${name}: ${r.textContent} (${r.scrollWidth} > ${r.clientWidth})`);
    }
  }
  const lines = (root) => [...root.querySelectorAll(".kvo-row")].map((r) =>
    Math.round(r.getBoundingClientRect().height / parseFloat(getComputedStyle(r).lineHeight)));
  const visible = (root) => { const a = root.getBoundingClientRect(); return a.height > 0 && a.width > 0; };
  const cut = (root) => root.scrollHeight > root.clientHeight + 1;
  return { over, kvoLines: lines(k.compact), otherLines: lines(k.otherCompact), monitorRows: rows(k.root).length,
           visible: [k.root, k.compact, k.otherCompact].every(visible),
           cutVertically: [k.root, k.compact, k.otherCompact].filter(cut).map((r) => r.dataset.kvOffload),
           sizes: { monitor: k.monitor.size, kvo: k.kvo.size, other: k.other.size } };
})()"""

COMPARE_JS = """(async () => {
  const url = (await (await fetch("/extensions")).json()).find((p) => p.endsWith("/kv_offload_format.js"));
  const fmt = await import(url);
  const snap = await (await fetch("/api/kv_offload/stats", { cache: "no-store" })).json();
  const k = window.__kvo;
  return {
    snap,
    expected: fmt.readoutText(fmt.buildReadout(snap)),
    actual: k.rowsText(k.root),
    compact: k.rowsText(k.compact),
    other: k.rowsText(k.otherCompact),
    own: [k.compact.dataset.own, k.otherCompact.dataset.own],
    widgetTime: k.root.dataset.time,
    timelinePoints: Number(k.root.querySelector(".kvo-timeline")?.dataset.points ?? 0),
    marks: [...k.root.querySelectorAll(".kvo-timeline .kvo-mark")].map((m) => m.getAttribute("class")),
  };
})()"""

QUEUE_JS = "window.comfyAPI.app.app.queuePrompt(0, 1).then(() => true)"

SERIALIZE_JS = """(async () => {
  const app = window.comfyAPI.app.app;
  const workflow = app.graph.serialize();
  const prompt = await app.graphToPrompt();
  const k = window.__kvo;
  const values = (node) => workflow.nodes.find((n) => String(n.id) === String(node.id)).widgets_values ?? [];
  return { monitor: values(k.monitor), kvo: values(k.kvo), other: values(k.other),
           kvoInputs: Object.keys(prompt.output.kvo.inputs),
           monitorInputs: prompt.output[k.monitor.id]?.inputs ?? {},
           text: JSON.stringify(workflow) + JSON.stringify(prompt.output) };
})()"""

BAD_MODE_JS = """(async () => {
  const app = window.comfyAPI.app.app;
  const mode = window.__kvo.kvo.widgets.find((w) => w.name === "mode");
  const before = mode.value;
  mode.value = "warp_speed";
  try { await app.queuePrompt(0, 1); } catch (e) { /* the page reports the refusal itself */ }
  mode.value = before;
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  let details = null;
  for (let i = 0; i < 50 && !details; i++, await sleep(100))  // the error toast, then its details panel
    details = [...document.querySelectorAll("button")].find((b) => b.textContent.trim() === "View details");
  details?.click();
  let text = "";
  for (let i = 0; i < 50 && !text.includes("KV Offload Settings - "); i++, await sleep(100)) text = document.body.innerText;
  return { errors: JSON.parse(JSON.stringify(app.lastNodeErrors?.kvo?.errors ?? [])), details: !!details,
           shown: text.match(/KV Offload Settings - [a-z_]+/g) ?? [] };
})()"""


def _setup(page, api_graph: dict) -> dict:
    """Load our graph once the page has stopped replacing its own (it restores a workflow after start-up)."""
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while time.monotonic() < deadline:
        sizes = page.eval(f"({SETUP_JS})({json.dumps(api_graph)})")
        time.sleep(2.0)
        if sizes and page.eval(STILL_THERE_JS):
            return sizes
    raise AssertionError("the page kept replacing its graph; the monitor node did not stay")



def _check_layout(page, when: str) -> dict:
    layout = page.eval(LAYOUT_JS)
    assert layout["visible"], f"{when}: a readout is not on screen: {layout}"
    assert layout["over"] == [], f"{when}: rows wider than their node: {layout['over']}"
    assert layout["kvoLines"] == [1, 1] and layout["otherLines"] == [1, 1], f"{when}: compact readout not two lines: {layout}"
    assert layout["cutVertically"] == [], f"{when}: a readout is taller than its node: {layout}"
    return layout


def _engine_loads(comfy, store: str) -> int:
    """The engine's own count, from the line each store logs when it closes (the last run's)."""
    found = re.findall(rf"KV offload \[{re.escape(store)}\]: closed; (\d+) loads", comfy.log.read_text(errors="replace"))
    assert found, f"no close line of store {store} in the ComfyUI log:\n{comfy.tail()}"
    return int(found[-1])


def _test_graph(steps: int, seed: int, ref: int = SLOW_CAPTURE_REF) -> dict:
    g = graph(mode="ram_sync", steps=steps, size=4, seed=seed)
    g["ref"]["inputs"]["height"] = g["ref"]["inputs"]["width"] = ref
    return g


def test_readout_at_default_size_during_and_after_a_run(comfy, page, tmp_path):
    shots = shots_dir(tmp_path)
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    page.call("Network.enable")
    _setup(page, _test_graph(steps=5000, seed=int(time.time())))
    close_dialogs(page)
    _check_layout(page, "before any run")

    # nothing of the readout in the workflow or the prompt: the Settings nodes keep exactly their inputs
    _, info = comfy.request("GET", "/object_info/KVOffloadSettings")
    declared = {**info["KVOffloadSettings"]["input"]["required"], **info["KVOffloadSettings"]["input"].get("optional", {})}
    got = page.eval(SERIALIZE_JS)
    assert got["monitor"] == [] and len(got["kvo"]) == len(got["other"]) == len(declared) - 1  # all but MODEL
    assert sorted(got["kvoInputs"]) == sorted(declared)
    assert got["monitorInputs"] == {} and "kvo-" not in got["text"] and "KV cache" not in got["text"]

    # 1. a long run from the page, stopped once the capture step and a few cached steps were seen
    assert page.eval(QUEUE_JS) is True
    try:
        page.until("window.__kvo.seen.some((s) => s.capturing === 'true' && s.sections.includes('KV cond'))",
                   RUN_TIMEOUT_S, "a store in the readout while the capture step runs")
        page.until("new Set(window.__kvo.seen.filter((s) => s.event === 'step' && s.capturing === 'false')"
                   ".map((s) => s.timeline)).size >= 3", RUN_TIMEOUT_S, "cached steps in the readout")
        _check_layout(page, "during the run")
        page.screenshot(shots / "kv_memory_during_run.png")
    finally:
        comfy.request("POST", "/interrupt")
    page.until("window.__kvo.root.dataset.event === 'final'", RUN_TIMEOUT_S, "the final snapshot in the widget")
    running = [s for s in page.eval("window.__kvo.seen") if s["event"] in ("start", "step")]
    assert all(s["text"].startswith("run: running") for s in running)
    assert len({s["bars"] for s in running}) >= 3, "the bars did not change during the run"
    assert len({s["timeline"] for s in running}) >= 3, "the timeline did not change during the run"
    interrupted = page.eval(COMPARE_JS)
    assert interrupted["actual"] == interrupted["expected"]
    [store] = interrupted["snap"]["stores"]
    assert store["transfers"]["count"] == _engine_loads(comfy, "cond")

    # 2. a short run to its end: the final snapshot is the route's, counts every transfer, shows the release
    page.eval("""(() => { const g = window.comfyAPI.app.app.graph;
      g.getNodeById("sampler").widgets.find((w) => w.name === "steps").value = 6;
      for (const name of ["width", "height"]) g.getNodeById("ref").widgets.find((w) => w.name === name).value = 4;
      return true; })()""")
    assert page.eval(QUEUE_JS) is True
    page.until(f"window.__kvo.root.dataset.event === 'final' && window.__kvo.root.dataset.time !== "
               f"'{interrupted['widgetTime']}'", RUN_TIMEOUT_S, "the second run's final snapshot")
    result = page.eval(COMPARE_JS)
    snap = result["snap"]
    assert result["actual"] == result["expected"], "the widget does not show the route's snapshot"
    assert float(result["widgetTime"]) == snap["time"]
    assert snap["event"] == "final" and snap["run"]["id"] != interrupted["snap"]["run"]["id"]
    assert snap["run"]["node"] == "kvo"
    [store] = snap["stores"]
    loads = _engine_loads(comfy, "cond")
    assert store["transfers"]["count"] == loads >= 5 * 4  # 6 steps: at least 5 cached forwards over 4 layers
    assert f"transfers: {loads} loads" in result["actual"]
    assert result["marks"] == ["kvo-mark kvo-m-capture", "kvo-mark kvo-m-release"]
    assert result["timelinePoints"] >= 2
    # each Settings node shows its own run: the one that ran its, the other none
    assert result["own"] == ["true", "false"]
    assert result["compact"].startswith(("last run finished", "finished")) and "held" in result["compact"]
    assert result["other"].startswith("no run") and "held" not in result["other"]
    _check_layout(page, "after the run")
    close_dialogs(page)
    page.screenshot(shots / "kv_memory_monitor.png")

    # 3. idle: the page fetches nothing and the server sends nothing
    page.events.clear()
    time.sleep(IDLE_S)
    page.eval("1")  # collects the events that arrived meanwhile
    fetched = [e["params"]["request"]["url"] for e in page.events if e["method"] == "Network.requestWillBeSent"]
    assert [u for u in fetched if "kv_offload" in u] == [], fetched
    frames = [e for e in page.events if e["method"] == "Network.webSocketFrameReceived"
              and "kv_offload" in e["params"]["response"]["payloadData"]]
    assert frames == []

    # 4. the sidebar tab: a header and the same readout, bars included
    page.eval("window.comfyAPI.app.app.extensionManager.sidebarTab.toggleSidebarTab('kv_offload.memory'), true")
    sidebar = page.until("(() => { const el = document.querySelector('[data-kv-offload=sidebar]');"
                         " return el && { text: window.__kvo.rowsText(el), bars: el.querySelectorAll('.kvo-stack').length,"
                         " header: document.querySelector('.kvo-tab-header')?.textContent,"
                         " collapsed: el.clientHeight < Math.min(el.scrollHeight, 300),"
                         " over: [...el.querySelectorAll('.kvo-row')].filter((r) => r.scrollWidth > r.clientWidth).length }; })()",
                         30, "the sidebar readout")
    assert sidebar["text"] == result["expected"] and sidebar["header"] == "KV Memory"
    assert not sidebar["collapsed"], "the sidebar readout is squeezed under its header"
    assert sidebar["bars"] >= 2 and sidebar["over"] == 0  # on a CPU: RAM and the KV cache (and swap if any)
    close_dialogs(page)
    page.screenshot(shots / "kv_memory_sidebar.png")


def test_a_multigpu_run_shows_both_devices_while_it_goes(comfy, page, tmp_path):
    """MultiGPU CFG Split over the two CPU devices of the test nodes: the readout has a row per device, each
    with its own store, while the run goes; every row fits its node."""
    shots = shots_dir(tmp_path)
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    split = graph(mode="ram_sync", steps=5000, size=4, seed=int(time.time()), cfg=2.0, max_gpus=2)
    _setup(page, split)
    close_dialogs(page)
    assert page.eval(QUEUE_JS) is True
    both = ("window.__kvo.seen.some((s) => s.event === 'step' && s.sections.includes('devices')"
            " && /^cpu \\[this process\\]: .*in 1 store/m.test(s.text)"
            " && /^cpu:1 \\[this process\\]: .*in 1 store/m.test(s.text))")
    try:
        page.until(both, RUN_TIMEOUT_S, "a row for each device in the readout while the run goes")
        live = page.eval(COMPARE_JS)
        assert live["snap"]["run"]["active"] and len(live["snap"]["devices"]) == 2, live["snap"].get("devices")
        assert sorted(d["device"] for d in live["snap"]["devices"]) == ["cpu", "cpu:1"]
        _check_layout(page, "during the multi-GPU run")
        page.screenshot(shots / "kv_memory_multigpu.png")
    finally:
        comfy.request("POST", "/interrupt")
    page.until("window.__kvo.root.dataset.event === 'final'", RUN_TIMEOUT_S, "the final snapshot in the widget")
    assert comfy.kv_files() == []


def test_a_bad_mode_gives_one_message_on_mode(comfy, page, tmp_path):
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    _setup(page, _test_graph(steps=2, seed=5, ref=4))
    close_dialogs(page)
    got = page.eval(BAD_MODE_JS)
    assert [e["extra_info"]["input_name"] for e in got["errors"]] == ["mode"], got
    assert "`mode` must be one of" in got["errors"][0]["details"]
    page.screenshot(shots_dir(tmp_path) / "kv_bad_mode.png")
    assert got["details"] and got["shown"] == ["KV Offload Settings - mode"], got  # one error, on mode
