"""The store's contract, once for every tier: put once, get many (bit-identical), close leaves nothing."""

import contextlib
import dataclasses
import os
from unittest import mock

import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig
from offload_core.store.layers import Layers
from offload_core.layout import stacked
from offload_core.store.ring import SlotRing

from store_helpers import PLANS, TIERS, config_for, make_layers, put_all

PLACE_OF = {"device": ("device",), "ram": ("host_pinned", "host_pageable"), "file": ("file",)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def mode_of(name):
    return PLANS.get(name, {"mode": name})["mode"]


def put_then_get(store, layers, passes):
    """Puts every layer, then gets them all `passes` times in order: yields (expected k, v, got k, v)."""
    put_all(store, layers)
    for _ in range(passes):
        for key, (k, v) in layers.items():
            yield (k, v, *store.get(key))


def streamed(stats):
    return sum(n for place, n in stats["plan"].items() if place != "device")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", TIERS)
def test_round_trip_is_bit_identical_in_put_order(mode, dtype, tmp_path):
    keys = list(range(6))
    layers = make_layers(keys, dtype)
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        for key in keys:
            store.put(key, *layers[key])
        for _ in range(3):  # several denoising steps
            for key in keys:
                k, v = store.get(key)
                assert k.dtype == dtype and v.dtype == dtype
                assert k.shape == layers[key][0].shape and v.shape == layers[key][1].shape
                assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1])
        stats = store.stats()
        assert stats["tier"] == mode_of(mode)
        if mode in PLANS:  # the plan really mixed the places its name says
            for part in mode.split("+"):
                assert sum(stats["plan"][place] for place in PLACE_OF[part]) > 0, stats["plan"]


@pytest.mark.parametrize("mode", TIERS)
def test_learned_non_monotonic_order(mode, tmp_path):
    # Put in one order, consumed double blocks first, then single blocks (FLUX.2), with key tuples.
    put_order = [("single", 1), ("double", 0), ("single", 0), ("double", 1), ("single", 2)]
    use_order = [("double", 0), ("double", 1), ("single", 0), ("single", 1), ("single", 2)]
    layers = make_layers(put_order, torch.bfloat16, seed=1)
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        for key in put_order:
            store.put(key, *layers[key])
        loads_after_puts = store.stats()["transfers"]["count"]
        for step in range(4):
            if step == 2:
                loads_before = store.stats()["transfers"]["count"]
            for key in use_order:
                k, v = store.get(key)
                assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1])
        stats = store.stats()
    assert loads_after_puts == streamed(stats)  # one offload per streamed put
    # Once the order is learned, every streamed layer is loaded exactly once per step: no wasted prefetch.
    assert stats["transfers"]["count"] - loads_before == 2 * streamed(stats)


