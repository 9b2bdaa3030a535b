"""Prefix reuse in the nodes: Qwen-Image 2.1 re-queued with a new seed skips its fill pass through the model's
own prefix-cache interface; an unload, another patch set or a cleared cache invalidates; FluxKVCache semantics
keep reuse off and give the same latents as with it off, run after run."""

from types import SimpleNamespace

import pytest
import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.run.reuse import FLUX_KV_REASON, REUSE
from kv_offload_pack.nodes.readout.telemetry import TelemetryHub
from kv_offload_pack.offload_core import HostServices, KVStore

from nodes_tiny import TinyDiT, sample
from qwen21_tiny import Tiny21
from reuse_nodes_helpers import Fills, Patcher, own_cache, patched, patched_with, queue


@pytest.fixture(autouse=True)
def _empty_registry():
    REUSE.reset()
    yield
    REUSE.reset()


@pytest.mark.parametrize("cfg", [None, 3.0])
@pytest.mark.parametrize("mode", ["ram_sync", "ram_async", "auto"])  # auto on a CPU: the gpu tier
def test_requeue_with_a_new_seed_skips_the_fill_pass_and_matches(mode, cfg):
    dm = Tiny21()
    m = patched(dm, mode)
    fills = Fills(dm, prefix_len=8)
    assert torch.equal(queue(dm, m, seed=0, cfg=cfg), own_cache(0, cfg))
    filled = fills.count
    assert filled == 3 * (2 if cfg else 1)  # every block ran the prefix once per cond
    for seed in (1, 2):
        assert torch.equal(queue(dm, m, seed=seed, cfg=cfg), own_cache(seed, cfg))
    assert fills.count == filled  # no fill pass on the re-queued runs
    snap = REUSE.snapshot()
    assert snap["on"] and snap["hits"] == 2 * (2 if cfg else 1) and snap["entries"] == (2 if cfg else 1)


def test_reuse_off_fills_every_run():
    dm = Tiny21()
    m = patched(dm, reuse=False)
    fills = Fills(dm, prefix_len=8)
    queue(dm, m, seed=0)
    queue(dm, m, seed=1)
    assert fills.count == 6 and len(REUSE.registry) == 0
    assert not REUSE.snapshot()["on"] and "reuse input is off" in REUSE.snapshot()["reason"]


def test_what_invalidates_a_kept_prefix():
    dm = Tiny21()
    m = patched(dm)
    fills = Fills(dm, prefix_len=8)
    queue(dm, m)
    before = fills.count
    queue(dm, m, prompt=1)  # another prompt / references
    queue(dm, m, n_img=7)  # another target size
    assert fills.count == before + 6
    dm.current_patcher = SimpleNamespace(patches_uuid="lora-a", object_patches={})  # another weight-patch set
    queue(dm, m)
    assert fills.count == before + 9
    queue(dm, m, seed=4)
    assert fills.count == before + 9  # ... which is then kept in turn
    m.detach()  # the model is unloaded
    assert len(REUSE.registry) == 0
    queue(dm, m)
    assert fills.count == before + 12
    REUSE.clear()  # a cleared cache
    queue(dm, m)
    assert fills.count == before + 15


def test_a_deleted_model_takes_its_prefixes_along():
    import gc

    dm = Tiny21()
    queue(dm, patched(dm))
    assert len(REUSE.registry) == 1
    store = REUSE.registry._lru.copy().popitem()[1].store
    del dm
    gc.collect()
    assert len(REUSE.registry) == 0 and store.closed


def test_file_modes_keep_nothing_past_the_run(tmp_path):
    dm = Tiny21()
    m = patched(dm, "file_sync", tmp_path=tmp_path)
    queue(dm, m)
    assert len(REUSE.registry) == 0 and "cache folder" in REUSE.snapshot()["last_rejection"]


