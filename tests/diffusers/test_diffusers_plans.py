"""Mixed placements and compact storage through `enable_kv_offload(pipe, mode, **config_fields)`.

Every lossless plan (device + RAM, device + file, RAM + file, all three) gives the upstream image bit for bit,
with and without true CFG; fp8 / int8 give the model dtype back and an image close to it (PSNR measured).
"""

import numpy as np
import pytest

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

STEPS, RES = 3, 64


def _run(pipe, mode, imgs, cfg=False, **fields):
    session = enable_kv_offload(pipe, mode, **fields)
    try:
        out = models.run_pipeline(pipe, imgs, steps=STEPS, resolution=RES, cfg=cfg)
    finally:
        disable_kv_offload(pipe)
    return out, session.last_stats


def _plans(layer_bytes, tmp_path):
    """Budgets of whole layers of this pipeline's cache, so each plan really mixes its places."""
    one = layer_bytes + 2 * 4096  # K and V each start on a 4 KiB boundary where a place keeps them
    return {
        "device+ram": ("ram_async", {"device_budget": one}),
        "device+file": ("file_async", {"device_budget": one, "file_dir": str(tmp_path)}),
        "ram+file": ("ram_sync", {"host_budget": one, "file_dir": str(tmp_path)}),
        "device+ram+file": ("ram_async", {"device_budget": one, "host_budget": one, "file_dir": str(tmp_path)}),
    }


def _layer_bytes(stats):
    s = stats[0]
    return s["stored_bytes"]["device"] // s["layers"]


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_qwen21_every_lossless_plan_is_bit_exact(qwen_pipe, images, cfg, tmp_path):
    reference = models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES, cfg=cfg)
    _, gpu_stats = _run(qwen_pipe, "gpu", images[:1], cfg=cfg)
    for name, (mode, fields) in _plans(_layer_bytes(gpu_stats), tmp_path).items():
        out, stats = _run(qwen_pipe, mode, images[:1], cfg=cfg, **fields)
        assert np.array_equal(out, reference), f"plan {name} differs from the upstream cache"
        assert len(stats) == (2 if cfg else 1)
        for s in stats:
            used = {place for place, n in s["plan"].items() if n}
            assert len(used) == name.count("+") + 1, (name, s["plan"])


def test_flux2_every_lossless_plan_is_bit_exact(flux_pipe, images, tmp_path):
    reference = models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    _, gpu_stats = _run(flux_pipe, "gpu", images[:1])
    for name, (mode, fields) in _plans(_layer_bytes(gpu_stats), tmp_path).items():
        out, stats = _run(flux_pipe, mode, images[:1], **fields)
        assert np.array_equal(out, reference), f"plan {name} differs from the upstream cache"


def psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    peak = 1.0 if a.dtype.kind == "f" else 255.0
    return float("inf") if mse == 0 else 10 * np.log10(peak ** 2 / mse)


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_compact_storage_keeps_half_the_bytes_and_a_close_image(qwen_pipe, images, storage):
    reference, exact = _run(qwen_pipe, "gpu", images[:1], cfg=True)
    out, stats = _run(qwen_pipe, "gpu", images[:1], cfg=True, storage=storage)
    assert all(s["storage"] == storage for s in stats)
    kept = sum(s["stored_bytes"]["device"] for s in stats)
    assert kept <= 0.55 * sum(s["stored_bytes"]["device"] for s in exact)  # fp32 model: about a quarter
    assert out.shape == reference.shape and psnr(out, reference) > 25
