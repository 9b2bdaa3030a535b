"""ComfyUI's multi-GPU sampling (MultiGPU CFG Split): the cond batches of a step run concurrently, one thread per
device. The pack serves every thread: one store per device and cond, made and read by that device's thread,
the latents those of the same conds on one device (FluxKVCache's semantics per cond); an interrupt in one thread closes every device's stores. A family that does not
serve threads yet stands down for the run, once, with the reason."""

import dataclasses
import logging
import threading

import pytest
import torch

from kv_offload_pack.offload_core import KVStore

from nodes_tiny import sample
from patch_helpers import Recorder, Spy, inputs, no_files, patched_tiny, run_mode

LOSSLESS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]


def one_device(tmp_path):
    """The latents of cond and uncond in separate forwards on one device, the cache on the GPU (`test_patches`
    holds that mode to FluxKVCache's)."""
    return run_mode("gpu", tmp_path, cfg=3.0, batched=False)


@pytest.mark.parametrize("mode", LOSSLESS)
def test_each_device_s_thread_gets_its_own_stores_and_the_latents_of_mode_off(mode, tmp_path, caplog):
    Spy.made.clear()
    rec = Recorder()
    dm, patched = patched_tiny(mode, tmp_path, telemetry=rec, store_factory=Spy)
    noise, refs, txts = inputs(0, cfg=True)
    with caplog.at_level(logging.WARNING):
        out = sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=True)
    assert torch.equal(out, one_device(tmp_path))
    assert not [r for r in caplog.records if "stands down" in r.message]
    assert sorted(s.name for s in Spy.made) == ["cond on cpu:0", "uncond on cpu:1"]
    for store in Spy.made:  # each did its puts and gets, all on one thread, and is closed
        assert len(store.threads["put"]) == 1 and store.threads["put"] == store.threads["get"], store.name
        assert store.closed
    assert Spy.made[0].threads["put"] != Spy.made[1].threads["put"]
    assert no_files(tmp_path) == []


def test_an_interrupt_in_one_device_s_thread_closes_every_store_and_the_next_run_is_exact(tmp_path):
    Spy.made.clear()
    dm, patched = patched_tiny("file_async", tmp_path, store_factory=Spy)
    noise, refs, txts = inputs(0, cfg=True)
    with pytest.raises(KeyboardInterrupt):
        sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=True,
               fail_at=(2, "uncond-uuid"))
    assert Spy.made and all(s.closed for s in Spy.made)
    assert no_files(tmp_path) == []
    out = sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=True)
    assert torch.equal(out, one_device(tmp_path))
    assert no_files(tmp_path) == []


def test_a_family_that_does_not_serve_threads_stands_down_once_with_the_reason(tmp_path, caplog):
    rec = Recorder()
    dm, patched = patched_tiny("ram_sync", tmp_path, telemetry=rec)
    spec = patched.wrappers["outer_sample"]["kv_offload"][0].spec
    object.__setattr__(spec, "family", dataclasses.replace(spec.family, devices=False))  # a frozen spec
    noise, refs, txts = inputs(0, cfg=True)
    with caplog.at_level(logging.WARNING):
        out = sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=True)
    assert rec.stores == []  # no store was ever made, so no cond's K/V could land in another's
    assert len([r for r in caplog.records if "multi-GPU" in r.message]) == 1
    assert torch.equal(out, run_mode("off", tmp_path, cfg=3.0, batched=False))


def _on(devices, mode, tmp_path):
    Spy.made.clear()
    dm, patched = patched_tiny(mode, tmp_path, store_factory=Spy)
    noise, refs, txts = inputs(0, cfg=True)
    return sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=devices)


def _a_copy_of_the_model_per_device(devices, tmp_path):
    reference = _on(devices, "gpu", tmp_path)
    for mode in LOSSLESS:
        assert torch.equal(_on(devices, mode, tmp_path), reference), mode
        assert sorted(str(s.device) for s in Spy.made) == sorted(str(d) for d in devices), mode
        assert all(len(s.threads["get"]) == 1 and s.closed for s in Spy.made), mode
    assert no_files(tmp_path) == []