def test_an_interrupted_fill_is_not_kept():
    dm = Tiny21()
    m = patched(dm)
    real = dm._attend

    def attend(i, *a):
        if i == 1:  # blocks 0 and 1 have put their K/V, block 2 never will
            raise KeyboardInterrupt("interrupted mid-fill")
        return real(i, *a)

    dm._attend = attend
    with pytest.raises(KeyboardInterrupt):
        queue(dm, m)
    assert len(REUSE.registry) == 0


def test_the_readout_payload_shows_hits_and_what_is_held():
    dm = Tiny21()
    m = patched(dm)
    queue(dm, m)
    queue(dm, m, seed=1)
    reuse = TelemetryHub(memory=lambda device=None: {}).snapshot()["reuse"]
    assert reuse["on"] and reuse["hits"] == 1 and reuse["entries"] == 1 and reuse["bytes"]["host"] > 0
    assert reuse["line"].startswith("reuse: 1 hit, 1 miss, 1 kept (")


def _flux(reuse, seed, model):
    noise = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(9)
    refs, txts = [torch.randn(1, 4, 32, generator=g)] * 2, [torch.randn(1, 3, 32, generator=g)] * 2
    m, _ = apply_offload(Patcher(model), config_from_inputs("ram_sync"), host=lambda p: None,
                         store_factory=KVStore, reuse=reuse)
    return sample(model, m.options(), noise, refs, txts, cfg=2.0)


def test_flux_kv_cache_semantics_keep_reuse_off_and_the_latents_unchanged():
    model = TinyDiT()
    for seed in (0, 1, 0):
        assert torch.equal(_flux(True, seed, model), _flux(False, seed, model))
        assert len(REUSE.registry) == 0
    _flux(True, 0, model)
    snap = REUSE.snapshot()
    assert not snap["on"] and snap["reason"] == FLUX_KV_REASON and snap["line"] == f"reuse {FLUX_KV_REASON}"


@pytest.mark.parametrize("first, second", [("int8", "exact"), ("exact", "int8"), ("fp8", "int8")])
def test_another_storage_is_a_miss_and_matches_a_fresh_run(first, second):
    dm = Tiny21()
    fills = Fills(dm, prefix_len=8)  # wraps a method of the model: before any key is taken
    fresh = queue(dm, patched_with(dm, second, reuse=False), seed=1)
    queue(dm, patched_with(dm, first), seed=0)
    assert torch.equal(queue(dm, patched_with(dm, second), seed=1), fresh)
    assert fills.count == 9 and REUSE.snapshot()["hits"] == 0


def test_comfyuis_own_cache_dtype_set_downstream_is_a_miss():
    dm = Tiny21()
    fills = Fills(dm, prefix_len=8)
    m = patched_with(dm)
    queue(dm, m, seed=0)
    m.model_options["transformer_options"]["qwen_image21_cache"] = {"dtype": "int8"}  # a cache node after ours
    queue(dm, m, seed=1)
    assert fills.count == 6 and REUSE.snapshot()["hits"] == 0


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_a_lossy_hit_equals_a_fresh_lossy_run(storage):
    dm = Tiny21()
    fresh = queue(dm, patched_with(dm, storage, reuse=False), seed=1)
    m = patched_with(dm, storage)
    assert torch.equal(queue(dm, m, seed=1), fresh)  # the fill pass attends to the decoded prefix too
    assert torch.equal(queue(dm, m, seed=1), fresh) and REUSE.snapshot()["hits"] == 1
    assert not torch.equal(fresh, own_cache(1))  # the storage is lossy: the test can tell the two apart


def test_a_weight_edited_through_data_is_a_miss():
    dm = Tiny21()
    fills = Fills(dm, prefix_len=8)
    m = patched_with(dm)
    queue(dm, m, seed=0)
    dm.qkv[0].data[-1, -1] += 0.5  # no version counter moves, no sampled element changes
    out = queue(dm, m, seed=1)
    assert fills.count == 6 and REUSE.snapshot()["hits"] == 0
    assert torch.equal(out, queue(dm, patched_with(dm, reuse=False), seed=1))


