"""What the node does with inputs it cannot cache for: unknown models, mode `off`, linked inputs."""

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs, validation_message
from kv_offload_pack.offload_core import KVStore

from nodes_tiny import FluxKVCacheReference, FakePatcher, TinyDiT, sample
from patch_helpers import Recorder, inputs, patched_tiny, run_mode


def test_unknown_model_keeps_an_upstream_flux_kv_cache():
    ref = FluxKVCacheReference()
    upstream = FakePatcher(torch.nn.Linear(2, 2), {"transformer_options": ref.options()})
    patches = upstream.model_options["transformer_options"]["patches"]
    patches["attn1_patch"] = [type("KV_Attn_Input", (), {"__call__": lambda self, *a, **k: {}})()]
    patched, msg = apply_offload(upstream, config_from_inputs("ram_sync"), host=lambda p: None, store_factory=KVStore)
    assert "model unchanged" in msg
    assert patched.model_options == upstream.model_options


def test_a_storage_the_models_device_cannot_decode_fails_on_the_node_before_any_patch():
    upstream = FakePatcher(TinyDiT())
    upstream.load_device = torch.device("mps")  # what ComfyUI's ModelPatcher says on Apple silicon (no MPS needed)
    before = FakePatcher.clone(upstream)
    fp8 = config_from_inputs("ram_sync", storage="fp8")
    with pytest.raises(ValueError, match="`storage` 'fp8'.*mps device. Use storage='int8' there"):
        apply_offload(upstream, fp8, host=lambda p: None, store_factory=KVStore)
    assert upstream.model_options == before.model_options and upstream.wrappers == before.wrappers == {}
    patched, msg = apply_offload(upstream, config_from_inputs("ram_sync", storage="int8"), host=lambda p: None)
    assert "mode ram_sync" in msg and patched.wrappers
    upstream.load_device = torch.device("cpu")
    assert "mode ram_sync" in apply_offload(upstream, fp8, host=lambda p: None)[1]


def test_mode_off_still_brackets_the_run_for_the_readout(tmp_path):
    rec = Recorder()
    dm, patched = patched_tiny("off", tmp_path, telemetry=rec)
    noise, refs, txts = inputs(0)
    out = sample(dm, patched.options(), noise, refs, txts)
    assert rec.calls == ["start"] + ["step", "done"] * 4 + ["final"] and rec.stores == []
    assert torch.equal(out, run_mode("off", tmp_path))


def test_linked_inputs_pass_validation_and_are_checked_at_execution():
    # ComfyUI validates a linked input as None; its value only exists when the node executes
    assert validation_message(mode=None, prefetch_depth=1, bypass_page_cache=True, pin_budget_mb=0) is True
    assert validation_message(mode="file_async", prefetch_depth=None, bypass_page_cache=None,
                              pin_budget_mb=None) is True
    assert "`prefetch_depth` must be between" in validation_message(mode="ram_async", prefetch_depth=0,
                                                                    bypass_page_cache=None, pin_budget_mb=None)
    with pytest.raises(ValueError, match="`mode` must be one of"):
        config_from_inputs(None)
