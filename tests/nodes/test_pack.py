"""The pack as ComfyUI loads it: an entry point and a web directory, and no ComfyUI import until called."""

import inspect
import os
import sys

import kv_offload_pack
from kv_offload_pack.nodes.families import qwen21


def test_pack_exports_the_entry_point_without_importing_comfyui():
    assert inspect.iscoroutinefunction(kv_offload_pack.comfy_entrypoint)
    assert os.path.isdir(os.path.join(os.path.dirname(kv_offload_pack.__file__), kv_offload_pack.WEB_DIRECTORY))
    assert not hasattr(kv_offload_pack, "NODE_CLASS_MAPPINGS")  # it would stop ComfyUI calling the entry point
    assert not any(m == "comfy" or m.startswith(("comfy.", "comfy_api")) for m in sys.modules)


def test_qwen21_support_says_whether_this_comfyui_has_it():
    # no ComfyUI here: the node's help says 2.1 needs a newer ComfyUI instead of failing
    assert "not in this ComfyUI version" in qwen21.qwen21_support()
