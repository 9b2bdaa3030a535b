"""Wan Animate 2 in a real ComfyUI: the pose cache served by KV Offload Settings.

A tiny random Wan Animate 2 checkpoint (tests/comfyui/make_tiny_wan_animate2.py) is loaded with `UNETLoader`;
seeded random pose latents ride the conditioning as `WanAnimate2ToVideo` would put them there. Every lossless
mode must give latents bit-identical to ComfyUI's own `WanAnimate2Cache(cpu, default)`, with and without
context windows (`standard_static`), CFG on and off; a RAM budget below the cache keeps it exact with the
overflow in files; no cache file is left after a run, an interrupt or an error.

Run: COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_PYTHON=...] pytest -m comfyui tests/comfyui/test_wan_animate2.py
"""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.comfyui

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
FRAMES = 5  # latent frames: the reference slot + 4 pose frames
_seq = iter(range(1, 1 << 30))


def wan_graph(mode=None, comfy_cache=None, windows=False, cfg=1.0, steps=3, seed=7, size=4, max_gpus=0, **kvo) -> dict:
    """UNETLoader -> [WanAnimate2Cache] -> [ContextWindowsManual] -> [KVOffloadSettings] -> [MultiGPU CFG Split]
    -> KSampler -> SaveLatent (`max_gpus` 0: no MultiGPU CFG Split)."""
    g = {"model": {"class_type": "UNETLoader",
                   "inputs": {"unet_name": "tiny_wan_animate2.safetensors", "weight_dtype": "default"}}}
    ref = ["model", 0]
    if comfy_cache is not None:
        g["wancache"] = {"class_type": "WanAnimate2Cache", "inputs": {"model": ref, "device": "cpu", "dtype": comfy_cache}}
        ref = ["wancache", 0]
    if windows:
        g["ctx"] = {"class_type": "ContextWindowsManual",
                    "inputs": {"model": ref, "context_length": 3, "context_overlap": 1,
                               "context_schedule": "standard_static", "context_stride": 1, "closed_loop": False,
                               "fuse_method": "pyramid", "dim": 2, "freenoise": False, "cond_retain_index_list": "",
                               "split_conds_to_windows": False, "latent_retain_index_list": "",
                               "causal_window_fix": True}}
        ref = ["ctx", 0]
    if mode is not None:
        g["kvo"] = {"class_type": "KVOffloadSettings",
                    "inputs": {"model": ref, "mode": mode, "prefetch_depth": 1, "bypass_page_cache": True,
                               "pin_budget_mb": 0, **kvo}}
        ref = ["kvo", 0]
    if max_gpus:
        g["multigpu"] = {"class_type": "MultiGPU_WorkUnits", "inputs": {"model": ref, "max_gpus": max_gpus}}
        ref = ["multigpu", 0]
    for name, text_seed in (("pos", 1), ("neg", 2)):
        g[f"{name}_text"] = {"class_type": "KVOffloadTestConditioning", "inputs": {"seed": text_seed, "tokens": 8, "dim": 64}}
        g[name] = {"class_type": "KVOffloadTestPoseConditioning",  # on both, as WanAnimate2ToVideo does
                   "inputs": {"conditioning": [f"{name}_text", 0], "seed": 5, "frames": FRAMES - 1, "height": size,
                              "width": size, "pose_prompt": ["pos_text", 0]}}
    g["start"] = {"class_type": "KVOffloadTestLatent",
                  "inputs": {"seed": 3, "channels": 16, "height": size, "width": size, "frames": FRAMES}}
    g["sampler"] = {"class_type": "KSampler",
                    "inputs": {"model": ref, "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
                               "scheduler": "simple", "positive": ["pos", 0], "negative": ["neg", 0],
                               "latent_image": ["start", 0], "denoise": 1.0}}
    g["save"] = {"class_type": "SaveLatent", "inputs": {"samples": ["sampler", 0], "filename_prefix": f"wan/run{next(_seq):05d}"}}
    return g


def latent(comfy, **kwargs):
    entry = comfy.run(wan_graph(**kwargs))
    cached = [n for kind, d in entry["status"].get("messages", []) if kind == "execution_cached" for n in d["nodes"]]
    assert "sampler" not in cached, "KSampler was served from the execution cache"
    return comfy.latent(entry)


def test_the_tiny_checkpoint_loads_as_wan_animate2(comfy):
    comfy.run(wan_graph(mode="ram_sync"))
    assert "mode ram_sync on wan_animate2" in comfy.log.read_text(errors="replace")


@pytest.mark.parametrize("windows", [False, True], ids=["whole", "windows"])
@pytest.mark.parametrize("cfg", [1.0, 2.0], ids=["cfg_off", "cfg_on"])
def test_every_lossless_mode_matches_comfys_cpu_cache(comfy, windows, cfg):
    theirs = latent(comfy, comfy_cache="default", windows=windows, cfg=cfg)
    for mode in MODES:
        assert latent(comfy, mode=mode, windows=windows, cfg=cfg).equal(theirs), f"mode {mode} differs"
    # ComfyUI's cache upstream of ours: ours takes its slot, same latents
    assert latent(comfy, mode="ram_async", comfy_cache="default", windows=windows, cfg=cfg).equal(theirs)
    none = latent(comfy, windows=windows, cfg=cfg)
    print(f"WanAnimate2Cache(cpu, default) vs no cache, windows={windows}, cfg={cfg}: "
          f"max |diff| {(none - theirs).abs().max().item():.3g}")
    assert comfy.kv_files() == []


