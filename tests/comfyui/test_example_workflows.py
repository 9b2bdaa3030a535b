"""The example workflows in a real ComfyUI: served as templates, every node known, every link well typed, and
loaded by the real front end without a missing-node report.

Nodes that this ComfyUI (v0.33.0) does not have are allowed only where they are listed in NEWER_COMFYUI with
the types of the slots the workflow uses, so their links are checked too. Front-end-only nodes (notes) are
checked in the browser test, where the front end defines them.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=...] pytest -m comfyui tests/comfyui/test_example_workflows.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest

from chromium import PAGE_TIMEOUT_S, READY_JS, page  # noqa: F401  (the `page` fixture: headless Chromium)
from workflow_helpers import FOLDER, FRONTEND_ONLY, NOTES_READY_JS, PACK, ROOT, WORKFLOWS

pytestmark = pytest.mark.comfyui

NEWER_COMFYUI = {  # node -> (why it is missing here, the slot types the workflows use)
    "TextEncodeQwenImage21": ("Qwen-Image 2.1's text encoder, in ComfyUI versions newer than v0.33.0",
                              {"inputs": {"clip": "CLIP", "vae": "VAE", "images.image_1": "IMAGE"},
                               "outputs": ["CONDITIONING", "CONDITIONING", "LATENT"]}),
}
ONLY_ON_NEWER = {"Qwen-Image 2.1 - KV prefix offload": {"TextEncodeQwenImage21"}}  # the workflows that need a newer ComfyUI
LINK_TYPES = {"MODEL", "CLIP", "VAE", "IMAGE", "MASK", "LATENT", "CONDITIONING", "GUIDER", "SAMPLER", "SIGMAS", "NOISE",
              "CLIP_VISION", "CLIP_VISION_OUTPUT", "VIDEO", "AUDIO"}
FILE_WIDGETS = {"unet_name", "clip_name", "vae_name", "image", "file"}  # lists of files that are absent in the test ComfyUI


def _load(name: str) -> dict:
    return json.loads((FOLDER / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def object_info(comfy) -> dict:
    code, info = comfy.request("GET", "/object_info")
    assert code == 200 and "KVOffloadSettings" in info
    return info


def _slots(node_type: str, object_info: dict):
    """(input name -> type, [output types]) of a node type, from /object_info or NEWER_COMFYUI."""
    if node_type in object_info:
        spec = object_info[node_type]
        declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        inputs = {name: (kind if isinstance(kind, str) else "COMBO") for name, (kind, *_) in declared.items()}
        return inputs, list(spec["output"])
    _, slots = NEWER_COMFYUI[node_type]
    return slots["inputs"], slots["outputs"]


def _widget_names(spec: dict) -> list:
    """Widget order as the front end builds it: inputs that are not links, plus the extra control widgets."""
    names = []
    for section in ("required", "optional"):
        for name in spec["input_order"].get(section, []):
            kind, *rest = spec["input"][section][name]
            options = rest[0] if rest else {}
            if isinstance(kind, str) and kind in LINK_TYPES:
                continue
            names.append(name)
            if options.get("control_after_generate"):
                names.append("control_after_generate")
            if options.get("image_upload") or options.get("video_upload"):
                names.append("upload")
    return names


def test_each_workflow_has_a_small_jpeg_thumbnail_of_its_name():
    """The template browser shows `<name>.jpg` beside `<name>.json` (without one: a 404 and a stand-in)."""
    from PIL import Image

    assert sorted(p.stem for p in FOLDER.glob("*.jpg")) == WORKFLOWS
    for name in WORKFLOWS:
        path = FOLDER / f"{name}.jpg"
        with Image.open(path) as im:
            assert (im.format, im.size) == ("JPEG", (640, 400)), f"{path.name}: {im.format} {im.size}"
        assert 5_000 < path.stat().st_size < 80_000, f"{path.name}: {path.stat().st_size} bytes"
        assert "_" not in name and name[0].isupper(), f"{name}: the file name is the card's title"


def test_templates_are_served_by_comfyui(comfy):
    code, listing = comfy.request("GET", "/workflow_templates")
    assert code == 200 and sorted(listing[PACK]) == WORKFLOWS
    for name in WORKFLOWS:
        code, served = comfy.request("GET", f"/api/workflow_templates/{PACK}/{quote(name)}.json")
        assert code == 200 and served == _load(name)


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_node_exists_and_every_link_joins_matching_types(name, object_info):
    wf = _load(name)
    nodes = {n["id"]: n for n in wf["nodes"]}
    types = {n["type"] for n in wf["nodes"]}
    assert {"KVOffloadSettings", "KVMemoryMonitor"} <= types and types & FRONTEND_ONLY, "settings, monitor, note"
    unknown = types - set(object_info) - FRONTEND_ONLY
    assert unknown == ONLY_ON_NEWER.get(name, set()) and unknown <= set(NEWER_COMFYUI), unknown
    for link_id, origin, origin_slot, target, target_slot, link_type in wf["links"]:
        src, dst = nodes[origin], nodes[target]
        input_name = dst["inputs"][target_slot]["name"]
        outputs = _slots(src["type"], object_info)[1]
        inputs = _slots(dst["type"], object_info)[0]
        where = f"link {link_id}: {src['type']}[{origin_slot}] -> {dst['type']}.{input_name}"
        assert outputs[origin_slot] == inputs[input_name] == link_type, where
        assert link_id in src["outputs"][origin_slot]["links"] and dst["inputs"][target_slot]["link"] == link_id, where
    # every required link input is connected, and every MODEL path to a sampler goes through our node
    for node in wf["nodes"]:
        if node["type"] in object_info:
            required = object_info[node["type"]]["input"].get("required", {})
            linked = {i["name"] for i in node["inputs"] if i["link"] is not None}
            missing = [k for k, (kind, *_) in required.items() if isinstance(kind, str) and kind in LINK_TYPES
                       and k not in linked]
            assert not missing, f"{node['type']} has unconnected inputs {missing}"
    settings = [n for n in wf["nodes"] if n["type"] == "KVOffloadSettings"]
    assert len(settings) == 1 and settings[0]["outputs"][0]["links"] and settings[0]["inputs"][0]["link"]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_widget_values_fit_the_nodes(name, object_info):
    for node in _load(name)["nodes"]:
        if node["type"] not in object_info:
            continue
        spec = object_info[node["type"]]
        names = _widget_names(spec)
        values = node.get("widgets_values", [])
        assert len(values) == len(names), f"{node['type']}: {values} for widgets {names}"
        declared = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        for widget, value in zip(names, values):
            kind, *rest = declared.get(widget, (None,))
            options = kind if isinstance(kind, list) else (rest[0].get("options") if rest and kind == "COMBO" else None)
            if options is not None and widget not in FILE_WIDGETS:
                assert value in options, f"{node['type']}.{widget} = {value!r}, not one of {options}"


def test_registry_metadata_parses_with_comfyuis_own_parser():
    """ComfyUI's `comfy_config` (kept in sync with comfy-cli, which publishes to the registry) reads pyproject."""
    comfy_path = os.environ.get("COMFYUI_PATH")
    if not comfy_path or not (Path(comfy_path) / "comfy_config").is_dir():
        pytest.skip("COMFYUI_PATH is not set (or has no comfy_config)")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from comfy_config import config_parser;"
            "print(config_parser.extract_node_configuration(sys.argv[2]).model_dump_json())")
    done = subprocess.run([os.environ.get("COMFYUI_PYTHON", sys.executable), "-c", code, comfy_path, str(ROOT)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    project, comfy = config["project"], config["tool_comfy"]
    assert project["name"] == PACK and project["license"]["text"] == "Apache-2.0"
    assert project["urls"]["repository"] == "https://github.com/kv-offload/comfyui-kv-offload"
    assert project["urls"]["documentation"] and project["urls"]["issues"]
    assert project["supported_comfyui_version"] and project["supported_os"] and project["supported_accelerators"]
    assert comfy["publisher_id"] == "kv-offload" and comfy["display_name"] == "KV Offload"
    assert comfy["icon"].endswith("/icon.png") and (ROOT / "icon.png").is_file()


LOAD_JS = """(async (name) => {
  const app = window.comfyAPI.app.app;
  const pinia = document.getElementById("vue-app")?.__vue_app__?.config.globalProperties.$pinia;
  const store = pinia?._s.get("missingNodesError");
  store?.setMissingNodeTypes([]);
  const workflow = await (await fetch(`/api/workflow_templates/%s/${encodeURIComponent(name)}.json`)).json();
  await app.loadGraphData(workflow);
  const LG = window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph;
  const nodes = app.graph.nodes;
  const dialogs = [...document.querySelectorAll("[role=dialog], .p-dialog, .comfy-modal")]
    .map((d) => d.innerText).filter((t) => /missing/i.test(t));
  return {
    ids: nodes.map((n) => Number(n.id)).sort((a, b) => a - b),
    links: app.graph.links instanceof Map ? app.graph.links.size : Object.keys(app.graph.links).length,
    unregistered: [...new Set(nodes.map((n) => n.type).filter((t) => !(t in LG.registered_node_types)))].sort(),
    reported: store
      ? (store.missingNodesError?.nodeTypes ?? []).map((e) => (typeof e === "string" ? e : e.type)) : null,
    dialogs,
    settings: nodes.filter((n) => n.type === "KVOffloadSettings")
      .map((n) => n.widgets.find((w) => w.name === "mode").value),
  };
})""" % PACK


REPORTED_JS = """(document.getElementById("vue-app").__vue_app__.config.globalProperties.$pinia._s
  .get("missingNodesError").missingNodesError?.nodeTypes ?? []).map((e) => (typeof e === "string" ? e : e.type))"""


@pytest.mark.browser
def test_the_front_end_loads_each_workflow_without_a_missing_node_report(comfy, page):  # noqa: F811
    page.until(READY_JS, PAGE_TIMEOUT_S, "the ComfyUI page, our extension and our node types")
    page.until(NOTES_READY_JS, PAGE_TIMEOUT_S, f"the front end's own {sorted(FRONTEND_ONLY)}")
    for name in WORKFLOWS:
        wf = _load(name)
        expected_ids = sorted(n["id"] for n in wf["nodes"])
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while True:  # right after start-up the page may still restore its own workflow over ours: load again
            got = page.eval(f"{LOAD_JS}({json.dumps(name)})")
            if got["ids"] == expected_ids and got["links"] == len(wf["links"]):
                break
            assert time.monotonic() < deadline, f"{name}: the page never showed the workflow ({got})"
        newer = sorted(ONLY_ON_NEWER.get(name, ()))
        assert got["unregistered"] == newer, f"{name}: node types the front end does not know: {got['unregistered']}"
        if got["reported"] is not None:  # front ends with a missing-nodes store: what it reports (it may come late)
            expected = json.dumps(json.dumps(newer, separators=(",", ":")))  # a JS string literal of the JSON
            page.until(f"JSON.stringify([...new Set({REPORTED_JS})].sort()) === {expected}",
                       PAGE_TIMEOUT_S, f"{name}: the missing-node report to be {newer} (it was {got['reported']})")
        if not newer:
            assert got["dialogs"] == [], f"{name}: {got['dialogs']}"
        assert got["settings"] == [n["widgets_values"][0] for n in wf["nodes"] if n["type"] == "KVOffloadSettings"]
