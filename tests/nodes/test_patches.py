"""The model patches on real tensors, driven the way ComfyUI drives them, without ComfyUI."""

import pytest
import torch

from kv_offload_pack.nodes import inputs as inputs_mod
from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.run.state import RUN_KEY
from kv_offload_pack.offload_core import HostServices, KVStore
from kv_offload_pack.offload_core.places import MiB

from nodes_tiny import FakePatcher, FluxKVCacheReference, TinyDiT, sample
from patch_helpers import Recorder, inputs, no_files, run_mode

LOSSLESS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]


def run_flux_kv_cache(seed=0, cfg=None, batched=True, device="cpu", hidden=32, heads=2, ref_tokens=5):
    dm = TinyDiT(device=device, hidden=hidden, heads=heads)
    noise, refs, txts = inputs(seed, cfg is not None, device, hidden=hidden, ref_tokens=ref_tokens)
    return sample(dm, {"transformer_options": FluxKVCacheReference().options()}, noise, refs, txts,
                  cfg=cfg, batched=batched)


@pytest.mark.parametrize("cfg", [None, 3.0])
def test_gpu_mode_matches_flux_kv_cache(tmp_path, cfg):
    ours = run_mode("gpu", tmp_path, cfg=cfg)
    assert torch.equal(ours, run_flux_kv_cache(cfg=cfg))


@pytest.mark.parametrize("cfg", [None, 3.0])
@pytest.mark.parametrize("mode", LOSSLESS)
def test_every_lossless_mode_matches_gpu(tmp_path, mode, cfg):
    assert torch.equal(run_mode(mode, tmp_path, cfg=cfg), run_mode("gpu", tmp_path, cfg=cfg))
    assert no_files(tmp_path) == []


REAL_SIZE = {"hidden": 512, "heads": 4, "ref_tokens": 1031}  # K and V of 2 MiB and 4 KiB each, per block


@pytest.mark.parametrize("mode", ["file_sync", "file_async", "ram_sync"])
def test_real_size_layers_match_flux_kv_cache(tmp_path, mode):
    # Layers over 2 MiB, not a whole number of 2 MiB: the host buffers (the file tiers' slots among them) start
    # at their first huge page inside the mapping, which a view must count from.
    reference = run_flux_kv_cache(cfg=3.0, **REAL_SIZE)
    ours = run_mode(mode, tmp_path, cfg=3.0, **REAL_SIZE)
    assert torch.equal(ours, reference)
    assert no_files(tmp_path) == []


def test_cache_changes_the_computation(tmp_path):
    # the cached path must really be taken: with refs fed back from step 1 on, results differ from recompute
    assert not torch.equal(run_mode("gpu", tmp_path), run_mode("off", tmp_path))


def test_cond_and_uncond_get_their_own_stores_batched_or_not(tmp_path):
    rec = Recorder()
    batched = run_mode("ram_sync", tmp_path, cfg=3.0, telemetry=rec)
    assert len(rec.stores) == 2 and all(s.closed for s in rec.stores)
    separate = run_mode("ram_sync", tmp_path, cfg=3.0, batched=False)
    # per-cond stores: the same numbers whether cond and uncond share a forward or not
    assert torch.allclose(batched, separate, atol=1e-5)
    assert torch.equal(separate, run_mode("gpu", tmp_path, cfg=3.0, batched=False))


def test_telemetry_brackets_the_run(tmp_path):
    rec = Recorder()
    run_mode("file_sync", tmp_path, telemetry=rec)
    assert rec.calls[0] == "start" and rec.calls[-1] == "final"
    assert rec.calls.count("step") == 4  # one per forward
    assert len(rec.stores) == 1 and rec.stores[0].closed


