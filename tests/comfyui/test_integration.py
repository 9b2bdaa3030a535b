"""Integration suite: a real ComfyUI (`COMFYUI_PATH`, `main.py --cpu` on 127.0.0.1) with the pack loaded.

A tiny random FLUX.2 checkpoint is written at test time and loaded with `UNETLoader`; a tiny Qwen-Image
model is built in-process by a test-only node (tests/comfyui/testnodes). Graphs go through `POST /prompt`;
latents come back through `SaveLatent` files and are compared bit for bit: mode `gpu` against ComfyUI's
own `FluxKVCache`, every lossless mode against `gpu`, with CFG on and off.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=/path/to/python] pytest -m comfyui tests/comfyui
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.comfyui

LOSSLESS = ["ram_sync", "ram_async", "file_sync", "file_async", "auto"]
INTERRUPT_TIMEOUT_S = 120


# --- graphs ---------------------------------------------------------------------------------------------------

_seq = iter(range(1, 1 << 30))


def _cache_nodes(graph: dict, model_ref: list, mode, flux_kv) -> list:
    """Insert FluxKVCache before/after KVOffloadSettings as asked; return the final model link."""
    if flux_kv == "before":
        graph["fluxkv"] = {"class_type": "FluxKVCache", "inputs": {"model": model_ref}}
        model_ref = ["fluxkv", 0]
    if mode is not None:
        graph["kvo"] = {"class_type": "KVOffloadSettings",
                        "inputs": {"model": model_ref, "mode": mode, "prefetch_depth": 1,
                                   "bypass_page_cache": True, "pin_budget_mb": 0}}
        model_ref = ["kvo", 0]
    if flux_kv in ("only", "after"):
        graph["fluxkv"] = {"class_type": "FluxKVCache", "inputs": {"model": model_ref}}
        model_ref = ["fluxkv", 0]
    return model_ref


def graph(model: str = "flux2", mode=None, flux_kv=None, cfg: float = 1.0, steps: int = 4, ref_seed: int = 2,
          seed: int = 7, size: int = 4) -> dict:
    """UNETLoader / tiny Qwen-Image -> [FluxKVCache] -> [KVOffloadSettings] -> KSampler -> SaveLatent."""
    flux = model == "flux2"
    g = {"model": ({"class_type": "UNETLoader",
                    "inputs": {"unet_name": "tiny_flux2.safetensors", "weight_dtype": "default"}} if flux else
                   {"class_type": "KVOffloadTestTinyQwenImage", "inputs": {"seed": 0}})}
    model_ref = _cache_nodes(g, ["model", 0], mode, flux_kv)
    channels, frames, side = (128, 0, size) if flux else (16, 1, 2 * size)
    g["text"] = {"class_type": "KVOffloadTestConditioning", "inputs": {"seed": 1, "tokens": 8, "dim": 64}}
    g["ref"] = {"class_type": "KVOffloadTestLatent",
                "inputs": {"seed": ref_seed, "channels": channels, "height": side, "width": side, "frames": frames}}
    g["pos"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["text", 0], "latent": ["ref", 0]}}
    # the negative keeps the reference latents: with CFG, cond and uncond are batched into one forward
    g["neg"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}}
    g["start"] = {"class_type": "KVOffloadTestLatent",
                  "inputs": {"seed": 3, "channels": channels, "height": side, "width": side, "frames": frames}}
    g["sampler"] = {"class_type": "KSampler",
                    "inputs": {"model": model_ref, "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
                               "scheduler": "simple", "positive": ["pos", 0], "negative": ["neg", 0],
                               "latent_image": ["start", 0], "denoise": 1.0}}
    g["save"] = {"class_type": "SaveLatent",
                 "inputs": {"samples": ["sampler", 0], "filename_prefix": f"kvo/run{next(_seq):05d}"}}
    return g


def sampled(entry: dict) -> bool:
    """True when KSampler really ran in this prompt (was not served from the execution cache)."""
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_cached" and "sampler" in data.get("nodes", []):
            return False
    return True


def paths_in(payload, base: Path) -> list:
    """Cache paths (or pieces of them) that a readout payload gives away."""
    text = json.dumps(payload)
    return [p for p in (str(base), str(base.resolve()), "kv_offload_cache", "run-") if p in text]


def run_latent(comfy, **kwargs):
    entry = comfy.run(graph(**kwargs))
    assert sampled(entry), "KSampler was served from the execution cache"
    return comfy.latent(entry)


# --- tests ----------------------------------------------------------------------------------------------------

def test_node_is_registered_with_its_schema(comfy):
    _, info = comfy.request("GET", "/object_info/KVOffloadSettings")
    node = info["KVOffloadSettings"]
    assert node["display_name"] == "KV Offload Settings" and node["category"] == "kv_offload"
    required = node["input"]["required"]
    modes = required["mode"][1]["options"] if isinstance(required["mode"][0], str) else required["mode"][0]
    assert list(modes) == ["auto", "off", "gpu", "ram_sync", "ram_async", "file_sync", "file_async"]
    for name in ("mode", "prefetch_depth"):
        assert required[name][1].get("tooltip")
    has_21 = (Path(os.environ["COMFYUI_PATH"]) / "comfy" / "ldm" / "qwen_image21").is_dir()
    assert ("supported through the model's own prefix cache" if has_21 else "not in this ComfyUI version") \
        in node["description"]
    # the entry point also registers the memory monitor's node and its read-only route
    code, monitor = comfy.request("GET", "/object_info/KVMemoryMonitor")
    assert code == 200 and "KVMemoryMonitor" in monitor
    assert comfy.request("GET", "/kv_offload/stats")[0] == 200


def test_invalid_mode_is_rejected_at_validation(comfy):
    code, body = comfy.submit(graph(mode="warp_speed"))
    assert code == 400
    errors = json.dumps(body["node_errors"]["kvo"])
    assert "`mode` must be one of" in errors and "warp_speed" in errors
    bad_depth = graph(mode="ram_async")
    bad_depth["kvo"]["inputs"]["prefetch_depth"] = 99
    code, body = comfy.submit(bad_depth)
    assert code == 400 and "`prefetch_depth` must be between" in json.dumps(body["node_errors"]["kvo"])


@pytest.mark.parametrize("model", ["flux2", "qwen_image"])
@pytest.mark.parametrize("cfg", [1.0, 2.0], ids=["cfg_off", "cfg_on"])
def test_every_mode_is_bit_exact(comfy, model, cfg):
    baseline = run_latent(comfy, model=model, flux_kv="only", cfg=cfg)
    gpu = run_latent(comfy, model=model, mode="gpu", cfg=cfg)
    assert gpu.equal(baseline), "mode gpu differs from ComfyUI's FluxKVCache"
    for mode in LOSSLESS:
        assert run_latent(comfy, model=model, mode=mode, cfg=cfg).equal(gpu), f"mode {mode} differs from gpu"
    off = run_latent(comfy, model=model, mode="off", cfg=cfg)
    assert not off.equal(gpu), "mode off matched the cache: the cached path was never taken"
    assert comfy.kv_files() == []


@pytest.mark.parametrize("where", ["before", "after"])
def test_flux_kv_cache_in_the_graph_is_not_doubled(comfy, where):
    baseline = run_latent(comfy, flux_kv="only", cfg=2.0, ref_seed=11)
    both = run_latent(comfy, flux_kv=where, mode="ram_sync", cfg=2.0, ref_seed=11)
    assert both.equal(baseline)


def test_changed_reference_between_runs_is_not_served_stale(comfy):
    first = run_latent(comfy, mode="ram_async", cfg=2.0, ref_seed=21)
    entry = comfy.run(graph(mode="ram_async", cfg=2.0, ref_seed=22))
    cached = [n for kind, d in entry["status"]["messages"] if kind == "execution_cached" for n in d["nodes"]]
    assert "kvo" in cached and sampled(entry)  # the same patched MODEL, served from ComfyUI's cache, reused
    second = comfy.latent(entry)
    fresh = run_latent(comfy, flux_kv="only", cfg=2.0, ref_seed=22)
    assert not second.equal(first)
    assert second.equal(fresh)


def test_linked_mode_is_validated_when_the_node_runs(comfy):
    # ComfyUI validates a linked input as None: it must pass, and a bad value must still be refused
    linked = graph(mode="ram_sync", cfg=2.0, seed=41)
    linked["modesrc"] = {"class_type": "KVOffloadTestMode", "inputs": {"mode": "ram_sync"}}
    linked["kvo"]["inputs"]["mode"] = ["modesrc", 0]
    entry = comfy.run(linked)
    assert sampled(entry) and comfy.latent(entry).equal(run_latent(comfy, mode="ram_sync", cfg=2.0, seed=41))
    linked["modesrc"]["inputs"]["mode"] = "warp_speed"
    code, body = comfy.submit(linked)
    assert code == 200, body
    entry = comfy.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "error" and "`mode` must be one of" in json.dumps(entry["status"])


def test_interrupted_run_frees_everything_then_a_clean_run(comfy):
    long_run = graph(mode="file_async", cfg=2.0, steps=5000, size=8, seed=31)
    code, body = comfy.submit(long_run)
    assert code == 200, body
    deadline = time.monotonic() + INTERRUPT_TIMEOUT_S
    # the capture step has written layer files (not only the run directory's lock file): sampling is under way
    while not [f for f in comfy.kv_files() if f.endswith(".safetensors")]:
        assert time.monotonic() < deadline, f"no cache files appeared; log:\n{comfy.tail()}"
        time.sleep(0.02)
    # the files lie where ComfyUI's /view (temp, output, input) cannot serve them, and no path is published
    served = [comfy.base / d for d in ("temp", "output", "input")]
    assert not [f for f in comfy.kv_files() if any(Path(f).is_relative_to(d) for d in served)]
    time.sleep(0.3)
    code, stats = comfy.request("GET", "/kv_offload/stats")
    assert code == 200 and stats["run"]["active"] and stats["stores"], stats
    assert any(s["on_disk"] for s in stats["stores"]) and paths_in(stats, comfy.base) == [], stats
    assert comfy.request("POST", "/interrupt", {})[0] == 200
    entry = comfy.wait(body["prompt_id"])
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds, entry["status"]
    assert comfy.kv_files() == []
    clean = run_latent(comfy, mode="file_async", cfg=2.0, seed=32)
    assert clean.equal(run_latent(comfy, flux_kv="only", cfg=2.0, seed=32))
    assert comfy.kv_files() == []
    assert not (comfy.base / "kv_offload_cache").exists() and not (comfy.base / "temp" / "kv_offload").exists()