def test_a_ram_budget_below_the_cache_keeps_it_exact_with_files(comfy):
    # 32 x 32 latents: 4 pose frames of 16 x 16 tokens of 256 fp32 = 1 MiB per block, 2 MiB in all
    theirs = latent(comfy, comfy_cache="default", cfg=2.0, size=32)
    assert latent(comfy, mode="ram_sync", ram_budget_mb=1, cfg=2.0, size=32).equal(theirs)
    _, stats = comfy.request("GET", "/kv_offload/stats")  # the final readout of that run
    assert [(s["name"], s["plan"]["host_pageable"], s["plan"]["file"]) for s in stats["stores"]] == [("pose 1", 1, 1)]
    assert stats["animate2_cache"]["evictions"] == 0 and stats["animate2_cache"]["fills"] == 1
    assert comfy.kv_files() == []


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_comfys_low_bit_choice_is_mapped_and_measured(comfy, dtype):
    exact = latent(comfy, comfy_cache="default", windows=True, cfg=2.0)
    ours = latent(comfy, mode="ram_sync", comfy_cache=dtype, windows=True, cfg=2.0)
    error = ((ours - exact).norm() / exact.norm()).item()
    print(f"WanAnimate2Cache dtype {dtype} -> our int8: latent relative error {error:.3g}")
    assert 0 < error < 0.05  # not dropped (exact would be 0), and small
    assert f"cache dtype '{dtype}' -> storage 'int8'" in comfy.log.read_text(errors="replace")


@pytest.mark.parametrize("max_gpus", [0, 2], ids=["one_device", "multigpu"])
def test_an_interrupted_run_leaves_no_file_then_runs_clean(comfy, max_gpus):
    code, body = comfy.submit(wan_graph(mode="file_async", windows=True, cfg=2.0, steps=5000, seed=31,
                                        max_gpus=max_gpus))
    assert code == 200, body
    prompt_id = body["prompt_id"]
    deadline = time.monotonic() + 120
    try:
        while not comfy.kv_files():  # sampling is under way, the pose cache on disk
            assert time.monotonic() < deadline, f"no cache file appeared; log:\n{comfy.tail()}"
            time.sleep(0.02)
    finally:
        comfy.request("POST", "/interrupt", {})
    entry = comfy.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    assert comfy.kv_files() == []
    assert latent(comfy, mode="file_async", windows=True, cfg=2.0, seed=32, max_gpus=max_gpus).equal(
        latent(comfy, comfy_cache=None if max_gpus else "default", windows=True, cfg=2.0, seed=32, max_gpus=max_gpus))


@pytest.mark.parametrize("max_gpus", [0, 2], ids=["one_device", "multigpu"])
def test_an_error_mid_run_leaves_no_file(comfy, max_gpus):
    bad = wan_graph(mode="file_sync", windows=True, cfg=2.0, seed=33, max_gpus=max_gpus)
    bad["fail"] = {"class_type": "KVOffloadTestFailAt", "inputs": {"model": bad["sampler"]["inputs"]["model"], "calls": 9}}
    bad["sampler"]["inputs"]["model"] = ["fail", 0]  # 2 blocks a forward: the fifth forward, with the cache filled
    code, body = comfy.submit(bad)
    assert code == 200, body
    entry = comfy.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "error" and "test failure" in str(entry["status"])
    assert comfy.kv_files() == []


@pytest.mark.parametrize("windows", [False, True], ids=["whole", "windows"])
def test_under_multigpu_cfg_split_each_device_keeps_its_own_pose_cache_and_the_latents_of_no_cache(comfy, windows):
    # The reference is the split graph without any cache. ComfyUI's own pose cache is one object shared by both
    # devices' threads there: without context windows it gives exactly that (asserted), with them the run fails.
    none = latent(comfy, windows=windows, cfg=2.0, max_gpus=2)
    if not windows:
        assert latent(comfy, comfy_cache="default", cfg=2.0, max_gpus=2).equal(none)
    log_from = len(comfy.log.read_text(errors="replace"))
    for mode in MODES:
        assert latent(comfy, mode=mode, windows=windows, cfg=2.0, max_gpus=2).equal(none), f"mode {mode} differs"
        _, stats = comfy.request("GET", "/kv_offload/stats")
        names = sorted(s["name"] for s in stats["stores"])
        assert {n.rsplit(" on ", 1)[1] for n in names} == {"cpu", "cpu:1"}, (mode, names)
        assert all(s["layers"] > 0 and s["gets"] > 0 and s["closed"] for s in stats["stores"]), mode
        assert stats["animate2_cache"]["fills"] == len(names) and stats["animate2_cache"]["hits"] > 0, mode
        assert comfy.kv_files() == []
    log = comfy.log.read_text(errors="replace")[log_from:]
    assert "stands down" not in log and "Traceback" not in log, log
