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

from graph_helpers import LOSSLESS, graph, sampled

pytestmark = pytest.mark.comfyui

INTERRUPT_TIMEOUT_S = 120


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
    [error] = body["node_errors"]["kvo"]["errors"]  # one message, on the input it concerns
    assert error["extra_info"]["input_name"] == "mode"
    assert "`mode` must be one of" in error["details"] and "warp_speed" in error["details"]
    bad_depth = graph(mode="ram_async")
    bad_depth["kvo"]["inputs"]["prefetch_depth"] = 99
    code, body = comfy.submit(bad_depth)
    assert code == 400
    [error] = body["node_errors"]["kvo"]["errors"]  # ComfyUI's range check, on prefetch_depth alone
    assert error["extra_info"]["input_name"] == "prefetch_depth" and "max" in error["message"]


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


def test_real_size_layers_are_bit_exact_in_the_file_modes(comfy):
    # A reference of 46 x 46 latent tokens: K and V of 2.07 MiB per block (2 heads of 128, float32), over 2 MiB and
    # not a whole number of it, as real layers are; the file tiers' host slots then start inside their mapping.
    baseline = run_latent(comfy, flux_kv="only", cfg=2.0, steps=2, size=46)
    for mode in ("gpu", "file_sync", "file_async", "ram_sync"):
        got = run_latent(comfy, mode=mode, cfg=2.0, steps=2, size=46)
        assert got.equal(baseline), f"mode {mode} differs from ComfyUI's FluxKVCache at real layer sizes"


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


def _live_stats_on_disk(comfy):
    """The readout once the run's stores exist and hold files (the second forward, not the first), else None."""
    if not comfy.kv_files():
        return None
    code, stats = comfy.request("GET", "/kv_offload/stats")
    ready = code == 200 and stats["run"]["active"] and stats["stores"] and any(s["on_disk"] for s in stats["stores"])
    return stats if ready else None


def stop_prompt(comfy, prompt_id: str, timeout: float = INTERRUPT_TIMEOUT_S) -> None:
    """Takes `prompt_id` off the queue or interrupts it, and waits until ComfyUI has let go of it."""
    comfy.request("POST", "/queue", {"delete": [prompt_id]})
    deadline = time.monotonic() + timeout
    while True:
        _, queue = comfy.request("GET", "/queue")
        running = [item[1] for item in queue.get("queue_running", [])]
        pending = [item[1] for item in queue.get("queue_pending", [])]
        if prompt_id not in running + pending:
            return
        if prompt_id in running:
            comfy.request("POST", "/interrupt", {})
        assert time.monotonic() < deadline, f"prompt {prompt_id} still queued or running; log:\n{comfy.tail()}"
        time.sleep(0.05)


def test_interrupted_run_frees_everything_then_a_clean_run(comfy):
    long_run = graph(mode="file_async", cfg=2.0, steps=5000, size=8, seed=31)
    code, body = comfy.submit(long_run)
    assert code == 200, body
    prompt_id = body["prompt_id"]
    try:
        deadline = time.monotonic() + INTERRUPT_TIMEOUT_S
        while (stats := _live_stats_on_disk(comfy)) is None:  # sampling is under way, the cache on disk
            assert time.monotonic() < deadline, f"no store with files appeared; log:\n{comfy.tail()}"
            time.sleep(0.02)
        # the files lie where ComfyUI's /view (temp, output, input) cannot serve them, and no path is published
        served = [comfy.base / d for d in ("temp", "output", "input")]
        assert not [f for f in comfy.kv_files() if any(Path(f).is_relative_to(d) for d in served)]
        assert paths_in(stats, comfy.base) == [], stats
    finally:
        stop_prompt(comfy, prompt_id)  # also when an assertion failed: a 5000-step run must not outlive the test
    entry = comfy.wait(prompt_id)
    kinds = [kind for kind, _ in entry["status"]["messages"]]
    assert "execution_interrupted" in kinds, entry["status"]
    assert comfy.kv_files() == []
    clean = run_latent(comfy, mode="file_async", cfg=2.0, seed=32)
    assert clean.equal(run_latent(comfy, flux_kv="only", cfg=2.0, seed=32))
    assert comfy.kv_files() == []
    assert not (comfy.base / "kv_offload_cache").exists() and not (comfy.base / "temp" / "kv_offload").exists()
