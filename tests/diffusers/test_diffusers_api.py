"""enable/disable: what is refused, and that disabling gives the pipeline back exactly as it was."""

import numpy as np
import pytest
import torch

from offload_core.bench import models
from offload_core.diffusers import check_diffusers_version, disable_kv_offload, enable_kv_offload

STEPS, RES = 2, 64


def _hooks(module):
    return {name: (dict(m._forward_pre_hooks), dict(m._forward_pre_hooks_with_kwargs), dict(m._forward_hooks),
                   dict(m._forward_hooks_with_kwargs))
            for name, m in module.named_modules()}


def _same(a, b) -> bool:
    # Per-call values (`_attention_kwargs`, `_current_timestep`) are rebuilt by every call: equal, not identical.
    return a is b or (not torch.is_tensor(a) and not isinstance(a, torch.nn.Module) and a == b)


def _snapshot(pipe):
    return {"class": type(pipe), "dict": dict(vars(pipe)), "vae": dict(vars(pipe.vae)),
            "transformer": dict(vars(pipe.transformer)), "hooks": _hooks(pipe.transformer)}


@pytest.mark.parametrize("which", ["qwen_pipe", "flux_pipe"])
def test_disable_restores_the_pipeline_exactly(request, which, images):
    pipe = request.getfixturevalue(which)
    before_out = models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES)
    before = _snapshot(pipe)
    enable_kv_offload(pipe, "ram_async")
    assert type(pipe) is not before["class"] and isinstance(pipe, before["class"])
    assert _hooks(pipe.transformer) != before["hooks"]
    models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES)
    disable_kv_offload(pipe)
    after = _snapshot(pipe)
    assert after["class"] is before["class"]
    for part in ("dict", "vae", "transformer"):
        assert after[part].keys() == before[part].keys(), part
        changed = [k for k in before[part] if not _same(after[part][k], before[part][k])]
        assert changed == [], part
    assert after["hooks"] == before["hooks"]
    assert np.array_equal(models.run_pipeline(pipe, images[:1], steps=STEPS, resolution=RES), before_out)
    disable_kv_offload(pipe)  # idempotent


def test_enable_twice_replaces_the_settings(qwen_pipe, store_log, images):
    enable_kv_offload(qwen_pipe, "ram_sync")
    session = enable_kv_offload(qwen_pipe, "file_sync")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    assert [s["tier"] for s in session.last_stats] == ["file_sync"]
    assert len(store_log.stores) == 1  # one hook, not two stacked
    disable_kv_offload(qwen_pipe)
    assert type(qwen_pipe).__name__ == "QwenImage21Pipeline" and not hasattr(type(qwen_pipe), "_kv_offload_base")


def test_bad_config_is_refused_before_anything_is_patched(qwen_pipe):
    before = _snapshot(qwen_pipe)
    with pytest.raises(ValueError, match="prefetch_depth"):
        enable_kv_offload(qwen_pipe, "ram_sync", prefetch_depth=2)
    with pytest.raises(ValueError, match="mode"):
        enable_kv_offload(qwen_pipe, "vram")
    with pytest.raises(TypeError):
        enable_kv_offload(qwen_pipe, "ram_sync", prefetch=2)
    assert _snapshot(qwen_pipe)["class"] is before["class"] and _hooks(qwen_pipe.transformer) == before["hooks"]


def test_unsupported_pipeline_is_refused():
    from diffusers import DiffusionPipeline

    with pytest.raises(TypeError, match="supports QwenImage21Pipeline.*got DiffusionPipeline"):
        enable_kv_offload(DiffusionPipeline(), "ram_sync")
    with pytest.raises(TypeError, match="got Module"):
        enable_kv_offload(torch.nn.Module(), "gpu")


def test_flux2_refuses_off(flux_pipe):
    with pytest.raises(ValueError, match="'off' is not available for Flux2KleinKVPipeline"):
        enable_kv_offload(flux_pipe, "off")


@pytest.mark.parametrize("version", ["0.41.0", "0.43.0.dev0", "1.0.0"])
def test_unsupported_diffusers_version_is_refused(version):
    with pytest.raises(RuntimeError, match=rf"supports diffusers 0\.42\.x.*found diffusers {version}"):
        check_diffusers_version(version)


def test_supported_diffusers_versions_pass():
    check_diffusers_version("0.42.1")
    check_diffusers_version("0.42.0.dev0")


