"""On CUDA: a hit is bit-identical to a fresh request with real side streams, pinned memory and cuBLAS, and by
default nothing is kept in VRAM between requests."""

import numpy as np
import pytest
import torch

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, RES = 3, 128
BIG = {"device": 1 << 30, "host": 1 << 30, "file": 1 << 30}


@pytest.mark.parametrize("which", ["qwen", "flux"])
@pytest.mark.parametrize("mode", ["gpu", "ram_async", "file_async"])
def test_a_hit_is_bit_identical_on_cuda(which, mode):
    make = models.qwen21_pipeline if which == "qwen" else models.flux2_klein_kv_pipeline
    pipe = make(device="cuda", dtype=torch.bfloat16)
    images = models.condition_images(2, size=RES)
    cfg = which == "qwen"
    fresh = models.run_pipeline(pipe, images, steps=STEPS, resolution=RES, cfg=cfg, seed=1)
    session = enable_kv_offload(pipe, mode, reuse_budget=BIG, reuse="always")
    try:
        models.run_pipeline(pipe, images, steps=STEPS, resolution=RES, cfg=cfg, seed=0)
        out = models.run_pipeline(pipe, images, steps=STEPS, resolution=RES, cfg=cfg, seed=1)
        assert session.reuse.stats()["hits"] == (2 if cfg else 1)
        assert np.array_equal(out, fresh)
    finally:
        disable_kv_offload(pipe)


def test_by_default_the_device_memory_goes_back_after_each_request():
    pipe = models.qwen21_pipeline(device="cuda", dtype=torch.bfloat16)
    images = models.condition_images(1, size=RES)
    models.run_pipeline(pipe, images, steps=STEPS, resolution=RES)
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for mode in ("gpu", "ram_async"):
        session = enable_kv_offload(pipe, mode, reuse="always")
        models.run_pipeline(pipe, images, steps=STEPS, resolution=RES)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= baseline, mode
        assert session.reuse.stats()["bytes"]["device"] == 0
        disable_kv_offload(pipe)
