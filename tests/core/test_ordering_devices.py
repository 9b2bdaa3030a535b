"""Two devices, one store each, on `SimDevices` (a `SimCuda` per device): each store's copies, events and host
waits belong to its own device, so a consumer on device 1 reads its layers in order while device 0 is busy, as
under ComfyUI's multi-GPU sampling (one thread per device, each with its own stores).

A store that queued work on another device's streams would read stale data here: one device's synchronize never
runs the other's queue."""

import threading

import pytest
import torch

from offload_core import KVStore, OffloadConfig

from ordering_helpers import read_back
from simcuda import SimDevices
from store_helpers import make_layers, put_all

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async"]


@pytest.fixture
def two_devices(monkeypatch):
    made = []

    def make(schedule):
        made.append(SimDevices(2, schedule).install(monkeypatch))
        return made[-1]

    yield make
    for sims in made:
        for sim in sims.sims:
            sim.synchronize()
            assert sim.violations == []


@pytest.mark.parametrize("schedule", ["late", "early"])
@pytest.mark.parametrize("mode", MODES)
def test_each_device_s_store_keeps_to_its_device_s_streams_with_both_threads_at_work(two_devices, mode, schedule,
                                                                                        tmp_path):
    sims = two_devices(schedule)
    depth = {"prefetch_depth": 2} if "async" in mode else {}
    config = OffloadConfig(mode=mode, file_dir=str(tmp_path) if "file" in mode else None, **depth)
    seen, errors = {}, []
    start = threading.Barrier(2)

    def device_thread(i):
        try:
            sim = sims.sims[i]
            layers = make_layers(range(6), torch.float32, seed=40 + i)
            with KVStore(config, torch.device("cpu", i), name=f"cond on cpu:{i}") as store:
                start.wait(30)
                put_all(store, layers)
                got = read_back(sim, store, list(range(6)) * 3)
                seen[i] = all(torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1]) for key, k, v in got)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the device
            errors.append((i, exc))

    threads = [threading.Thread(target=device_thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and seen == {0: True, 1: True}, (errors, seen)
    if mode in ("ram_async", "file_async"):  # each device's side streams were made by its own store
        assert all(sim.api.made and any(m.startswith("stream:") for m in sim.api.made) for sim in sims.sims)