def test_cache_objects_have_no_to_method(qwen_pipe):
    from offload_core.diffusers.flux2 import OffloadedFlux2KVCache
    from offload_core.diffusers.qwenimage21 import OffloadedQwenKVCache

    for cls in (OffloadedQwenKVCache, OffloadedFlux2KVCache):
        assert not hasattr(cls, "to"), cls


def test_an_enabled_pipeline_refuses_to_be_copied_and_is_copyable_again_after_disable(flux_pipe):
    import copy
    import pickle

    enable_kv_offload(flux_pipe, "ram_sync")
    try:
        for attempt in (pickle.dumps, copy.deepcopy, copy.copy):
            with pytest.raises(TypeError, match=r"disable_kv_offload\(pipe\) first"):
                attempt(flux_pipe)
        for attempt in (pickle.dumps, copy.deepcopy):  # the transformer alone would carry the hooks along
            with pytest.raises(TypeError, match=r"Flux2Transformer2DModel carries KV offload's hooks"):
                attempt(flux_pipe.transformer)
    finally:
        disable_kv_offload(flux_pipe)
    assert type(copy.copy(flux_pipe)) is type(flux_pipe)
    copied = copy.deepcopy(flux_pipe.transformer)
    assert _hooks(copied) == _hooks(flux_pipe.transformer) and "__deepcopy__" not in vars(copied)


@pytest.mark.parametrize("which", ["qwen_pipe", "flux_pipe"])
def test_disable_from_a_step_callback_takes_effect_when_the_call_returns(request, which, images):
    """`disable_kv_offload(pipe)` from `callback_on_step_end` broke the running call with an unrelated message
    ("KV cache has not been populated yet." / "store 'cond' is closed"): now the call finishes, exact, and the
    pipeline is given back as it was once it returns."""
    from offload_core.diffusers.pipeguard import session_of

    pipe = request.getfixturevalue(which)
    reference = models.run_pipeline(pipe, images[:1], steps=3, resolution=RES)
    before = _snapshot(pipe)
    enable_kv_offload(pipe, "ram_sync")
    seen = []

    def disable_now(pipeline, step, timestep, kwargs):
        seen.append(step)
        disable_kv_offload(pipeline)
        return {}

    args = models.call_kwargs(pipe, images[:1], steps=3, resolution=RES)
    out = pipe(**args, callback_on_step_end=disable_now).images
    assert seen == [0, 1, 2] and np.array_equal(out, reference)
    assert session_of(pipe) is None and type(pipe) is before["class"] and _hooks(pipe.transformer) == before["hooks"]


@pytest.mark.parametrize("where", ["installing the hooks", "guarding the call", "guarding the decode"])
def test_an_enable_stopped_by_ctrl_c_anywhere_gives_the_pipeline_back(qwen_pipe, images, monkeypatch, where):
    """Ctrl-C inside enable_kv_offload: the pipeline is as it was, disable is a no-op, and enable works again."""
    from offload_core.diffusers import api, pipeguard, session as session_mod

    before = _snapshot(qwen_pipe)
    target = {"installing the hooks": (api.qwenimage21, "install"),
              "guarding the call": (session_mod, "guarded_class"),
              "guarding the decode": (session_mod, "guard_decode")}[where]
    real = getattr(*target)

    def interrupted(*args, **kwargs):
        real(*args, **kwargs)  # it did its part: the Ctrl-C comes as it returns
        raise KeyboardInterrupt

    monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        enable_kv_offload(qwen_pipe, "ram_sync")
    monkeypatch.undo()
    after = _snapshot(qwen_pipe)
    assert after["class"] is before["class"] and pipeguard.SESSION_ATTR not in vars(qwen_pipe)
    assert after["hooks"] == before["hooks"] and "decode" not in vars(qwen_pipe.vae)
    disable_kv_offload(qwen_pipe)  # nothing to undo
    enable_kv_offload(qwen_pipe, "ram_sync")
    models.run_pipeline(qwen_pipe, images[:1], steps=STEPS, resolution=RES)
    disable_kv_offload(qwen_pipe)
    assert type(qwen_pipe) is before["class"]


def test_a_misspelt_option_is_refused_with_the_valid_names(qwen_pipe):
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'prefetchdepth'; the options are .*prefetch_depth"):
        enable_kv_offload(qwen_pipe, "ram_sync", prefetchdepth=2)
    assert type(qwen_pipe).__name__ == "QwenImage21Pipeline" and not hasattr(type(qwen_pipe), "_kv_offload_base")
