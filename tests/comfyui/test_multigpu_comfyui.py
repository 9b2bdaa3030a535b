"""ComfyUI's MultiGPU CFG Split against a real ComfyUI, on two CPU devices (`cpu`, `cpu:1`; see the test nodes):
cond and uncond run in one thread per device, and the pack serves both, one store per device and cond.

The reference: ComfyUI's own FluxKVCache fails under MultiGPU CFG Split (its one cache is shared by both devices'
threads, and the second thread's RoPE no longer matches), so there is no multi-GPU graph without the pack that
caches. Every lossless mode gives exactly the latents of mode `gpu` (the cache on the device, FluxKVCache's
semantics per cond), and those differ from FluxKVCache on one device only by what the split itself changes
(cond and uncond in separate forwards: about 2e-6 here, the same with no cache at all)."""

import time

import pytest

from graph_helpers import LOSSLESS, graph, sampled
from test_integration import INTERRUPT_TIMEOUT_S, _live_stats_on_disk, stop_prompt

pytestmark = pytest.mark.comfyui

SPLIT_ATOL = 1e-5  # what splitting cond and uncond over two forwards may change (measured: 1.7e-6 without a cache)


def _latent(comfy, max_gpus=2, **kwargs):
    entry = comfy.run(graph(cfg=2.0, max_gpus=max_gpus, **kwargs))
    assert sampled(entry), "KSampler was served from the execution cache"
    return comfy.latent(entry)


@pytest.mark.parametrize("model", ["flux2", "qwen_image"])
def test_every_lossless_mode_under_multigpu_cfg_split_is_exact_and_serves_both_devices(comfy, model):
    one_device = _latent(comfy, model=model, flux_kv="only", seed=61, max_gpus=0)
    log_from = len(comfy.log.read_text(errors="replace"))
    gpu = _latent(comfy, model=model, mode="gpu", seed=61)
    assert (gpu - one_device).abs().max() <= SPLIT_ATOL
    assert not gpu.equal(_latent(comfy, model=model, mode="off", seed=61)), "the cached path was never taken"
    for mode in LOSSLESS:
        assert _latent(comfy, model=model, mode=mode, seed=61).equal(gpu), f"mode {mode} differs from gpu"
        code, stats = comfy.request("GET", "/kv_offload/stats")
        assert code == 200
        stores = {s["name"]: s for s in stats["stores"]}
        assert sorted(stores) == ["cond on cpu", "uncond on cpu:1"], (mode, sorted(stores))
        for store in stores.values():  # each device's store was filled and read back, and is closed
            assert store["layers"] > 0 and store["gets"] > 0 and store["closed"], (mode, store)
        assert comfy.kv_files() == []
    log = comfy.log.read_text(errors="replace")[log_from:]
    assert "stands down" not in log and "Traceback" not in log, log


def test_an_interrupt_and_an_error_mid_run_leave_no_file_and_the_next_run_is_exact(comfy):
    long_run = graph(mode="file_async", cfg=2.0, steps=5000, size=8, seed=63, max_gpus=2)
    code, body = comfy.submit(long_run)
    assert code == 200, body
    prompt_id = body["prompt_id"]
    try:
        deadline = time.monotonic() + INTERRUPT_TIMEOUT_S
        while (stats := _live_stats_on_disk(comfy)) is None:  # both devices' stores hold files
            assert time.monotonic() < deadline, f"no store with files appeared; log:\n{comfy.tail()}"
            time.sleep(0.02)
    finally:
        stop_prompt(comfy, prompt_id)
    entry = comfy.wait(prompt_id)
    assert "execution_interrupted" in [kind for kind, _ in entry["status"]["messages"]], entry["status"]
    assert comfy.kv_files() == []
    bad = graph(mode="file_sync", cfg=2.0, seed=64, max_gpus=2)
    bad["fail"] = {"class_type": "KVOffloadTestFailAt", "inputs": {"model": bad["multigpu"]["inputs"]["model"],
                                                                     "calls": 5, "patch": "post_input"}}
    bad["multigpu"]["inputs"]["model"] = ["fail", 0]  # a later step, both devices' caches filled
    code, body = comfy.submit(bad)
    assert code == 200, body
    entry = comfy.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "error" and "test failure" in str(entry["status"]), entry["status"]["messages"][-1]
    assert comfy.kv_files() == []
    clean = _latent(comfy, mode="file_async", seed=65)
    assert clean.equal(_latent(comfy, mode="gpu", seed=65))
    assert comfy.kv_files() == []
