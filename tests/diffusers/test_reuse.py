"""Prefix reuse in the diffusers adapter: a hit is bit-identical to a fresh request and runs no extraction pass;
every input the prefix depends on is part of the key.

The reference of every comparison is the unpatched pipeline called with the second request's inputs.
"""

import numpy as np
import pytest
import torch

from offload_core.bench import models
from offload_core.diffusers import disable_kv_offload, enable_kv_offload

from reuse_helpers import BIG, SeqLens

LOSSLESS_MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
STEPS, RES = 2, 64


def _run(pipe, images, *, steps=STEPS, resolution=RES, seed=0, cfg=False, **changes):
    args = models.call_kwargs(pipe, images, steps=steps, resolution=resolution, seed=seed, cfg=cfg)
    args.update(changes)
    if models.pipeline_kind(pipe) == "qwen21_modular":
        return pipe(**args, output="images")
    return pipe(**args).images


def _target_tokens(seen):
    return min(seen)  # cached calls see the target alone


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "true_cfg"])
@pytest.mark.parametrize("n_images", [1, 2])
def test_qwen21_hit_with_new_seed_and_steps_is_bit_identical_and_extracts_nothing(qwen_pipe, images, cfg, n_images):
    imgs = images[:n_images]
    fresh = _run(qwen_pipe, imgs, cfg=cfg, seed=1, steps=STEPS + 1)
    lens = SeqLens(qwen_pipe)
    try:
        for mode in LOSSLESS_MODES:
            session = enable_kv_offload(qwen_pipe, mode, reuse_budget=BIG, reuse="always")
            _run(qwen_pipe, imgs, cfg=cfg, seed=0)
            target = _target_tokens(lens.take())
            out = _run(qwen_pipe, imgs, cfg=cfg, seed=1, steps=STEPS + 1)
            assert np.array_equal(out, fresh), f"mode {mode}: a hit differs from a fresh request"
            assert set(lens.take()) == {target}, f"mode {mode}: an extraction pass ran on a hit"
            branches = 2 if cfg else 1
            assert [s["reuse"] for s in session.last_stats] == ["hit"] * branches
            assert session.reuse.stats()["hits"] == branches
            disable_kv_offload(qwen_pipe)
    finally:
        lens.remove()


@pytest.mark.parametrize("n_images", [1, 2])
def test_flux2_hit_with_new_prompt_and_seed_is_bit_identical_and_extracts_nothing(flux_pipe, images, n_images):
    imgs = images[:n_images]
    fresh = _run(flux_pipe, imgs, seed=1, prompt="a green tree at night")
    lens = SeqLens(flux_pipe)
    try:
        for mode in LOSSLESS_MODES:
            session = enable_kv_offload(flux_pipe, mode, reuse_budget=BIG, reuse="always")
            _run(flux_pipe, imgs, seed=0)
            target = _target_tokens(lens.take())
            out = _run(flux_pipe, imgs, seed=1, prompt="a green tree at night")
            assert np.array_equal(out, fresh), f"mode {mode}: a hit differs from a fresh request"
            assert set(lens.take()) == {target}, f"mode {mode}: an extraction pass ran on a hit"
            assert [s["reuse"] for s in session.last_stats] == ["hit"]
            disable_kv_offload(flux_pipe)
    finally:
        lens.remove()


def test_flux2_hit_at_another_output_size_is_bit_identical(flux_pipe, images):
    """The reference K/V do not depend on the target (see test_reuse_claims.py): a new size is still a hit."""
    session = enable_kv_offload(flux_pipe, "ram_sync", reuse="always")
    _run(flux_pipe, images[:1])
    out = _run(flux_pipe, images[:1], height=96, width=96, seed=3)
    assert session.reuse.stats()["hits"] == 1
    disable_kv_offload(flux_pipe)
    assert np.array_equal(out, _run(flux_pipe, images[:1], height=96, width=96, seed=3))


def test_modular_qwen21_hit_is_bit_identical(images):
    pipe = models.qwen21_modular_pipeline(guidance_scale=4.0)
    pipe.set_progress_bar_config(disable=True)
    fresh = _run(pipe, images[:1], cfg=True, seed=1)
    session = enable_kv_offload(pipe, "ram_async", reuse="always")
    _run(pipe, images[:1], cfg=True)
    assert np.array_equal(_run(pipe, images[:1], cfg=True, seed=1), fresh)
    assert session.reuse.stats()["hits"] == 2
    disable_kv_offload(pipe)