ODD_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.bool,
              *([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("mode", TIERS)
def test_any_dtype_and_strided_views_round_trip_across_chunk_boundaries(mode, dtype, layout, tmp_path, monkeypatch):
    # The file tiers copy a layer chunk by chunk (a chunk may end inside K, span K's end and the padding, or
    # start V); 4 KiB chunks put such boundaries in every layer. Strided K/V go chunk by chunk too, each chunk
    # as the few strided views that cover it.
    from offload_core.tiers.file import fileio

    monkeypatch.setattr(fileio, "CHUNK", 4096)
    gen = torch.Generator().manual_seed(4)
    layers = {}
    for key in range(4):
        k, v = (torch.randn((1, 2, 37, 24), generator=gen) * 40 for _ in range(2))
        k, v = (k > 0, v > 0) if dtype == torch.bool else (k.to(dtype), v.to(dtype))
        if layout == "strided":
            k, v = k.transpose(-1, -2), v[..., ::2]
            assert not k.is_contiguous() and not v.is_contiguous()
        layers[key] = (k, v)
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        for k, v, got_k, got_v in put_then_get(store, layers, passes=2):
            assert got_k.shape == k.shape and got_v.shape == v.shape
            assert torch.equal(got_k.view(torch.uint8), k.contiguous().view(torch.uint8))
            assert torch.equal(got_v.view(torch.uint8), v.contiguous().view(torch.uint8))


@pytest.mark.parametrize("mode", TIERS)
def test_source_mutated_after_put_does_not_reach_the_store(mode, tmp_path):
    layers = make_layers(range(3), torch.float32, seed=2)
    originals = {key: (k.clone(), v.clone()) for key, (k, v) in layers.items()}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        for key, (k, v) in layers.items():
            store.put(key, k, v)
            k.add_(1.0)
            v.zero_()
        for key in layers:
            k, v = store.get(key)
            assert torch.equal(k, originals[key][0]) and torch.equal(v, originals[key][1])


@pytest.mark.parametrize("mode", TIERS)
def test_close_leaves_no_file_and_no_buffer(mode, tmp_path):
    layers = make_layers(range(4), torch.float16, seed=3)
    store = KVStore(config_for(mode, tmp_path), "cpu")
    put_all(store, layers)
    store.get(0)
    allocators = (store._res.allocator, store._res.pageable)
    assert store.stats()["bytes"] != {"device": 0, "host_pinned": 0, "host_pageable": 0, "file": 0}
    if store.stats()["plan"]["file"]:
        assert len(os.listdir(tmp_path)) == 1  # the store's own private directory
    store.close()
    store.close()  # idempotent
    assert os.listdir(tmp_path) == []
    assert all(a.pinned_bytes == 0 and a.pageable_bytes == 0 for a in allocators)
    assert store.stats()["closed"] and store.stats()["device_bytes"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        store.get(0)


@pytest.mark.parametrize("mode", TIERS)
def test_exception_mid_request_cleans_up(mode, tmp_path):
    layers = make_layers(range(5), torch.bfloat16, seed=4)
    with pytest.raises(KeyboardInterrupt):
        with KVStore(config_for(mode, tmp_path), "cpu") as store:
            put_all(store, layers)
            store.get(0)
            store.get(1)  # a prefetch of layer 2 is in flight in the async modes
            raise KeyboardInterrupt
    assert store.closed
    assert os.listdir(tmp_path) == []
    for allocator in (store._res.allocator, store._res.pageable):
        assert allocator.pinned_bytes == 0 and allocator.pageable_bytes == 0


def test_default_file_dir_is_private_and_removed():
    with KVStore(OffloadConfig(mode="file_async"), "cpu") as store:
        store.put(0, *make_layers([0], torch.float32)[0])
        store.get(0)  # the background write is done once the read is back (one FIFO I/O thread)
        directory = store.stats()["file_dir"]
        assert os.path.isdir(directory) and os.listdir(directory)
        assert os.stat(directory).st_mode & 0o077 == 0  # private to this user
    assert not os.path.exists(directory)


@pytest.mark.parametrize("mode", ["ram_async", "file_async"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_keeps_at_most_depth_plus_one_layers_on_the_device(mode, depth, tmp_path):
    keys = list(range(18))
    layers = make_layers(keys, torch.float16, seed=5, shape=(1, 2, 8, 16))
    config = OffloadConfig(mode=mode, prefetch_depth=depth, file_dir=str(tmp_path) if "file" in mode else None)
    with KVStore(config, "cpu") as store:
        for key in keys:
            store.put(key, *layers[key])
        for _ in range(2):
            for key in keys:
                k, v = store.get(key)
                assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1])
                assert store.stats()["layers_on_device"] <= depth + 1
        stats = store.stats()
    assert stats["peak_layers_on_device"] == depth + 1  # prefetch really ran ahead, and no further
    assert stats["peak_resident_layers"] == 0  # the slots' layers are streamed, not resident
    one_layer = stats["peak_device_bytes"] // (depth + 1)
    assert one_layer < 2 * (layers[0][0].nbytes + layers[0][1].nbytes) + 8192


@pytest.mark.parametrize("mode", ["ram_sync", "file_sync"])
def test_sync_tiers_hold_one_layer_on_the_device(mode, tmp_path):
    layers = make_layers(range(8), torch.float32, seed=6)
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        for key in layers:
            store.get(key)
        assert store.stats()["peak_layers_on_device"] == 1
        assert store.stats()["resident_layers"] == 0  # a layer that only passes through a slot is not resident


def test_gpu_tier_keeps_everything_resident():
    layers = make_layers(range(8), torch.float32, seed=7)
    with KVStore(OffloadConfig(mode="gpu"), "cpu") as store:
        put_all(store, layers)
        stats = store.stats()
    assert stats["peak_resident_layers"] == stats["peak_layers_on_device"] == 8  # each layer counted once
    assert stats["peak_device_bytes"] == sum(k.nbytes + v.nbytes for k, v in layers.values())


@pytest.mark.parametrize("mode", TIERS)
def test_works_when_called_under_inference_mode(mode, tmp_path):
    # ComfyUI samples under torch.inference_mode(); the file tier's I/O thread is outside it.
    layers = make_layers(range(4), torch.bfloat16, seed=8)
    with torch.inference_mode():
        with KVStore(config_for(mode, tmp_path), "cpu") as store:
            for key, (k, v) in layers.items():
                store.put(key, k * 1, v * 1)  # inference tensors, as the model produces them there
            for _ in range(2):
                for key in layers:
                    k, v = store.get(key)
                    assert torch.equal(k, layers[key][0]) and torch.equal((k + 0).float(), layers[key][0].float())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["ram_async", "file_async"])
def test_prefetch_recovers_from_skipped_layers_and_repeated_gets(mode, tmp_path):
    # Step 0 uses every layer; later steps skip layer 2 (a branch dropping a block) and ask for layer 0 twice.
    layers = make_layers(range(6), torch.float32, seed=9, shape=(1, 1, 8, 8))
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        for key in range(6):
            store.get(key)
        for step in range(4):
            if step == 2:
                misses = store.stats()["misses"]
            for key in (0, 0, 1, 3, 4, 5):
                k, v = store.get(key)
                assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1])
        # Once the new order is learned, every layer was already in flight when asked for.
        assert store.stats()["misses"] == misses


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_a_failed_load_is_never_served_later(mode, tmp_path):
    layers = make_layers(range(4), torch.float32, seed=10)
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        store.flush()  # every write is done
        assert torch.equal(store.get(0)[0], layers[0][0])
        os.unlink(os.path.join(store.stats()["file_dir"], "layer-00002.safetensors"))
        assert torch.equal(store.get(1)[0], layers[1][0])  # prefetches layer 2 on file_async: that read fails
        with pytest.raises(Exception, match="layer-00002.safetensors"):
            store.get(2)
        for key in (2, 3):  # nothing is served after a failed get: not what the slot held before, not another layer
            with pytest.raises(RuntimeError, match="is broken: an earlier get .KVFileError. stopped part-way"):
                store.get(key)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", TIERS)
