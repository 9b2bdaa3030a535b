"""Prefix reuse against a real ComfyUI: with FluxKVCache semantics (FLUX.2, Qwen-Image) it stays off, the
latents with `reuse` on equal those with it off run after run, and the stats payload says why."""

import pytest

from graph_helpers import graph, sampled

pytestmark = pytest.mark.comfyui


def _latent(comfy, reuse, **kwargs):
    g = graph(**kwargs)
    g["kvo"]["inputs"]["reuse"] = reuse
    entry = comfy.run(g)
    assert sampled(entry), "KSampler was served from the execution cache"
    return comfy.latent(entry)


@pytest.mark.parametrize("model", ["flux2", "qwen_image"])
def test_reuse_on_gives_the_latents_of_reuse_off_run_after_run(comfy, model):
    for seed in (51, 52, 51):
        on = _latent(comfy, True, model=model, mode="ram_async", cfg=2.0, seed=seed)
        off = _latent(comfy, False, model=model, mode="ram_async", cfg=2.0, seed=seed)
        assert on.equal(off), f"seed {seed}: reuse changed the latents"
    _latent(comfy, True, model=model, mode="ram_sync", cfg=2.0, seed=53)
    code, stats = comfy.request("GET", "/kv_offload/stats")
    assert code == 200
    reuse = stats["reuse"]
    assert reuse["on"] is False and "FluxKVCache semantics" in reuse["reason"]
    assert reuse["entries"] == 0 and reuse["hits"] == 0


def test_a_graph_without_the_reuse_input_still_validates(comfy):
    g = graph(mode="ram_sync", cfg=2.0, seed=54)
    assert "reuse" not in g["kvo"]["inputs"]
    assert sampled(comfy.run(g))
