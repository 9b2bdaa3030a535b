"""The fences of the store and its tiers, each shown necessary on `SimCuda` (a CPU model of CUDA ordering).

Every test here fails, with wrong data or a recorded violation, when the fence it is named after is removed;
on the plain CPU path all of them would pass regardless. See `simcuda.py` for what the model does.
"""

import gc

import os

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.tiers.file import fileread as file_tier

from ordering_helpers import read_back
from store_helpers import make_layers, put_all

ASYNC = ["ram_async", "file_async"]


def config(mode, tmp_path, depth=1):
    return OffloadConfig(mode=mode, prefetch_depth=depth, file_dir=str(tmp_path) if "file" in mode else None)


def assert_exact(seen, layers):
    for key, k, v in seen:
        assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1]), f"layer {key} came back wrong"


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mode", ASYNC)
def test_a_slot_is_overwritten_only_after_the_kernels_reading_it(make_sim, mode, depth, tmp_path):
    # Guards the release fence (`SlotRing.release_current`): side copies run as early as they may, kernels lag.
    sim = make_sim("early")
    layers = make_layers(range(6), torch.float32, seed=30)
    with KVStore(config(mode, tmp_path, depth), "cpu") as store:
        put_all(store, layers)
        sim.synchronize()
        assert_exact(read_back(sim, store, list(range(6)) * 3), layers)


@pytest.mark.parametrize("mode", ["ram_sync", "ram_async", "file_sync", "file_async"])
def test_a_put_is_snapshotted_before_later_kernels_change_its_source(make_sim, mode, tmp_path):
    # Guards the wait of the side stream for the snapshot (RAM tier), and the copy on the consumer's stream.
    sim = make_sim("early")
    layers = make_layers(range(4), torch.float32, seed=31)
    with KVStore(config(mode, tmp_path) if "async" in mode else OffloadConfig(
            mode=mode, file_dir=str(tmp_path) if "file" in mode else None), "cpu") as store:
        for key, (k, v) in layers.items():
            source_k, source_v = k.clone(), v.clone()
            store.put(key, source_k, source_v)
            sim.launch(lambda k, v: (k.mul_(3), v.zero_()), source_k, source_v)  # the producer goes on
        assert_exact(read_back(sim, store, list(range(4)) * 2), layers)


@pytest.mark.parametrize("depth", [1, 3])
def test_offloading_keeps_at_most_depth_plus_one_snapshots_on_the_device(make_sim, depth):
    # Guards the snapshot bound of the RAM tier: side copies run late, so unbounded snapshots pile up.
    sim = make_sim("late")
    layers = make_layers(range(12), torch.float32, seed=32)
    with KVStore(OffloadConfig(mode="ram_async", prefetch_depth=depth), "cpu") as store:
        put_all(store, layers)
        one = store._layers.layouts[0].data_bytes
        assert sim.peak_held_bytes <= (depth + 2) * one  # the new snapshot + depth + 1 in flight
        assert_exact(read_back(sim, store, range(12)), layers)


@pytest.mark.parametrize("mode", ASYNC)
def test_closing_right_after_the_puts_waits_for_the_offloads(make_sim, mode, tmp_path):
    # Guards the drain before freeing in `_close_tier`: copies into host buffers still queued at close.
    sim = make_sim("late")
    store = KVStore(config(mode, tmp_path, 3), "cpu")
    put_all(store, make_layers(range(6), torch.float32, seed=33))
    store.close()
    sim.synchronize()
    assert sim.violations == []


def test_a_store_dropped_without_close_still_frees_after_its_copies(make_sim):
    sim = make_sim("late")
    store = KVStore(OffloadConfig(mode="ram_async", prefetch_depth=2), "cpu")
    put_all(store, make_layers(range(4), torch.float32, seed=34))
    del store
    gc.collect()
    sim.synchronize()
    assert sim.violations == []