def _edited_pixel(images):
    changed = images[0].copy()
    changed.putpixel((10, 20), (255, 0, 0))
    return [changed]


def _misses(pipe, images, variants):
    """Runs the base request, then each variant; returns the variants that were (wrongly) served a hit."""
    session = enable_kv_offload(pipe, "ram_sync", reuse="always")
    _run(pipe, images[:1])
    served = []
    for name, run in variants:
        hits = session.reuse.stats()["hits"]
        run()
        if session.reuse.stats()["hits"] != hits:
            served.append(name)
    return served, session


def test_qwen21_every_key_component_changed_is_a_miss(qwen_pipe, images):
    weight = qwen_pipe.transformer.transformer_blocks[1].attn.to_k.weight

    def fused_lora():  # what a LoRA fuse does: `weight.data += delta`, unseen by the version counter
        weight.data.neg_()
        try:
            _run(qwen_pipe, images[:1])
        finally:
            weight.data.neg_()  # unfused: exactly the old weights again

    def edited_in_place():
        with torch.no_grad():
            weight.add_(0.0)
        _run(qwen_pipe, images[:1])

    served, session = _misses(qwen_pipe, images, [
        ("prompt", lambda: _run(qwen_pipe, images[:1], prompt="a green tree at night")),
        ("reference pixels", lambda: _run(qwen_pipe, _edited_pixel(images))),
        ("reference count", lambda: _run(qwen_pipe, images[:2])),
        ("target size", lambda: _run(qwen_pipe, images[:1], output_resolution=96)),
        ("fused weights", fused_lora),
        ("in-place weight edit", edited_in_place),
    ])
    assert served == []
    stats = session.reuse.stats()
    # entries made from older weights can never be hit again: dropped, not left to fill the budget
    assert stats["entries"] == 1 and stats["evictions"] >= 2
    _run(qwen_pipe, images[:1], seed=5)  # the same inputs and weights as the last request: a hit
    assert session.reuse.stats()["hits"] == stats["hits"] + 1


def test_flux2_every_key_component_changed_is_a_miss(flux_pipe, images):
    weight = flux_pipe.transformer.single_transformer_blocks[0].attn.to_qkv_mlp_proj.weight

    def fused_lora():
        weight.data.neg_()
        try:
            _run(flux_pipe, images[:1])
        finally:
            weight.data.neg_()

    served, _ = _misses(flux_pipe, images, [
        ("reference pixels", lambda: _run(flux_pipe, _edited_pixel(images))),
        ("reference count", lambda: _run(flux_pipe, images[:2])),
        ("reference order", lambda: _run(flux_pipe, images[1::-1])),
        ("fused weights", fused_lora),
    ])
    assert served == []


def test_a_dtype_change_is_a_miss(images):
    pipe = models.flux2_klein_kv_pipeline()
    session = enable_kv_offload(pipe, "ram_sync", reuse="always")
    _run(pipe, images[:1])
    pipe.to(dtype=torch.bfloat16)
    _run(pipe, images[:1])
    stats = session.reuse.stats()
    assert stats["hits"] == 0 and stats["misses"] == 2
    assert stats["entries"] == 1 and stats["evictions"] == 1  # the float32 entry can never be hit again
    disable_kv_offload(pipe)


def test_pipelines_sharing_a_transformer_keep_their_own_caches(flux_pipe, images):
    from diffusers import Flux2KleinKVPipeline

    other = Flux2KleinKVPipeline.from_pipe(flux_pipe)
    first = enable_kv_offload(flux_pipe, "ram_sync", reuse="always")
    second = enable_kv_offload(other, "file_sync", reuse="always")
    try:
        reference = _run(flux_pipe, images[:1])
        assert np.array_equal(_run(other, images[:1]), reference)
        assert (first.reuse.stats()["misses"], second.reuse.stats()["misses"]) == (1, 1)
        assert first.reuse.stats()["hits"] == second.reuse.stats()["hits"] == 0
        weight = other.transformer.transformer_blocks[0].attn.to_q.weight
        saved = weight.data.clone()
        weight.data[0, 1] += 0.5  # the other pipeline changes the shared weights (a LoRA fused through it)
        try:
            assert not np.array_equal(_run(flux_pipe, images[:1]), reference)
            assert first.reuse.stats()["hits"] == 0
        finally:
            weight.data.copy_(saved)
        assert np.array_equal(_run(flux_pipe, images[:1]), reference)  # kept again
        with torch.no_grad():
            weight.add_(0.0)  # an in-place write that changes no value: the same prefix, served exactly
        assert np.array_equal(_run(flux_pipe, images[:1]), reference)
        assert first.reuse.stats()["hits"] == 1
    finally:
        disable_kv_offload(other)
        disable_kv_offload(flux_pipe)


