"""The node's placement and storage inputs, through the pack's patches on in-process tiny models."""

import logging

import pytest
import torch

from kv_offload_pack.nodes import inputs as inputs_mod
from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.families.cache_dtype import storage_for_qwen21
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.families.qwen21 import OPTIONS_KEY
from kv_offload_pack.offload_core import HostServices, OffloadConfig
from kv_offload_pack.offload_core.places import MiB

from nodes_tiny import FakePatcher, TinyDiT, sample
from patch_helpers import Spy, inputs
from qwen21_tiny import Tiny21

LAYER = 8192  # one tiny layer (K and V each on a 4 KiB boundary)
PLANS = {
    "device+ram": {"mode": "ram_async", "device_budget": LAYER},
    "device+file": {"mode": "file_async", "device_budget": 2 * LAYER},
    "ram+file": {"mode": "ram_sync", "host_budget": LAYER},
    "device+ram+file": {"mode": "ram_async", "device_budget": LAYER, "host_budget": LAYER},
}


def run_config(config, tmp_path, cfg=None, batched=True):
    dm = TinyDiT()
    host = HostServices(temp_dir=lambda: str(tmp_path))
    patched, _ = apply_offload(FakePatcher(dm), config, host=lambda patcher: host, store_factory=Spy)
    noise, refs, txts = inputs(0, cfg is not None)
    return sample(dm, patched.options(), noise, refs, txts, cfg=cfg, batched=batched)


@pytest.mark.parametrize("cfg", [None, 3.0])
@pytest.mark.parametrize("plan", list(PLANS))
def test_every_lossless_plan_matches_gpu(tmp_path, plan, cfg):
    Spy.made.clear()
    reference = run_config(OffloadConfig(mode="gpu"), tmp_path, cfg)
    Spy.made.clear()
    out = run_config(OffloadConfig(**PLANS[plan]), tmp_path, cfg)  # files under the host temp dir
    assert torch.equal(out, reference)
    assert Spy.made and all(s.closed for s in Spy.made)
    for store in Spy.made:  # the plan really mixed the places its name says
        used = {place for place, n in store.stats()["plan"].items() if n}
        assert len(used) == plan.count("+") + 1, store.stats()["plan"]


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_compact_storage_stays_close_to_gpu(tmp_path, storage):
    reference = run_config(OffloadConfig(mode="gpu"), tmp_path, 3.0)
    out = run_config(config_from_inputs("ram_async", storage=storage), tmp_path, 3.0)
    assert out.dtype == reference.dtype
    assert ((out - reference).norm() / reference.norm()) < 0.05


def test_node_inputs_map_to_the_config():
    c = config_from_inputs("ram_async", 2, True, 0, vram_budget_mb=512, storage="fp8")
    assert c.device_budget == 512 * MiB and c.storage == "fp8" and c.pin_budget is None
    gpu = config_from_inputs("gpu", vram_budget_mb=512, storage="int8")  # the budget means nothing for gpu
    assert gpu.device_budget is None and gpu.storage == "int8"
    off = config_from_inputs("off", vram_budget_mb=512, storage="int8")
    assert off.device_budget is None and off.storage == "exact"
    assert config_from_inputs("auto", vram_budget_mb=0).device_budget is None  # 0: the mode decides
    msg = inputs_mod.validation_message(mode="auto", vram_budget_mb=-1)
    assert "`vram_budget_mb` must be a whole number of MiB >= 0; got -1" in msg
    assert "`storage` must be one of" in inputs_mod.validation_message(mode="auto", storage="int4")


@pytest.mark.parametrize("dtype, ours, expected, words", [
    ("int8", "exact", "int8", "dtype 'int8' -> storage 'int8'"),
    ("int4", "exact", "int8", "the nearest KV Offload has"),
    ("default", "exact", "exact", None),
    ("int4", "fp8", "fp8", "overridden by this node's storage 'fp8'"),
    ("nf4", "exact", "exact", "not one KV Offload knows"),
])
def test_qwen21_cache_dtype_is_honoured_or_mapped(dtype, ours, expected, words):
    config, note = storage_for_qwen21(OffloadConfig(mode="ram_async", storage=ours), {"dtype": dtype})
    assert config.storage == expected
    assert (note is None) if words is None else (words in note)


def test_qwen21_dtype_from_comfys_cache_node_reaches_the_stores(tmp_path, caplog):
    Spy.made.clear()
    dm = Tiny21()
    options = {"transformer_options": {OPTIONS_KEY: {"device": "auto", "dtype": "int4"}}}
    with caplog.at_level(logging.WARNING):
        patched, msg = apply_offload(FakePatcher(dm, options), config_from_inputs("ram_sync"),
                                     host=lambda p: HostServices(temp_dir=lambda: str(tmp_path)), store_factory=Spy)
    assert "int4" in msg and "storage 'int8'" in msg and "int4" in caplog.text  # said on the node and in the log
    for name, obj in patched.object_patches.items():
        setattr(dm, name.split(".", 1)[1], obj)
    noise, refs, txts = inputs(0, False)
    dm.reset_prefix_cache(True)
    try:
        sample(dm, patched.options(), noise, refs[:1], txts[:1], batched=False)
    finally:
        dm.reset_prefix_cache(False)
    assert Spy.made and all(s.config.storage == "int8" for s in Spy.made)