@pytest.mark.parametrize("mode", ASYNC)
def test_a_slot_grows_only_after_the_copy_into_it_finished(make_sim, mode, tmp_path):
    # Guards the settle before a slot grows: its old buffer is still the target of a queued prefetch.
    sim = make_sim("late")
    gen = torch.Generator().manual_seed(35)
    layers = {i: (torch.randn(1, 2, 8 + 40 * i, 16, generator=gen), torch.randn(1, 2, 8 + 40 * i, 16, generator=gen))
              for i in range(6)}  # each layer bigger than the one before: every reuse grows a slot
    with KVStore(config(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        seen = read_back(sim, store, [0, 3, 4, 5, 1, 2])  # a jump: the prefetch of 1 is dropped unread
        assert sim.violations == []
        assert_exact(seen, layers)


@pytest.mark.parametrize("mode", ASYNC)
def test_a_new_slot_waits_for_the_kernels_still_using_its_memory(make_sim, mode, tmp_path):
    # Guards the release fence of a freshly allocated slot: the allocator hands out memory the consumer just
    # freed while its kernels using it are still queued; the first copy into the slot must wait for them.
    sim = make_sim("early")
    layers = make_layers(range(3), torch.float32, seed=38)
    with KVStore(config(mode, tmp_path), "cpu") as store:
        put_all(store, layers)
        sim.synchronize()
        scratch, seen = sim.empty(store._layers.layouts[0].data_bytes), []
        sim.launch(lambda t: t.fill_(7), scratch)  # the consumer's own work on its own buffer...
        sim.launch(lambda t: seen.append(t.clone()), scratch)
        del scratch  # ...which it frees at once, as PyTorch code does, its kernels still queued
        assert_exact(read_back(sim, store, [0, 1, 2]), layers)
        assert bool((seen[0] == 7).all()), "a copy into a new slot overwrote memory the consumer still used"


def test_an_interrupted_prefetch_breaks_the_store_and_close_waits_for_its_copy(make_sim):
    # A Ctrl-C after a copy into a slot was queued, before it is recorded: nothing is served after it, and close
    # frees the slot only once the copy ran (the sim records a copy into freed memory as a violation).
    sim = make_sim("early")
    layers = make_layers(range(6), torch.float32, seed=36)
    with KVStore(OffloadConfig(mode="ram_async"), "cpu") as store:
        put_all(store, layers)
        read_back(sim, store, range(6))  # the order is learned; layer 0 is prefetched for the next step
        read_back(sim, store, [0, 1])  # layer 2 is in flight now
        target = store._res.ring.holding(2).buffer.data_ptr()

        def interrupt(stream, dst, src):
            if dst.data_ptr() == target:  # the prefetch of layer 4 into the slot that holds layer 2
                sim.on_copy = None
                raise KeyboardInterrupt

        sim.on_copy = interrupt
        with pytest.raises(KeyboardInterrupt):
            store.get(3)
        with pytest.raises(RuntimeError, match="is broken: an earlier get .KeyboardInterrupt."):
            store.get(2)


def test_a_failed_read_breaks_the_store_until_closed(tmp_path, monkeypatch):
    layers = make_layers(range(4), torch.float32, seed=37)
    real, failures = file_tier.open_checked, []

    def flaky_read(path, *args):
        if path.endswith("layer-00002.safetensors") and not failures:
            failures.append(path)
            raise OSError(5, "Input/output error (transient)", path)
        return real(path, *args)

    monkeypatch.setattr(file_tier, "open_checked", flaky_read)
    with KVStore(config("file_async", tmp_path), "cpu") as store:
        put_all(store, layers)
        store.get(0)
        store.get(1)  # prefetches layer 2: that read fails
        with pytest.raises(OSError, match="transient"):
            store.get(2)
        for call in (lambda: store.get(2), lambda: store.get(3), store.flush, store.park):
            with pytest.raises(RuntimeError, match=r"is broken: an earlier get \(OSError\) stopped part-way"):
                call()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("differ", [False, True], ids=["rows_equal", "rows_differ"])
def test_the_dedup_check_reads_rows_only_once_the_kernels_writing_them_ran(make_sim, differ):
    # Guards `devices.wait_for_device` in `RowDedup._check`: the comparison reads the rows on the host, and the
    # producer's kernels that write them are still queued (the consumer's stream lags in this schedule).
    sim = make_sim("early")
    row = torch.randn(1, 5, 2, 8)
    with KVStore(OffloadConfig(mode="ram_sync"), "cpu") as store:
        k, v = torch.zeros(3, 5, 2, 8), torch.zeros(3, 5, 2, 8)
        sim.launch(lambda k, v: (k.copy_(row.expand_as(k)), v.copy_(row.expand_as(v)),
                                 k[2].add_(1.0) if differ else None), k, v)
        store.put(0, k, v)
        sim.synchronize()
        want = (row.expand(3, 5, 2, 8).clone(), row.expand(3, 5, 2, 8).clone())
        if differ:
            want[0][2].add_(1.0)
        got = read_back(sim, store, [0])
        assert torch.equal(got[0][1], want[0]) and torch.equal(got[0][2], want[1])
        assert store.stats()["dedup"]["layers"] == (0 if differ else 1)

