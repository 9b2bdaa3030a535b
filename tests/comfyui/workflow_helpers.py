"""The example workflows the ComfyUI suites check: where they are, the category ComfyUI lists them under, and the
front end's own node types they use."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "example_workflows"
WORKFLOWS = sorted(p.stem for p in FOLDER.glob("*.json"))
PACK = "comfyui-kv-offload"  # the folder name ComfyUI lists the templates under (the conftest's symlink)
FRONTEND_ONLY = {"MarkdownNote", "Note"}  # defined by the front end, never in /object_info

# Newer front ends register their note types a moment after the rest.
NOTES_READY_JS = (f"{json.dumps(sorted(FRONTEND_ONLY))}.every((t) => t in "
                  "(window.LiteGraph ?? window.comfyAPI.litegraph.LiteGraph).registered_node_types)")
