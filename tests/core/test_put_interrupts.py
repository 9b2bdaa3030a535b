"""Ctrl-C at every line of a store's `put`, in every mode, with batch rows kept once: the put is then retried (a
user's Ctrl-C, then the same call again) and the store ends as one that was never interrupted: the same layers in
the same places, counted once, each served exact."""

import inspect
import os

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.layers import Layers
from offload_core.ring import LayerOrder
from offload_core.store import KVStore as Store
from interrupt_lines import call_with_ctrl_c_at, lines_of, put_with_ctrl_c_at
from store_helpers import make_layers

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "mixed"]
SHAPE = (1, 4, 67, 32)  # an odd token count; 17 KiB a tensor


def doubled(layers):
    """Each layer as two identical batch rows (true CFG with one prompt): kept as one row, served as two."""
    return {key: tuple(t.expand(2, -1, -1, -1).contiguous() for t in kv) for key, kv in layers.items()}


def store_for(mode, tmp_path):
    """`mixed`: the first layers on the device, the next in RAM, the rest in files (budgets of whole layers)."""
    tmp_path.mkdir()
    fields = {"file_dir": str(tmp_path)} if mode.startswith("file") else {}
    if mode == "mixed":
        kept = 2 * 17152  # one row of K and V
        mode, fields = "ram_async", {"device_budget": 2 * kept, "host_budget": 3 * kept, "file_dir": str(tmp_path)}
    return KVStore(OffloadConfig(mode=mode, **fields), "cpu")


def kept(store):
    """Bytes each place's tier holds of layers once the store is parked (its writes done, its staging freed), and
    the host memory its allocators have given out (without a file tier, whose staging and slots come and go with
    its reads)."""
    for key in store._layers.layouts:  # a read each, as both stores' reads leave their staging alike
        store.get(key)
    store.park()
    held = {place: tier.nbytes()[place] for place, tier in store._res.tiers.items()}
    if "file" not in held:
        held["allocated"] = sum(a.pinned_bytes + a.pageable_bytes for a in (store._res.allocator, store._res.pageable))
    return held


def layer_files(store):
    tier = store._res.tiers.get("file")
    return len([n for n in os.listdir(tier.directory) if n.startswith("layer-")]) if tier is not None else 0


def _lines():
    put = inspect.unwrap(Store.put)
    return [(fn, line) for fn in (put, Layers.add, LayerOrder.add) for line in lines_of(fn)]


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_at_every_line_of_a_put_then_the_retry_leaves_the_store_as_if_never_stopped(mode, tmp_path,
                                                                                          wait_until):
    lines = _lines()
    data = doubled(make_layers(range(len(lines)), torch.bfloat16, seed=5, shape=SHAPE))
    reference = store_for(mode, tmp_path / "reference")
    for key, (k, v) in data.items():
        reference.put(key, k, v)
    store, interrupted = store_for(mode, tmp_path / "interrupted"), 0
    for key, (function, line) in enumerate(lines):
        interrupted += put_with_ctrl_c_at(store, function, line, key, *data[key])
        k, v = store.get(key)
        assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1]), (function.__qualname__, line)
    assert interrupted >= 25
    assert store._layers.where == reference._layers.where  # the same places: every layer charged once
    assert set(store._order.order) <= set(data)  # never a key that was not put: the ring would prefetch it
    assert store._layers.used() == reference._layers.used()
    assert kept(store) == kept(reference)  # each layer's copy once: a repeated put's first copy freed
    wait_until(lambda: layer_files(store) == layer_files(reference))  # a file replaced goes on the write lane
    for key in reversed(list(data)):
        k, v = store.get(key)
        assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1]), key
    if mode == "mixed":
        assert set(store._layers.where.values()) == {"device", "host_pageable", "file"}  # a CPU pins nothing
    store.close()
    reference.close()


def _stopped_lines():
    """Every line of `Layers.add` (the layer is not put until its last), then the line after it (put, not yet
    in the prefetch order)."""
    return [(Layers.add, line) for line in lines_of(Layers.add)] + [(LayerOrder.add, lines_of(LayerOrder.add)[-1])]


@pytest.mark.parametrize("mode", MODES)
def test_a_put_stopped_by_ctrl_c_and_never_retried_is_never_prefetched_or_counted_half(mode, tmp_path, wait_until):
    """The caller goes on without retrying. Stopped before the layout was recorded, the layer is not there: the
    others are served exact (the ring never prefetches the missing one), the budgets and stats count only them,
    and once parked the store holds nothing of it. Stopped just after, the layer is whole, only not yet in the
    prefetch order: it is served exact too. (`mixed` sends the stopped layer to the device.)"""
    data, stopped = doubled(make_layers(range(4), torch.bfloat16, seed=6, shape=SHAPE)), 0
    for n, (function, line) in enumerate(_stopped_lines()):
        store = store_for(mode, tmp_path / f"stopped{n}")
        store.put(0, *data[0])
        if not call_with_ctrl_c_at(function, line, lambda: store.put(1, *data[1])):
            store.close()
            continue  # a line this put does not run (the other branch of an `if`)
        stopped += 1
        for key in (2, 3):
            store.put(key, *data[key])
        put = [key for key in data if key in store._layers.layouts]
        assert put == ([0, 1, 2, 3] if function is LayerOrder.add else [0, 2, 3])
        for _ in range(2):  # a pass in the order of the puts, then one in the order the first pass set
            for key in put:
                k, v = store.get(key)
                assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1]), (line, key)
        reference = store_for(mode, tmp_path / f"reference{n}")
        for key in put:
            reference.put(key, *data[key])
        assert store._layers.used() == reference._layers.used(), line
        for figure in ("plan", "reason"):  # before the park forgets the stray
            assert store.stats()[figure] == reference.stats()[figure], (line, figure)
        assert kept(store) == kept(reference), line  # parked for reuse: nothing of the stopped put kept with it
        layers = store._layers  # what the ring reads to serve: of the layers put only
        assert set(layers.where) == set(layers.kept) == set(layers.layouts) >= layers.resident, line
        for figure in ("plan", "device_bytes", "layers"):
            assert store.stats()[figure] == reference.stats()[figure], (line, figure)
        wait_until(lambda: layer_files(store) == layer_files(reference))
        store.close()
        reference.close()
    assert stopped >= 7
