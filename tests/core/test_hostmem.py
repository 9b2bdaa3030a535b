"""Host buffers: page-aligned, pinned lazily within the budget, with a visible fallback to pageable memory."""

import logging

import torch

from offload_core.hostmem import HostAllocator


class RecordingPinner:
    """Stand-in for cudaHostRegister / ComfyUI's pin_memory on a machine without CUDA; records what it pins."""

    def __init__(self, refuse_after=None):
        self.pinned, self.refuse_after = set(), refuse_after

    def pin(self, tensor):
        if self.refuse_after is not None and len(self.pinned) >= self.refuse_after:
            return False
        self.pinned.add(tensor.data_ptr())
        return True

    def unpin(self, tensor):
        self.pinned.remove(tensor.data_ptr())


def test_buffers_are_page_aligned_and_writable():
    alloc = HostAllocator(pin=False, budget=0)
    bufs = [alloc.alloc(n) for n in (1, 4095, 4096, 100_000)]
    for buf in bufs:
        assert buf.tensor.data_ptr() % 4096 == 0
        buf.tensor.fill_(7)
        assert int(buf.tensor.sum()) == 7 * buf.nbytes
    assert alloc.pageable_bytes == sum(b.nbytes for b in bufs)
    for buf in bufs:
        alloc.free(buf)
    assert alloc.pageable_bytes == 0


def test_pins_within_budget_then_falls_back_visibly(caplog):
    pinner = RecordingPinner()
    alloc = HostAllocator(pin=True, budget=3 * 4096, pin_fn=pinner.pin, unpin_fn=pinner.unpin)
    with caplog.at_level(logging.WARNING, logger="offload_core"):
        bufs = [alloc.alloc(4096) for _ in range(5)]
    assert [b.pinned for b in bufs] == [True, True, True, False, False]
    assert alloc.pinned_bytes == 3 * 4096 and alloc.pageable_bytes == 2 * 4096
    assert alloc.fallback_reason == "pin budget exhausted"
    assert len([r for r in caplog.records if "pageable memory" in r.getMessage()]) == 1  # one warning, not one per layer
    for b in bufs:
        alloc.free(b)
    assert pinner.pinned == set() and alloc.pinned_bytes == 0 and alloc.pageable_bytes == 0


def test_a_refused_pin_is_a_fallback_not_a_failure():
    pinner = RecordingPinner(refuse_after=1)
    alloc = HostAllocator(pin=True, budget=1 << 30, pin_fn=pinner.pin, unpin_fn=pinner.unpin)
    a, b = alloc.alloc(8192), alloc.alloc(8192)
    assert a.pinned and not b.pinned
    assert alloc.fallback_reason == "the pinning service refused"
    assert alloc.pinned_bytes == 8192  # the refused reservation was given back
    alloc.free(a)
    alloc.free(b)
    assert pinner.pinned == set()


def test_pinning_service_exception_is_contained():
    def broken(tensor):
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    alloc = HostAllocator(pin=True, budget=1 << 20, pin_fn=broken, unpin_fn=lambda t: None)
    buf = alloc.alloc(4096)
    assert not buf.pinned and alloc.pinned_bytes == 0
    alloc.free(buf)


def test_memory_snapshot_scopes():
    from offload_core import memory_snapshot

    snap = memory_snapshot("cpu")
    assert snap["v"] == 1
    assert set(snap) == {"v", "process", "device", "system"}
    assert snap["process"]["rss"] > 0
    assert 0 < snap["system"]["ram_available"] <= snap["system"]["ram_total"]
    assert snap["device"]["total"] is None and snap["device"]["free"] is None  # unknown, never -1
    assert all(v is None or v >= 0 for v in snap["system"].values())
    if torch.cuda.is_available():
        cuda = memory_snapshot("cuda")
        assert cuda["device"]["total"] >= cuda["device"]["free"] and "device_allocated" in cuda["process"]