def test_interrupt_frees_everything_and_next_run_is_clean(tmp_path):
    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        run_mode("file_async", tmp_path, telemetry=rec, fail_at=(2, "cond-uuid"))
    assert rec.stores and all(s.closed for s in rec.stores)
    assert rec.calls[-1] == "final"
    assert no_files(tmp_path) == []
    assert torch.equal(run_mode("file_async", tmp_path), run_mode("gpu", tmp_path))


def test_interrupt_during_capture_never_serves_a_partial_cache(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_mode("ram_sync", tmp_path, fail_at=(0, "cond-uuid"))
    assert no_files(tmp_path) == []


def test_changed_reference_between_runs_is_not_served_stale(tmp_path):
    dm = TinyDiT()
    patched, _ = apply_offload(FakePatcher(dm), config_from_inputs("ram_async"), host=lambda p: HostServices(),
                               store_factory=KVStore)
    options = patched.options()  # the cached MODEL: the same patched clone serves both prompts
    noise, refs, txts = inputs(0)
    first = sample(dm, options, noise, refs, txts)
    new_refs = [r + 1.0 for r in refs]
    second = sample(dm, options, noise, new_refs, txts)
    fresh_dm = TinyDiT()
    fresh, _ = apply_offload(FakePatcher(fresh_dm), config_from_inputs("gpu"), host=lambda p: HostServices(),
                             store_factory=KVStore)
    assert not torch.equal(first, second)
    assert torch.equal(second, sample(fresh_dm, fresh.options(), noise, new_refs, txts))
    assert RUN_KEY not in options["transformer_options"]  # the run state never lands in the cached options


def test_input_model_is_left_untouched(tmp_path):
    base = FakePatcher(TinyDiT())
    patched, _ = apply_offload(base, config_from_inputs("gpu"), host=lambda p: None, store_factory=KVStore)
    assert base.model_options == {"transformer_options": {}} and base.wrappers == {}
    assert patched.wrappers["outer_sample"]["kv_offload"][0].spec.config.mode == "gpu"
    assert patched.object_patches == {"diffusion_model.default_ref_method": "index_timestep_zero"}


def test_flux_kv_cache_upstream_is_replaced_not_doubled(tmp_path):
    dm = TinyDiT()
    ref = FluxKVCacheReference()
    upstream = FakePatcher(dm, {"transformer_options": ref.options()})
    # ComfyUI's FluxKVCache installs a `KV_Attn_Input` object and a `FluxKVCache.execute.<locals>` closure
    upstream.model_options["transformer_options"]["patches"] = {
        "attn1_patch": [type("KV_Attn_Input", (), {"__call__": lambda self, *a, **k: ref.attn(*a, **k)})()],
        "post_input": [_named(ref.post_input, "FluxKVCache.execute.<locals>.model_input_patch")]}
    patched, _ = apply_offload(upstream, config_from_inputs("ram_sync"), host=lambda p: HostServices(),
                               store_factory=KVStore)
    patches = patched.model_options["transformer_options"]["patches"]
    assert len(patches["attn1_patch"]) == 1 and len(patches["post_input"]) == 1
    noise, refs, txts = inputs(0)
    assert torch.equal(sample(dm, patched.options(), noise, refs, txts), run_mode("gpu", tmp_path))
    assert ref.cache == {}  # FluxKVCache never ran: no second copy on the GPU


def test_flux_kv_cache_downstream_makes_us_stand_down(tmp_path):
    dm = TinyDiT()
    ours, _ = apply_offload(FakePatcher(dm), config_from_inputs("ram_sync"), host=lambda p: HostServices(),
                            store_factory=KVStore, telemetry=(rec := Recorder()))
    ref = FluxKVCacheReference()
    ours.set_model_attn1_patch(type("KV_Attn_Input", (), {"__call__": lambda self, *a, **k: ref.attn(*a, **k)})())
    ours.set_model_post_input_patch(_named(ref.post_input, "FluxKVCache.execute.<locals>.model_input_patch"))
    noise, refs, txts = inputs(0)
    out = sample(dm, ours.options(), noise, refs, txts)
    assert rec.stores == [] and ref.cache  # only FluxKVCache cached
    assert torch.equal(out, run_flux_kv_cache())


def test_reapplying_the_node_replaces_its_patches(tmp_path):
    dm = TinyDiT()
    once, _ = apply_offload(FakePatcher(dm), config_from_inputs("ram_sync"), host=lambda p: HostServices(),
                            store_factory=KVStore)
    twice, _ = apply_offload(once, config_from_inputs("gpu"), host=lambda p: HostServices(), store_factory=KVStore)
    patches = twice.model_options["transformer_options"]["patches"]
    assert len(patches["attn1_patch"]) == 1 and len(twice.wrappers["outer_sample"]["kv_offload"]) == 1
    noise, refs, txts = inputs(0)
    assert torch.equal(sample(dm, twice.options(), noise, refs, txts), run_mode("gpu", tmp_path))


def test_off_installs_no_cache():
    patched, msg = apply_offload(FakePatcher(TinyDiT()), config_from_inputs("off"), host=lambda p: None,
                                 store_factory=KVStore)
    assert "patches" not in patched.model_options["transformer_options"] and patched.wrappers == {}
    assert "off" in msg


def test_unknown_model_is_passed_through_with_a_message():
    patched, msg = apply_offload(FakePatcher(torch.nn.Linear(2, 2)), config_from_inputs("gpu"),
                                 host=lambda p: None, store_factory=KVStore)
    assert "model unchanged" in msg and patched.wrappers == {}


def _named(fn, qualname):
    def wrapper(*a, **k):
        return fn(*a, **k)

    wrapper.__qualname__ = qualname
    return wrapper


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "fast"}, "`mode` must be one of"),
    ({"mode": "ram_async", "prefetch_depth": 0}, "`prefetch_depth` must be between"),
    ({"mode": "file_async", "prefetch_depth": 99}, "`prefetch_depth` must be between"),
    ({"mode": "ram_async", "pin_budget_mb": -1}, "`pin_budget_mb` must be"),
])
def test_bad_inputs_give_the_engine_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config_from_inputs(**kwargs)
    assert match.strip("`") in inputs_mod.validation_message(**kwargs)