def test_reuse_off_never_keeps_anything(qwen_pipe, images, store_log):
    session = enable_kv_offload(qwen_pipe, "ram_sync", reuse=False)
    _run(qwen_pipe, images[:1])
    _run(qwen_pipe, images[:1])
    assert session.reuse is None and len(store_log.stores) == 2 and store_log.live == []
    assert [s["reuse"] for s in session.last_stats] == ["off"]


def test_bad_reuse_options_are_refused_before_anything_is_patched(qwen_pipe):
    before = type(qwen_pipe)
    with pytest.raises(ValueError, match="`reuse` must be True, False or 'always'.*got 'yes'"):
        enable_kv_offload(qwen_pipe, "ram_sync", reuse="yes")
    with pytest.raises(ValueError, match="`reuse_budget` only applies with reuse=True"):
        enable_kv_offload(qwen_pipe, "ram_sync", reuse=False, reuse_budget=1 << 30)
    with pytest.raises(ValueError, match="unknown place 'vram'"):
        enable_kv_offload(qwen_pipe, "ram_sync", reuse_budget={"vram": 1}, reuse="always")
    assert type(qwen_pipe) is before


def test_a_real_lora_load_fuse_unfuse_and_unload_is_never_served_stale(images):
    """With PEFT: every adapter state change is a miss, and each output is the fresh request's."""
    pytest.importorskip("peft", reason="LoRA adapters need peft (pip install peft)")
    from peft import LoraConfig

    pipe = models.flux2_klein_kv_pipeline()
    t = pipe.transformer

    session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    base = _run(pipe, images[:1])
    states = [
        ("loaded", lambda: t.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                    target_modules=["to_q", "to_k", "to_v"]), adapter_name="a")),
        ("fused", lambda: t.fuse_lora(lora_scale=1.0)),
        ("unfused", lambda: t.unfuse_lora()),
        ("fused again, then unloaded", lambda: (t.fuse_lora(lora_scale=1.0), t.unload_lora())),
    ]
    outputs = {}
    for name, change in states:
        hits = session.reuse.stats()["hits"]
        change()
        outputs[name] = _run(pipe, images[:1])
        assert session.reuse.stats()["hits"] == hits, f"{name}: served a prefix made from other weights"
        disable_kv_offload(pipe)
        assert np.array_equal(outputs[name], _run(pipe, images[:1])), f"{name}: differs from a fresh request"
        session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
        _run(pipe, images[:1])
    assert not np.array_equal(outputs["loaded"], base)
    assert not np.array_equal(outputs["fused again, then unloaded"], base)  # the fused delta stayed in the weights
    disable_kv_offload(pipe)


@pytest.mark.parametrize("which", ["qwen", "flux"])
def test_a_new_pipeline_s_first_request_is_hit_by_the_second(which, images):
    """A pipeline's first call adds diffusers' (empty) hook registry to the transformer: the key read it as an
    attribute, so the first request's entry could never be hit and held budget until evicted."""
    pipe = models.qwen21_pipeline() if which == "qwen" else models.flux2_klein_kv_pipeline()
    session = enable_kv_offload(pipe, "ram_sync", reuse_budget=BIG, reuse="always")
    def call():
        return pipe(**models.call_kwargs(pipe, images[:1], steps=2, resolution=64, seed=0, cfg=False)).images

    first = call()
    assert np.array_equal(call(), first)
    stats = session.reuse.stats()
    assert stats["hits"] == 1 and stats["entries"] == 1, stats
    disable_kv_offload(pipe)
