"""The node's VRAM budget and storage inputs in a real ComfyUI: lossless plans exact, lossy storage close."""

from __future__ import annotations

import pytest

from graph_helpers import graph, sampled

pytestmark = pytest.mark.comfyui


def latent_with(comfy, mode, cfg, **inputs):
    g = graph(mode=mode, cfg=cfg)
    g["kvo"]["inputs"].update(inputs)
    entry = comfy.run(g)
    assert sampled(entry), "KSampler was served from the execution cache"
    return comfy.latent(entry)


@pytest.mark.parametrize("cfg", [1.0, 2.0], ids=["cfg_off", "cfg_on"])
def test_budget_and_storage_inputs_reach_the_cache(comfy, cfg):
    gpu = latent_with(comfy, "gpu", cfg)
    for mode in ("ram_async", "file_async", "auto"):  # a budget is a plan, and every lossless plan is exact
        assert latent_with(comfy, mode, cfg, vram_budget_mb=1).equal(gpu), f"{mode} with a VRAM budget"
    for storage in ("fp8", "int8"):
        lossy = latent_with(comfy, "ram_async", cfg, storage=storage)
        assert not lossy.equal(gpu)  # the codec really ran
        assert ((lossy - gpu).norm() / gpu.norm()).item() < 0.05
    assert comfy.kv_files() == []


def test_bad_budget_is_rejected_at_validation(comfy):
    g = graph(mode="ram_async")
    g["kvo"]["inputs"]["vram_budget_mb"] = -3
    code, body = comfy.submit(g)
    assert code == 400 and "vram_budget_mb" in str(body["node_errors"]["kvo"])
