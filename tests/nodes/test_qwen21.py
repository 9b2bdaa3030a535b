"""Qwen-Image 2.1: our stores supplied through the model's own prefix-cache interface."""

import os

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.families.qwen21 import OPTIONS_KEY
from kv_offload_pack.offload_core import HostServices, KVStore

from nodes_tiny import FakePatcher, sample
from patch_helpers import Spy, inputs
from qwen21_tiny import Tiny21

LOSSLESS = ["ram_sync", "ram_async", "file_sync", "file_async", "auto"]


def run(mode, tmp_path, cfg=None, model_options=None):
    """mode None: the model alone, with its own cache."""
    dm = Tiny21()
    options = model_options or {"transformer_options": {}}
    if mode is not None:
        patched, _ = apply_offload(FakePatcher(dm, options), config_from_inputs(mode),
                                   host=lambda p: HostServices(temp_dir=lambda: str(tmp_path)), store_factory=Spy)
        options = patched.options()
        for name, obj in patched.object_patches.items():  # what ModelPatcher does while the model is patched
            setattr(dm, name.split(".", 1)[1], obj)
    noise, refs, txts = inputs(0, cfg)
    dm.reset_prefix_cache(True)  # ModelPatcher.pre_run on the 2.1 model
    try:
        return sample(dm, options, noise, refs, txts, cfg=cfg, batched=False), dm
    finally:
        dm.reset_prefix_cache(False)


@pytest.mark.parametrize("cfg", [None, 3.0])
def test_gpu_mode_matches_the_models_own_cache(tmp_path, cfg):
    Spy.made.clear()
    ours, dm = run("gpu", tmp_path, cfg)
    own, _ = run(None, tmp_path, cfg)
    assert torch.equal(ours, own)
    assert len(Spy.made) == (2 if cfg else 1) and all(s.closed for s in Spy.made)
    assert dm.prefix_cache is None  # the model's own cache was never used: ours served it


@pytest.mark.parametrize("cfg", [None, 3.0])
@pytest.mark.parametrize("mode", LOSSLESS)
def test_every_lossless_mode_matches_gpu(tmp_path, mode, cfg):
    assert torch.equal(run(mode, tmp_path, cfg)[0], run("gpu", tmp_path, cfg)[0])
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []


def test_no_attention_hook_so_the_model_cache_does_not_stand_down(tmp_path):
    patched, msg = apply_offload(FakePatcher(Tiny21()), config_from_inputs("ram_async"), host=lambda p: None,
                                 store_factory=KVStore)
    assert "qwen_image21" in msg
    assert "patches" not in patched.model_options["transformer_options"]
    assert list(patched.object_patches) == ["diffusion_model.select_prefix_cache"]


def test_off_turns_the_models_cache_off(tmp_path):
    Spy.made.clear()
    off, _ = run("off", tmp_path)
    recompute, _ = run(None, tmp_path, model_options={"transformer_options": {OPTIONS_KEY: {"device": "off"}}})
    assert torch.equal(off, recompute) and Spy.made == []
    # 2.1's prefix is causal, so its cache is exact by construction: the cached run gives the same numbers
    assert torch.allclose(off, run("gpu", tmp_path)[0], atol=1e-5)
    assert Spy.made and Spy.made[0].stats()["gets"] > 0


def test_interrupted_fill_is_never_served(tmp_path):
    Spy.made.clear()
    with pytest.raises(KeyboardInterrupt):
        _interrupted(tmp_path)
    assert Spy.made and all(s.closed for s in Spy.made)
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []


def _interrupted(tmp_path):
    dm = Tiny21()
    patched, _ = apply_offload(FakePatcher(dm), config_from_inputs("file_sync"),
                               host=lambda p: HostServices(temp_dir=lambda: str(tmp_path)), store_factory=Spy)
    setattr(dm, "select_prefix_cache", patched.object_patches["diffusion_model.select_prefix_cache"])
    real_attend = dm._attend

    def attend(i, *a):
        if i == 1:
            raise KeyboardInterrupt("interrupted mid-forward")
        return real_attend(i, *a)

    dm._attend = attend
    noise, refs, txts = inputs(0, None)
    sample(dm, patched.options(), noise, refs, txts)


def test_a_caching_mode_lifts_an_upstream_off(tmp_path):
    Spy.made.clear()
    upstream_off = {"transformer_options": {OPTIONS_KEY: {"device": "off", "dtype": "default"}}}
    out, _ = run("ram_sync", tmp_path, model_options=upstream_off)
    assert Spy.made and Spy.made[0].stats()["gets"] > 0
    assert torch.equal(out, run("gpu", tmp_path)[0])


@pytest.mark.parametrize("cfg", [None, 3.0])
def test_a_full_disk_during_the_fill_pass_falls_back_to_recompute(mount_tmpfs, tmp_path, cfg, caplog):
    import logging

    where = mount_tmpfs("24k")  # the lock file and one layer file fit, the next does not
    with caplog.at_level(logging.WARNING):
        ours, _ = run("file_sync", where, cfg)
    off, _ = run("off", tmp_path, cfg)
    assert torch.equal(ours, off)  # the image is made, as without a cache
    assert [r for r in caplog.records if "the cache files could not be written" in r.getMessage()]
    assert [f for _, _, fs in os.walk(where) for f in fs] == []
