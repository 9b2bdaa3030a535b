"""Autoregressive video in a real ComfyUI: the KV cache of `SamplerARVideo` served by KV Offload Settings.

A tiny random Causal-WAN checkpoint (tests/comfyui/make_tiny_causal_wan.py) loads through `UNETLoader` as
`WAN21_CausalAR`; `EmptyARVideoLatent` + `SamplerARVideo` (through `SamplerCustom`, cfg 1 as upstream needs) make
the video, and the I2V pass runs from the initial latent `ARVideoI2V` would set (a test node sets it without a VAE).
Every lossless mode must give the latent of the same graph without the node, bit for bit, through the pack's
stores, with the cache's device bytes at most the resident layers and the ring's slots; no file is left after a
run, an interrupt or an error.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=...] pytest -m comfyui tests/comfyui/test_ar_video.py
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.comfyui

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
_seq = iter(range(1, 1 << 30))
LAYERS, DIM = 3, 64


def ar_graph(mode=None, nfpb=1, i2v=False, length=25, size=32, steps=3, seed=7, fail_at=None, **kvo) -> dict:
    """UNETLoader -> [ARVideoI2V's latent] -> [KVOffloadSettings] -> SamplerCustom(SamplerARVideo) -> SaveLatent."""
    g = {"model": {"class_type": "UNETLoader",
                   "inputs": {"unet_name": "tiny_causal_wan.safetensors", "weight_dtype": "default"}}}
    ref = ["model", 0]
    if i2v:
        g["i2v"] = {"class_type": "KVOffloadTestARInitialLatent",
                    "inputs": {"model": ref, "seed": 11, "height": size // 8, "width": size // 8}}
        ref = ["i2v", 0]
    if mode is not None:
        g["kvo"] = {"class_type": "KVOffloadSettings",
                    "inputs": {"model": ref, "mode": mode, "prefetch_depth": 1, "bypass_page_cache": True,
                               "pin_budget_mb": 0, **kvo}}
        ref = ["kvo", 0]
    if fail_at is not None:
        g["fail"] = {"class_type": "KVOffloadTestFailAtCall", "inputs": {"model": ref, "calls": fail_at}}
        ref = ["fail", 0]
    for name, text_seed in (("pos", 1), ("neg", 2)):
        g[name] = {"class_type": "KVOffloadTestConditioning", "inputs": {"seed": text_seed, "tokens": 8, "dim": 64}}
    g["latent"] = {"class_type": "EmptyARVideoLatent",
                   "inputs": {"width": size, "height": size, "length": length, "batch_size": 1}}
    g["ar"] = {"class_type": "SamplerARVideo", "inputs": {"num_frame_per_block": nfpb}}
    g["sigmas"] = {"class_type": "BasicScheduler", "inputs": {"model": ref, "scheduler": "simple", "steps": steps,
                                                              "denoise": 1.0}}
    g["sampler"] = {"class_type": "SamplerCustom",
                    "inputs": {"model": ref, "add_noise": True, "noise_seed": seed, "cfg": 1.0, "positive": ["pos", 0],
                               "negative": ["neg", 0], "sampler": ["ar", 0], "sigmas": ["sigmas", 0],
                               "latent_image": ["latent", 0]}}
    g["save"] = {"class_type": "SaveLatent",
                 "inputs": {"samples": ["sampler", 0], "filename_prefix": f"ar/run{next(_seq):05d}"}}
    return g


def latent(comfy, **kwargs):
    entry = comfy.run(ar_graph(**kwargs))
    cached = [n for kind, d in entry["status"].get("messages", []) if kind == "execution_cached" for n in d["nodes"]]
    assert "sampler" not in cached, "the sampler was served from the execution cache"
    return comfy.latent(entry)


def test_the_tiny_checkpoint_loads_as_causal_ar(comfy):
    comfy.run(ar_graph(mode="ram_sync"))
    log = comfy.log.read_text(errors="replace")
    assert "mode ram_sync on ar_video" in log and "WAN21_CausalAR" in log


@pytest.mark.parametrize("i2v", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("nfpb", [1, 3])
def test_every_lossless_mode_is_bit_identical_to_no_node(comfy, nfpb, i2v):
    theirs = latent(comfy, nfpb=nfpb, i2v=i2v)
    frames = (25 - 1) // 4 + 1
    tokens = frames * (32 // 16) ** 2
    layer = 2 * tokens * DIM * 4  # K and V of one layer at full length, fp32 on the CPU
    for mode in MODES:
        assert latent(comfy, mode=mode, nfpb=nfpb, i2v=i2v).equal(theirs), f"mode {mode} differs"
        _, stats = comfy.request("GET", "/kv_offload/stats")  # the final readout of that run
        (store,) = [s for s in stats["stores"] if s["name"].startswith("video")]
        grow = store["growing"]
        assert store["closed"] and grow["tokens"] == tokens and grow["appended"]["bytes"] == layer * LAYERS, mode
        resident = store["plan"]["device"]
        slots = min(LAYERS - resident, store["prefetch_depth"] + 1)
        assert store["peak_device_bytes"] <= layer * (resident + slots), (mode, store)
        if mode not in ("gpu", "auto"):
            assert resident == 0 and store["transfers"]["count"] > 0, mode
        assert comfy.kv_files() == []


def test_an_interrupted_run_leaves_no_file_then_runs_exact(comfy):
    code, body = comfy.submit(ar_graph(mode="file_async", length=1021, steps=4, seed=31))
    assert code == 200, body
    deadline = time.monotonic() + 120
    try:
        while not comfy.kv_files():  # sampling is under way, the video cache on disk
            assert time.monotonic() < deadline, f"no cache file appeared; log:\n{comfy.tail()}"
            time.sleep(0.02)
    finally:
        comfy.request("POST", "/interrupt", {})
    entry = comfy.wait(body["prompt_id"])
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    assert comfy.kv_files() == []
    assert latent(comfy, mode="file_async", seed=32).equal(latent(comfy, seed=32))


def test_an_error_mid_run_leaves_no_file(comfy):
    code, body = comfy.submit(ar_graph(mode="file_sync", nfpb=3, seed=33, fail_at=10))
    assert code == 200, body
    entry = comfy.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "error" and "test failure" in str(entry["status"])
    assert comfy.kv_files() == []


@pytest.mark.parametrize("storage", ["int8", "fp8"])
def test_compact_storage_is_close_and_its_error_reported(comfy, storage):
    exact = latent(comfy, nfpb=3, seed=41)
    ours = latent(comfy, mode="ram_async", storage=storage, nfpb=3, seed=41)
    error = ((ours - exact).norm() / exact.norm()).item()
    _, stats = comfy.request("GET", "/kv_offload/stats")
    (store,) = [s for s in stats["stores"] if s["name"].startswith("video")]
    print(f"AR video, storage {storage}: latent relative error {error:.3g}, K/V {store['kv_error']['relative']:.3g}")
    assert 0 < error < 0.05 and 0 < store["kv_error"]["relative"] < 0.05