def test_layers_of_growing_and_shrinking_sizes_and_dtypes_come_back_exact(mode, tmp_path):
    """A slot grows for a bigger layer (a new buffer: nothing viewed into the old one may be served) and serves
    smaller ones and other dtypes from the same buffer."""
    gen = torch.Generator().manual_seed(7)
    shapes = [((1, 2, 5, 16), torch.float32), ((1, 2, 300, 16), torch.bfloat16), ((1, 2, 9, 16), torch.float16),
              ((1, 2, 900, 16), torch.float32), ((2, 3), torch.bfloat16)]
    layers = {i: (torch.randn(s, generator=gen).to(d), torch.randn(s, generator=gen).to(d))
              for i, (s, d) in enumerate(shapes)}
    with KVStore(config_for(mode, tmp_path), "cpu") as store:
        for k, v, got_k, got_v in put_then_get(store, layers, passes=3):
            assert got_k.dtype == k.dtype and torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize("storage", ["exact", "int8"])
@pytest.mark.parametrize("mode", TIERS)
def test_puts_and_gets_run_inside_the_hosts_pause_and_serve_a_pair_that_stacks_as_a_view(mode, storage, tmp_path):
    """A host that records each block's device allocations (ComfyUI's compiler) sees none of the store's; what a
    get serves stacks as `torch.stack([k, v], dim=1)` without a copy (Qwen-Image 2.1 takes the pair stacked)."""
    inside = []

    @contextlib.contextmanager
    def pause_graph():
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    keys = list(range(5))
    layers = make_layers(keys, torch.bfloat16, shape=(2, 37, 3, 8))  # odd token count, two identical rows below
    layers[0] = (layers[0][0][:1].expand(2, -1, -1, -1).clone(), layers[0][1][:1].expand(2, -1, -1, -1).clone())
    config = dataclasses.replace(config_for(mode, tmp_path), storage=storage)
    seen = []

    def watched(real):
        def call(*a):
            seen.append(bool(inside))
            return real(*a)
        return call

    with mock.patch.object(SlotRing, "serve", watched(SlotRing.serve)), \
            mock.patch.object(Layers, "add", watched(Layers.add)), KVStore(config, "cpu", host=HostServices(pause_graph=pause_graph)) as store:
        put_all(store, layers)
        for _ in range(2):
            for key in keys:
                k, v = store.get(key)
                both = stacked(k, v)
                assert both is not None and both.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
                assert torch.equal(both, torch.stack([k, v], dim=1))
    assert len(seen) == len(keys) * 3 and all(seen) and not inside  # every put and get
