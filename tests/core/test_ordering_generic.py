"""The file tiers' staging fences, and one stream path for every stream device, each shown on `SimCuda`.

Every store here runs its streams and events through `Streams`' device-generic path (`SimAPI` stands for
`torch.Stream` / `torch.Event` / `torch.accelerator`). The tests named after a fence fail, with wrong data or a
recorded violation, when that fence is removed; on the plain CPU path all of them would pass regardless.
"""

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.host import devices
from offload_core.host.hostmem import HostAllocator
from offload_core.tiers.file.staging import StagingPool

from ordering_helpers import read_back
from store_helpers import make_layers, put_all


def test_a_chunk_is_written_only_after_its_copy_into_the_staging_buffer(make_sim, tmp_path):
    # Guards `lease.item[1].synchronize()` in `Writer.write_chunk`: the chunk's copy into its pinned staging
    # buffer is queued on the consumer's stream, which lags here; without the wait the I/O thread writes (and
    # checksums) what the buffer held before: silent corruption, not a checksum error.
    sim = make_sim("early")
    layers = make_layers(range(3), torch.float32, seed=40)
    with KVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cpu") as store:
        put_all(store, layers)
        store.flush()
        sim.synchronize()
        for key, k, v in read_back(sim, store, range(3)):
            assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1]), f"layer {key} came back wrong"


@pytest.mark.parametrize("free", ["trim", "close"])
def test_a_staging_buffer_is_freed_only_after_the_copy_into_it(make_sim, free):
    # Guards `item[1].synchronize()` in `StagingPool.trim` and `close`. A chunk request cancelled before it ran
    # (by close, or by a failed chunk's `wait_all`) gives its buffer back with the fence of a copy still queued;
    # freeing the pinned pages under that copy is a write into unmapped memory.
    sim = make_sim("early")
    streams = devices.open_streams(torch.device("cpu"), True)
    pool = StagingPool(HostAllocator(True), 2, "write")
    item = pool.acquire(4096)
    source = torch.arange(1024, dtype=torch.float32)
    streams.copy(item[0].tensor.view(torch.float32), source, non_blocking=True)  # queued, not yet run
    pool.release(item, streams.record())
    pool.trim() if free == "trim" else pool.close(abandoned_io=False)
    sim.synchronize()
    assert sim.violations == []


@pytest.mark.parametrize("device", ["cuda", "xpu"])
@pytest.mark.parametrize("schedule", ["late", "early"])
def test_an_xpu_store_schedules_and_fences_like_cuda(make_sim, device, schedule, tmp_path, monkeypatch):
    # Streams of a `cuda` or an `xpu` device come from the one generic API: the same side stream, events and
    # waits, in the same order, and exact data on both schedules.
    sim = make_sim(schedule)
    monkeypatch.setattr(devices, "GENERIC", sim.api)
    monkeypatch.setattr(devices, "streams_factory", devices.Streams)  # the real class, not the test's subclass
    streams = devices.open_streams(torch.device(device), True)
    assert streams.streamed and streams.asynchronous and not streams.immediate
    assert streams.side is streams.side and streams.consumer() is sim.consumer
    fence = streams.record(streams.side)
    fence.make_wait(streams.consumer())
    with streams.on_side():
        assert sim.current() is streams.side
    assert [m.split(":")[1] for m in sim.api.made] == [device, device]
    assert [op[0] for op in sim.consumer.ops[-1:]] == ["wait"]
    # A whole store's schedule, named by the generic path only: the trace is the same for both devices.
    made = len(sim.api.made)
    layers = make_layers(range(4), torch.float32, seed=41)
    monkeypatch.setattr(devices, "streams_factory", sim.streams)
    with KVStore(OffloadConfig(mode="ram_async", prefetch_depth=2), "cpu") as store:
        put_all(store, layers)
        for key, k, v in read_back(sim, store, list(range(4)) * 2):
            assert torch.equal(k, layers[key][0]) and torch.equal(v, layers[key][1])
    assert len(sim.api.made) > made and {m.split(":")[0] for m in sim.api.made[made:]} == {"stream", "event"}


def test_mps_and_cpu_have_no_streams_and_run_synchronously():
    for name in ("cpu", "mps"):
        streams = devices.Streams(torch.device(name), True)
        assert not streams.streamed and not streams.asynchronous and streams.immediate
        assert streams.side is None and streams.record() is devices.DONE


@pytest.mark.parametrize("device", ["cuda", "xpu"])
def test_an_integrated_gpu_of_any_vendor_is_unified_memory(device):
    class Props:
        name, is_integrated = "Radeon 8060S", True

    reason = devices.unified_memory_reason(torch.device(device), lambda index: Props())
    assert "integrated GPU" in reason and "Radeon 8060S" in reason
    Props.is_integrated = False
    assert devices.unified_memory_reason(torch.device(device), lambda index: Props()) is None