def test_an_option_the_key_cannot_read_turns_reuse_off_with_the_reason():
    dm = Tiny21()
    fills = Fills(dm, prefix_len=8)
    m = patched_with(dm)
    queue(dm, m, seed=0)
    m.model_options["transformer_options"]["optimized_attention_override"] = lambda *a, **k: None
    queue(dm, m, seed=1)
    snap = REUSE.snapshot()
    assert fills.count == 6 and snap["hits"] == 0 and "model options" in snap["refused"]
    assert "off for the last run" in snap["line"]
    del m.model_options["transformer_options"]["optimized_attention_override"]
    queue(dm, m, seed=2)
    assert fills.count == 6 and REUSE.snapshot()["hits"] == 1  # readable again: the kept prefix serves


def test_random_changes_never_get_a_stale_hit():
    from reuse_node_property import node_property_run

    counts = node_property_run(requests=60, seed=3)
    assert counts["stale"] == 0 and counts["wrong"] == 0, counts
    assert counts["hits"] >= 10 and counts["refused"] >= 1, counts


@pytest.mark.parametrize("mode", ["gpu", "ram_async", "file_sync", "file_async", "auto"])
def test_a_lossy_fill_pass_reads_the_decoded_prefix_from_every_tier(mode, tmp_path):
    """The fill pass's `take` reads each layer back from the store just after its `put`, in every tier."""
    dm = Tiny21()
    host = HostServices(temp_dir=lambda: str(tmp_path))

    def patched_in(m, reuse):
        p, _ = apply_offload(Patcher(dm), config_from_inputs(m, storage="int8"), host=lambda _: host,
                             store_factory=KVStore, reuse=reuse)
        for name, obj in p.object_patches.items():
            setattr(dm, name.split(".", 1)[1], obj)
        return p

    reference = queue(dm, patched_in("ram_sync", False), seed=1)
    assert torch.equal(queue(dm, patched_in(mode, True), seed=1), reference)


def test_an_attention_function_swapped_between_two_queued_runs_is_a_miss_and_matches(monkeypatch):
    # What attention-patching nodes do at run time: the function the model's code calls by name is another one.
    import torch.nn.functional as F

    dm = Tiny21()
    m = patched(dm)
    fills = Fills(dm, prefix_len=8)
    queue(dm, m, seed=0)
    kept = fills.count
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: sdpa(*a, **k) * 1.01)
    swapped = own_cache(1)
    assert torch.equal(queue(dm, m, seed=1), swapped) and fills.count == 2 * kept  # filled again
    monkeypatch.undo()
    assert torch.equal(queue(dm, m, seed=2), own_cache(2)) and fills.count == 2 * kept  # the first prefix again


@pytest.mark.parametrize("where", ["class method", "module function"])
def test_the_models_class_or_a_function_of_its_module_patched_between_two_queued_runs_is_a_miss(where, monkeypatch):
    # What speed-up packages do: a class-level monkeypatch of the model, or of a function its module defines.
    import qwen21_tiny

    dm = Tiny21()
    m = patched(dm)
    fills = Fills(dm, prefix_len=8)
    queue(dm, m, seed=0)
    kept = fills.count
    if where == "class method":
        qkv = Tiny21._qkv
        monkeypatch.setattr(Tiny21, "_qkv", lambda self, i, x: tuple(t * 1.01 for t in qkv(self, i, x)))
    else:
        sdpa = qwen21_tiny.F.scaled_dot_product_attention
        monkeypatch.setattr(qwen21_tiny, "F", type("F", (), {"scaled_dot_product_attention":
                                                             staticmethod(lambda *a, **k: sdpa(*a, **k) * 1.01)}))
    patched_run = own_cache(1)
    assert torch.equal(queue(dm, m, seed=1), patched_run) and fills.count == 2 * kept  # filled again
    monkeypatch.undo()
    assert torch.equal(queue(dm, m, seed=2), own_cache(2)) and fills.count == 2 * kept  # the first prefix again