def test_a_copy_of_the_model_per_device_as_on_real_gpus(tmp_path):
    _a_copy_of_the_model_per_device([torch.device("cpu"), torch.device("cpu")], tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (scripts/gpu_check.sh runs it)")
def test_two_cuda_devices_each_keep_their_own_stores(tmp_path):
    _a_copy_of_the_model_per_device([torch.device("cuda", 0), torch.device("cuda", 1)], tmp_path)


def test_a_stand_down_in_one_thread_leaves_the_store_another_thread_reads_until_its_forward_ends():
    from kv_offload_pack.nodes.inputs import config_from_inputs
    from kv_offload_pack.nodes.run.state import CACHED, RunState

    run = RunState(config_from_inputs("ram_sync"), None, 1, KVStore)
    run.devices = True
    key, k = ("cpu:1", "uncond-uuid"), torch.randn(1, 2, 3, 4)
    reading, stood_down, got = threading.Event(), threading.Event(), []

    def device_thread():  # fills its cond on the first forward, reads it on the second
        with torch.inference_mode():
            run.begin_forward([key], 3, 1)
            run.put(key, "layer", k, k)
            run.end_forward(True)
            assert run.begin_forward([key], 3, 1).phase == CACHED
            reading.set()
            stood_down.wait(30)
            got.append(run.get(key, "layer")[0].clone())  # its store is still open
            run.end_forward(True)

    thread = threading.Thread(target=device_thread)
    thread.start()
    assert reading.wait(30)
    store = run.branches[key].store
    run.stand_down("the disk filled up on the other device")
    assert not store.closed
    stood_down.set()
    thread.join(30)
    assert got and torch.equal(got[0], k)
    assert store.closed and key not in run.branches  # closed when its forward ended
    run.close()


def test_the_readout_shows_each_device_with_its_stores_while_the_run_goes(tmp_path):
    from kv_offload_pack.nodes.readout.telemetry import TelemetryHub

    pushed = []
    hub = TelemetryHub(send=lambda event, payload: pushed.append(payload), min_interval_s=0.0)
    dm, patched = patched_tiny("ram_sync", tmp_path, telemetry=hub)
    noise, refs, txts = inputs(0, cfg=True)
    sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=True)
    live = [p for p in pushed if p["run"]["active"] and len(p["devices"]) == 2]
    assert live, [p["devices"] for p in pushed]
    by_device = {d["device"]: d for d in live[-1]["devices"]}
    assert sorted(by_device) == ["cpu:0", "cpu:1"]
    assert by_device["cpu:0"]["stores"] == ["cond on cpu:0"] and by_device["cpu:1"]["stores"] == ["uncond on cpu:1"]
    for d in by_device.values():  # each device's bytes and waits, and its own memory figures
        assert d["bytes"]["host_pageable"] > 0 and d["memory"]["device"]["type"] == "cpu"


class _FillTogether(Spy):
    """Both devices' stores plan, then wait for each other at their second put: their fills overlap."""

    barrier = None

    def put(self, key, k, v):
        if len(self.threads["put"]) and self.stats()["layers"] == 1 and _FillTogether.barrier is not None:
            _FillTogether.barrier.wait(30)
        return super().put(key, k, v)


def test_auto_on_two_devices_never_books_the_same_free_ram_twice(tmp_path, monkeypatch):
    from kv_offload_pack.offload_core.store import kvstore as store_module
    from kv_offload_pack.nodes.apply import apply_offload
    from kv_offload_pack.nodes.inputs import config_from_inputs
    from kv_offload_pack.offload_core import HostServices
    from kv_offload_pack.offload_core.places import HOST_PLACES
    from kv_offload_pack.offload_core.store.plan import RESERVE_BYTES

    from nodes_tiny import FakePatcher, TinyDiT

    # each CPU device plans as a discrete GPU beside the host's RAM (a stand-in for two GPUs in one host)
    monkeypatch.setattr(store_module, "same_pool_reason", lambda device: None)

    def ram(stores):
        return sum(s.stats()["bytes"].get(p) or 0 for s in stores if not s.closed for p in HOST_PLACES)

    inside, overlaps, waited, someone_else = [], [], [], threading.Event()

    def free_host_memory(free_ram):  # as the OS would say; and did two stores plan at once?
        me = threading.get_ident()
        if inside and inside[-1] != me:
            overlaps.append(me)
            someone_else.set()
        inside.append(me)
        try:
            if len(inside) == 1 and not waited:
                waited.append(me)  # once a run: the other device's store plans now unless it waits its turn
                someone_else.wait(1.0)
            return free_ram - ram(list(Spy.made))
        finally:
            inside.remove(me)

    def run(free_ram):
        Spy.made.clear()
        _FillTogether.barrier = threading.Barrier(2)
        inside.clear(), overlaps.clear(), waited.clear(), someone_else.clear()
        host = HostServices(temp_dir=lambda: str(tmp_path), free_device_memory=lambda d: 0,
                            free_host_memory=lambda: free_host_memory(free_ram))
        held = []
        dm = TinyDiT()
        patched, _ = apply_offload(FakePatcher(dm), config_from_inputs("auto"), host=lambda p: host,
                                   store_factory=_FillTogether)
        noise, refs, txts = inputs(0, cfg=True)
        real_close = _FillTogether.close

        def close(self):
            counts = self.plan.counts()  # the RAM layers it planned (beside them, a file layer's staging buffer)
            held.append(sum(counts[p] for p in HOST_PLACES) * self.plan.layer_bytes)
            return real_close(self)

        _FillTogether.close = close
        try:
            out = sample(dm, patched.options(), noise, refs, txts, cfg=3.0, batched=False, multigpu=True)
        finally:
            _FillTogether.close = real_close
        return out, held

    _, held = run(RESERVE_BYTES + (1 << 40))  # room for everything: what one store plans to keep in RAM
    layer = max(held) // 4
    free = RESERVE_BYTES + int(4.8 * layer)  # auto keeps 2/3 of what is free beyond its reserve: 3 layers
    out, held = run(free)
    assert sum(held) <= free - RESERVE_BYTES, (held, layer)  # together within what was free (alone: 3 + 3)
    assert min(held) < max(held)  # the device that planned second saw what the first had booked
    assert overlaps == []  # one store planned at a time
    assert torch.equal(out, one_device(tmp_path))