def test_options_that_do_not_apply_are_left_out():
    c = config_from_inputs("ram_sync", prefetch_depth=3, bypass_page_cache=False, pin_budget_mb=64)
    assert (c.prefetch_depth, c.bypass_page_cache, c.pin_budget) == (None, None, None)
    c = config_from_inputs("file_async", prefetch_depth=2, bypass_page_cache=False, pin_budget_mb=64)
    assert (c.prefetch_depth, c.bypass_page_cache, c.pin_budget) == (2, False, 64 * MiB)
    assert inputs_mod.validation_message(mode="gpu", prefetch_depth=1, bypass_page_cache=True, pin_budget_mb=0) is True


@pytest.mark.parametrize("mode", ["file_sync", "file_async", "ram_async"])
def test_modes_work_under_inference_mode(tmp_path, mode):
    # ComfyUI executes every node inside torch.inference_mode(); the stores' reader threads are not in it
    with torch.inference_mode():
        out = run_mode(mode, tmp_path, cfg=3.0)
    assert torch.equal(out, run_mode("gpu", tmp_path, cfg=3.0))
    assert no_files(tmp_path) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", LOSSLESS)
def test_every_mode_is_bit_exact_on_cuda(tmp_path, mode):
    # side streams, pinned buffers and the prefetch ring on a real device, under ComfyUI's inference mode
    with torch.inference_mode():
        gpu = run_mode("gpu", tmp_path, cfg=3.0, device="cuda")
        assert torch.equal(gpu, run_flux_kv_cache(cfg=3.0, device="cuda"))
        assert torch.equal(run_mode(mode, tmp_path, cfg=3.0, device="cuda"), gpu)
    assert no_files(tmp_path) == []
