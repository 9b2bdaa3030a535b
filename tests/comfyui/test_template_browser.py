"""The template browser in a real page: every example workflow is a card with its human title and its own
thumbnail, nothing of the pack fails to load or logs an error, and once each workflow is opened from its card
no node's rectangle (title bar included, at the size the front end renders it) overlaps another's.

Run it with ComfyUI's own front end and with today's (COMFYUI_FRONTEND_PATH, see conftest.py).
KV_OFFLOAD_THUMBNAIL_DIR=example_workflows re-renders the thumbnails: each workflow as this page draws it,
a 640x400 JPEG named like the workflow.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_FRONTEND_PATH=...] pytest tests/comfyui/test_template_browser.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from chromium import PAGE_TIMEOUT_S, READY_JS, close_dialogs, page  # noqa: F401  (`page`: the fixture)
from workflow_helpers import FOLDER, FRONTEND_ONLY, NOTES_READY_JS, PACK, WORKFLOWS

pytestmark = [pytest.mark.browser, pytest.mark.comfyui]

THUMB_SIZE = (640, 400)
OURS = (f"/{PACK}/", "kv_offload")  # URL parts of the pack: its templates, its web extension, its routes

# Opens the template browser on the pack's category; waits until every card's image has loaded.
OPEN_JS = """(async (pack, names) => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  await window.comfyAPI.app.app.extensionManager.command.execute("Comfy.BrowseTemplates");
  const leaf = (text) => [...document.querySelectorAll("*")].find((e) => !e.children.length && e.textContent.trim() === text);
  let nav;
  for (let i = 0; i < 100 && !(nav = leaf(pack)); i++) await sleep(100);
  if (!nav) return null;
  nav.click();
  const card = (name) => document.querySelector(`[data-testid="template-workflow-${CSS.escape(name)}"]`);
  const cards = () => names.map((name) => {
    const c = card(name), img = c?.querySelector("img");
    return c && { name, title: c.querySelector("h3")?.textContent.trim(), src: img?.src ?? "",
                  loaded: !!img && img.complete && img.naturalWidth > 0, size: img ? [img.naturalWidth, img.naturalHeight] : null };
  });
  for (let i = 0; i < 100; i++, await sleep(100)) {
    const got = cards();
    if (got.every((c) => c && c.loaded)) return got;
  }
  return cards();
})"""

CLICK_JS = """((name) => { document.querySelector(`[data-testid="template-workflow-${CSS.escape(name)}"]`).click(); return true; })"""

# Each node's rectangle as the canvas draws it (getBounding: title bar included), once two reads agree.
RECTS_JS = """(async () => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const graph = window.comfyAPI.app.app.graph;
  const read = () => JSON.stringify(graph.nodes.map((n) => ({ id: Number(n.id), type: n.type, title: n.title,
    rect: [...n.getBounding()].map((v) => Math.round(v * 10) / 10) })));
  let last = read();
  for (let i = 0; i < 20; i++) { await sleep(250); const now = read(); if (now === last) break; last = now; }
  return JSON.parse(last);
})()"""

# Fits the graph into a centred 16:10 region of the canvas, without
# the missing-model marks (the model files are absent here); hides the page's own panels over the canvas.
FRAME_JS = """(async () => {
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  await sleep(1000);  // the canvas takes the window's new size
  const app = window.comfyAPI.app.app, canvas = app.canvas;
  const b = app.graph.nodes.map((n) => n.getBounding());
  const x0 = Math.min(...b.map((r) => r[0])), y0 = Math.min(...b.map((r) => r[1]));
  const x1 = Math.max(...b.map((r) => r[0] + r[2])), y1 = Math.max(...b.map((r) => r[1] + r[3]));
  const el = canvas.canvas.getBoundingClientRect();
  const w = Math.min(el.width, el.height * 1.6), h = w / 1.6, pad = 24;
  const scale = Math.min((w - 2 * pad) / (x1 - x0), (h - 2 * pad) / (y1 - y0));
  const clip = { x: el.left + (el.width - w) / 2, y: el.top + (el.height - h) / 2, width: w, height: h };
  canvas.ds.scale = scale;
  canvas.ds.offset = [(clip.x - el.left + w / 2) / scale - (x0 + x1) / 2, (clip.y - el.top + h / 2) / scale - (y0 + y1) / 2];
  canvas.show_info = false;
  for (const n of app.graph.nodes) n.has_errors = false;
  const style = document.createElement("style");
  style.textContent = "body * { visibility: hidden !important } canvas#graph-canvas, .dom-widget, .dom-widget * { visibility: visible !important }";
  document.head.append(style);
  app.graph.setDirtyCanvas(true, true);
  await sleep(1000);
  return clip;
})()"""


def _overlaps(nodes: list) -> list:
    found = []
    for i, a in enumerate(nodes):
        ax, ay, aw, ah = a["rect"]
        for b in nodes[i + 1:]:
            bx, by, bw, bh = b["rect"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append(f"{a['title']} {a['rect']} / {b['title']} {b['rect']}")
    return found


def _ours(events: list) -> tuple[list, list]:
    """Failed requests of the pack, and every error the page logged (with where it came from)."""
    urls = {e["params"]["requestId"]: e["params"]["request"]["url"] for e in events
            if e["method"] == "Network.requestWillBeSent"}
    failed = [f"{e['params']['response']['status']} {e['params']['response']['url']}" for e in events
              if e["method"] == "Network.responseReceived" and e["params"]["response"]["status"] >= 400]
    failed += [f"{e['params']['errorText']} {urls.get(e['params']['requestId'])}" for e in events
               if e["method"] == "Network.loadingFailed"]
    errors = [json.dumps(e["params"])[:400] for e in events
              if (e["method"] == "Runtime.consoleAPICalled" and e["params"]["type"] in ("error", "assert"))
              or e["method"] == "Runtime.exceptionThrown"]
    return [f for f in failed if any(part in f for part in OURS)], errors


def _open_templates(page) -> list:
    page.events.clear()
    cards = page.eval(f"({OPEN_JS})({json.dumps(PACK)}, {json.dumps(WORKFLOWS)})")
    assert cards is not None, f"the template browser has no category {PACK}"
    return cards


def _load_from_card(page, name: str) -> list:
    expected = sorted(n["id"] for n in json.loads((FOLDER / f"{name}.json").read_text())["nodes"])
    deadline = time.monotonic() + PAGE_TIMEOUT_S
    while True:  # right after start-up the page may still restore its own workflow over ours: open it again
        _open_templates(page)
        page.eval(f"({CLICK_JS})({json.dumps(name)})")
        page.until(f"window.comfyAPI.app.app.graph.nodes.length === {len(expected)}", 30, f"{name} on the canvas")
        nodes = page.eval(RECTS_JS)
        if sorted(n["id"] for n in nodes) == expected:
            return nodes
        assert time.monotonic() < deadline, f"{name}: the page never showed the workflow"


def _thumbnail(page, path: Path) -> None:
    """The open workflow drawn in a large window (at a zoom the canvas draws in full detail), made small."""
    close_dialogs(page)
    page.call("Emulation.setDeviceMetricsOverride", width=2800, height=1750, deviceScaleFactor=1, mobile=False)
    try:
        page.jpeg(path, page.eval(FRAME_JS), THUMB_SIZE[0])
    finally:
        page.eval("document.head.lastElementChild.remove(), true")  # the panels again
        page.call("Emulation.clearDeviceMetricsOverride")


def test_each_workflow_is_a_card_with_title_and_thumbnail(comfy, page):  # noqa: F811
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    for domain in ("Network", "Runtime", "Log"):
        page.call(f"{domain}.enable")
    version = page.eval("window.__COMFYUI_FRONTEND_VERSION__")
    print(f"front end {version}")
    assert comfy.frontend in (None, version), f"COMFYUI_FRONTEND_PATH holds {comfy.frontend}, the page is {version}"
    close_dialogs(page)
    cards = _open_templates(page)
    assert [c and c["title"] for c in cards] == WORKFLOWS, cards  # the file names are the titles
    for card in cards:
        assert card["loaded"] and card["size"] == list(THUMB_SIZE), card
        assert "default-template" not in card["src"], f"{card['name']}: the front end's stand-in picture"
    failed, errors = _ours(page.events)
    assert failed == [] and errors == [], (failed, errors)


def test_no_node_overlaps_another_once_each_workflow_is_open(comfy, page):  # noqa: F811
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    for domain in ("Network", "Runtime", "Log"):
        page.call(f"{domain}.enable")
    page.until(NOTES_READY_JS, PAGE_TIMEOUT_S, f"the front end's own {sorted(FRONTEND_ONLY)}")
    close_dialogs(page)
    thumbs = os.environ.get("KV_OFFLOAD_THUMBNAIL_DIR")
    for name in WORKFLOWS:
        nodes = _load_from_card(page, name)
        assert _overlaps(nodes) == [], f"{name}: nodes overlap"
        failed, errors = _ours(page.events)
        if thumbs:  # before the checks below, which fail while a thumbnail is missing
            _thumbnail(page, Path(thumbs) / f"{name}.jpg")
        assert failed == [] and [e for e in errors if any(part in e for part in OURS)] == [], (failed, errors)
