"""Every lossless mode gives the image the pipeline's own on-device cache gives, bit for bit.

The reference is the unpatched pipeline (upstream caching, no offload) with the same seed.
"""

import gc

import numpy as np
import pytest
import torch

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

LOSSLESS_MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]

STEPS, RES = 3, 64


def _offloaded(pipe, mode, imgs, **kwargs):
    session = enable_kv_offload(pipe, mode)
    try:
        out = models.run_pipeline(pipe, imgs, steps=STEPS, resolution=RES, **kwargs)
    finally:
        disable_kv_offload(pipe)
    return out, session.last_stats


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
@pytest.mark.parametrize("n_images", [1, 2])
def test_qwen21_every_lossless_mode_is_bit_exact(qwen_pipe, images, cfg, n_images):
    imgs = images[:n_images]
    reference = models.run_pipeline(qwen_pipe, imgs, steps=STEPS, resolution=RES, cfg=cfg)
    for mode in LOSSLESS_MODES:
        out, stats = _offloaded(qwen_pipe, mode, imgs, cfg=cfg)
        assert np.array_equal(out, reference), f"mode {mode} differs from the upstream cache"
        # one isolated store per branch, each holding every layer
        assert [s["name"] for s in stats] == (["cond", "uncond"] if cfg else ["cond"])
        assert all(s["layers"] == len(qwen_pipe.transformer.transformer_blocks) for s in stats)
        if mode != "auto":
            assert {s["tier"] for s in stats} == {mode}


@pytest.mark.parametrize("n_images", [1, 2])
def test_flux2_klein_kv_every_lossless_mode_is_bit_exact(flux_pipe, images, n_images):
    imgs = images[:n_images]
    reference = models.run_pipeline(flux_pipe, imgs, steps=STEPS, resolution=RES)
    blocks = len(flux_pipe.transformer.transformer_blocks) + len(flux_pipe.transformer.single_transformer_blocks)
    for mode in LOSSLESS_MODES:
        out, stats = _offloaded(flux_pipe, mode, imgs)
        assert np.array_equal(out, reference), f"mode {mode} differs from the upstream cache"
        assert len(stats) == 1 and stats[0]["layers"] == blocks
        assert stats[0]["gets"] == blocks * (STEPS - 1)


@pytest.mark.parametrize("guidance", [1.0, 4.0], ids=["no_cfg", "cfg"])
def test_qwen21_modular_every_lossless_mode_is_bit_exact(images, guidance):
    pipe = models.qwen21_modular_pipeline(guidance_scale=guidance)
    pipe.set_progress_bar_config(disable=True)
    cfg = guidance > 1
    reference = models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES, cfg=cfg)
    for mode in LOSSLESS_MODES:
        out, stats = _offloaded(pipe, mode, images[:1], cfg=cfg)
        assert np.array_equal(out, reference), f"mode {mode} differs from the upstream cache"
        assert len(stats) == (2 if cfg else 1)


def test_qwen21_off_matches_the_uncached_pipeline(qwen_pipe, store_log, images):
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    uncached = qwen_pipe(**args, use_kv_cache=False).images
    enable_kv_offload(qwen_pipe, "off")
    args = models.call_kwargs(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    off = qwen_pipe(**args).images
    assert np.array_equal(off, uncached)
    assert store_log.stores == []


@pytest.mark.slow
def test_compiled_transformer_with_offload_is_bit_exact(images):
    """Transfer code is kept out of the graph (torch.compiler.disable): dynamo traces around it, output unchanged."""
    pipe = models.qwen21_pipeline()
    reference = models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES, cfg=True)
    pipe.transformer.compile(backend="eager")  # dynamo tracing without codegen: no C++ compiler needed
    out, stats = _offloaded(pipe, "ram_async", images[:1], cfg=True)
    assert np.array_equal(out, reference)
    assert [s["layers"] for s in stats] == [3, 3]


def test_bfloat16_pipeline_every_lossless_mode_is_bit_exact(images):
    """Real checkpoints run in bf16: every tier must keep the dtype and the bits."""
    pipe = models.qwen21_pipeline(dtype=torch.bfloat16)
    reference = models.run_pipeline(pipe, images[:2], steps=STEPS, resolution=RES, cfg=True)
    for mode in LOSSLESS_MODES:
        out, stats = _offloaded(pipe, mode, images[:2], cfg=True)
        assert np.array_equal(out, reference), f"mode {mode} differs from the upstream cache in bf16"
        assert len(stats) == 2


def test_flux2_layers_missed_by_the_block_hooks_are_still_offloaded(flux_pipe, images, monkeypatch):
    """If blocks run without keyword arguments the per-block hooks see no cache; the output hook moves it all."""
    import offload_core.diffusers.flux2 as flux2_adapter

    reference = models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    monkeypatch.setattr(flux2_adapter, "_block_hook", lambda extract, key: lambda *args: None)
    out, stats = _offloaded(flux_pipe, "ram_sync", images[:1])
    blocks = len(flux_pipe.transformer.transformer_blocks) + len(flux_pipe.transformer.single_transformer_blocks)
    assert np.array_equal(out, reference) and stats[0]["layers"] == blocks


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_blocks_compiled_with_fullgraph_stay_bit_exact(which, images):
    """`compile_repeated_blocks(fullgraph=True)`: every transfer happens between blocks, never inside one."""
    pipe = models.qwen21_pipeline() if which == "qwen" else models.flux2_klein_kv_pipeline()
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
    try:
        reference = models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES)
        for mode in ("ram_sync", "file_async"):
            out, stats = _offloaded(pipe, mode, images[:1])
            assert np.array_equal(out, reference), f"mode {mode} differs under a fullgraph block compile"
            assert stats and all(s["layers"] > 0 and s["closed"] is False for s in stats)
    finally:
        # Compiled frames keep this pipeline (and the upstream run's own cache) alive; later tests count
        # live cache tensors process-wide.
        torch._dynamo.reset()
        del pipe
        gc.collect()


def test_flux2_pipelines_sharing_a_transformer(flux_pipe, images):
    """`from_pipe` shares the transformer: both pipelines enabled at once must still get their own cache."""
    from diffusers import Flux2KleinKVPipeline

    reference = models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES)
    other = Flux2KleinKVPipeline.from_pipe(flux_pipe)
    enable_kv_offload(flux_pipe, "ram_sync")
    enable_kv_offload(other, "file_sync")
    try:
        for pipe in (flux_pipe, other, flux_pipe):
            assert np.array_equal(models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES), reference)
    finally:
        disable_kv_offload(other)
        disable_kv_offload(flux_pipe)
    assert np.array_equal(models.run_pipeline(flux_pipe, images[:1], steps=STEPS, resolution=RES), reference)


REAL_SIZE = models.TinySize(layers=2, heads=8, head_dim=128, context_dim=24)  # 2.4 MiB per layer at 256²


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
def test_qwen21_real_size_layers_are_bit_exact_in_the_file_modes(cfg):
    # Layers of 2 MiB and more that are not a whole number of 2 MiB: the file tiers' host slots start inside
    # their mapping (at its first huge page), where a view counted from the mapping's start served other bytes.
    pipe = models.qwen21_pipeline(REAL_SIZE)
    pipe.set_progress_bar_config(disable=True)
    imgs = models.condition_images(1, size=256)
    reference = models.run_pipeline(pipe, imgs, steps=2, resolution=256, cfg=cfg)
    for mode in ("gpu", "file_sync", "file_async"):
        session = enable_kv_offload(pipe, mode)
        try:
            out = models.run_pipeline(pipe, imgs, steps=2, resolution=256, cfg=cfg)
        finally:
            disable_kv_offload(pipe)
        layer = session.last_stats[0]["bytes"]["file"] // REAL_SIZE.layers if mode != "gpu" else None
        assert layer is None or (layer > 2 << 20 and layer % (2 << 20)), layer
        assert np.array_equal(out, reference), f"mode {mode} differs from the upstream cache"

