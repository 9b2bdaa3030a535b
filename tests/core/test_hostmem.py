"""Host buffers: page-aligned, pinned lazily within the budget, with a visible fallback to pageable memory."""

import logging

import psutil
import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig, memory_snapshot
from offload_core.host import hostmem
from offload_core.host.hostmem import HostAllocator, PinBudget


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


def test_pinning_service_exception_is_contained_and_said_once_with_its_reason(caplog):
    def broken(tensor):
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    alloc = HostAllocator(pin=True, budget=1 << 20, pin_fn=broken, unpin_fn=lambda t: None)
    with caplog.at_level(logging.WARNING, logger="offload_core.host.hostmem"):
        bufs = [alloc.alloc(4096) for _ in range(3)]
    assert not any(b.pinned for b in bufs) and alloc.pinned_bytes == 0
    assert alloc.fallback_reason == "the pinning service raised RuntimeError: cudaErrorHostMemoryAlreadyRegistered"
    said = [r.getMessage() for r in caplog.records if "pageable memory" in r.getMessage()]
    assert len(said) == 1 and "cudaErrorHostMemoryAlreadyRegistered" in said[0]
    for b in bufs:
        alloc.free(b)


def test_two_stores_share_one_budget():
    """The two CFG branches of a run draw from one budget: what one pins, the other cannot."""
    pinner, shared = RecordingPinner(), PinBudget(3 * 4096)
    cond = HostAllocator(pin=True, pin_fn=pinner.pin, unpin_fn=pinner.unpin, shared=shared)
    uncond = HostAllocator(pin=True, pin_fn=pinner.pin, unpin_fn=pinner.unpin, shared=shared)
    a = [cond.alloc(4096) for _ in range(2)]
    b = [uncond.alloc(4096) for _ in range(2)]
    assert [x.pinned for x in a + b] == [True, True, True, False]
    assert shared.used == 3 * 4096 and shared.left == 0 and uncond.fallback_reason == "pin budget exhausted"
    cond.free(a[0])  # freed pins go back to the shared budget at once
    assert shared.used == 2 * 4096 and uncond.alloc(4096).pinned
    for buf in a[1:]:
        cond.free(buf)
    assert shared.used == 2 * 4096  # uncond's two pins


def test_a_store_cap_applies_inside_the_shared_budget():
    pinner, shared = RecordingPinner(), PinBudget(1 << 30)
    alloc = HostAllocator(pin=True, budget=4096, pin_fn=pinner.pin, unpin_fn=pinner.unpin, shared=shared)
    assert [alloc.alloc(4096).pinned for _ in range(2)] == [True, False]
    assert shared.used == 4096


def test_a_refused_pin_returns_its_reservation_to_the_shared_budget():
    shared = PinBudget(1 << 20)
    alloc = HostAllocator(pin=True, pin_fn=lambda t: False, unpin_fn=lambda t: None, shared=shared)
    assert not alloc.alloc(4096).pinned and shared.used == 0


def test_who_owns_the_budget():
    # The engine pins itself (cudaHostRegister): the process-wide budget, a quarter of the physical RAM.
    own = HostAllocator(pin=True)
    assert own.shared is hostmem.process_pin_budget() is HostAllocator(pin=True).shared
    assert own.shared.limit == psutil.virtual_memory().total // 4
    # A host pinning service (ComfyUI's pin_memory behind ensure_pin_budget) enforces its own budget: no cap added.
    hosted = HostAllocator(pin=True, pin_fn=lambda t: True, unpin_fn=lambda t: None)
    assert hosted.shared is None and hosted.budget is None
    assert hostmem.pin_room(None, host_pins=True) is None
    assert hostmem.pin_room(4096, host_pins=True) == 4096


def test_auto_sees_what_other_stores_left_of_the_process_budget(monkeypatch):
    budget = PinBudget(64 << 20)
    monkeypatch.setattr(hostmem, "_process_budget", budget)
    assert hostmem.pin_room(None, host_pins=False) == 64 << 20
    assert budget.reserve(48 << 20)
    assert hostmem.pin_room(None, host_pins=False) == 16 << 20
    assert hostmem.pin_room(8 << 20, host_pins=False) == 8 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("hosted", [False, True], ids=["engine_pins", "host_pins"])
def test_two_cuda_stores_share_one_pin_budget(monkeypatch, hosted):
    """Two real ram_async stores on CUDA (cond and uncond of a run) against one budget of 3 layers."""
    from offload_core.layout import layout_for

    k = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    layer = layout_for(k, k).data_bytes  # one host buffer per layer holds K and V
    budget = PinBudget(3 * layer)
    host = HostServices()
    if hosted:  # a host with its own budget, as ComfyUI's ensure_pin_budget + pin_memory
        def pin(t):
            if not budget.reserve(t.nbytes):
                return False
            if int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 1)) == 0:
                return True
            budget.release(t.nbytes)
            return False

        def unpin(t):
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            budget.release(t.nbytes)

        host = HostServices(pin=pin, unpin=unpin)
    else:
        monkeypatch.setattr(hostmem, "_process_budget", budget)
    stores = [KVStore(OffloadConfig(mode="ram_async"), "cuda", host=host, name=n) for n in ("cond", "uncond")]
    try:
        for i in range(2):
            for store in stores:
                store.put(i, k, k)
        stats = [s.stats() for s in stores]
        pinned = [s["bytes"]["host_pinned"] for s in stats]
        assert sum(pinned) <= 3 * layer and min(pinned) > 0, pinned
        assert stats[1]["pinned_fallback"] and not stats[0]["pinned_fallback"]
        assert all(torch.equal(s.get(1)[0], k) for s in stores)
    finally:
        for store in stores:
            store.close()
    assert budget.used == 0


def test_memory_snapshot_scopes():
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


@pytest.mark.parametrize("answer", [None, "yes", 1, torch.ones(1)], ids=["None", "str", "int", "tensor"])
def test_a_pinner_that_does_not_answer_true_or_false_is_refused(answer):
    shared = PinBudget(1 << 20)
    alloc = HostAllocator(pin=True, pin_fn=lambda t: answer, unpin_fn=lambda t: None, shared=shared)
    with pytest.raises(ValueError, match=r"HostServices: `pin` returned .*must page-lock the tensor .*return False"):
        alloc.alloc(4096)
    assert alloc.pinned_bytes == 0 and shared.used == 0  # the reservation went back


def _mapping_of(address: int) -> dict:
    """The /proc/self/smaps entry of the mapping holding `address`: its permissions and its size fields (kB)."""
    with open("/proc/self/smaps") as f:
        blocks = f.read().split("\n")
    found, fields = False, {}
    for line in blocks:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 2 and all(c in "0123456789abcdef-" for c in head[0]):
            if found:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            found = lo <= address < hi
            fields = {"perms": head[1]}
        elif found and head and head[0] == "VmFlags:":
            fields["VmFlags"] = set(head[1:])  # "hg": huge pages asked for, "nh": refused (madvise)
        elif found and head and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
            fields[head[0][:-1]] = int(head[1])
    assert found, f"no mapping holds {address:#x}"
    return fields


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


needs_thp = pytest.mark.skipif(not hostmem.HUGE_PAGES or _thp_mode() not in ("always", "madvise"),
                               reason="transparent huge pages are not offered here")


@needs_thp
def test_large_buffers_are_private_memory_in_huge_pages():
    """From 2 MiB up a buffer starts on a huge-page boundary and gets huge pages: a disk's DMA takes each
    2 MiB as one segment, where scattered 4 KiB pages made the file tiers' reads half as fast (a shared
    mapping, Python's default, is shmem and gets none)."""
    buf = hostmem.HostBuffer(16 << 20)
    try:
        assert buf.tensor.data_ptr() % hostmem.HUGE_PAGE == 0
        buf.tensor.fill_(1)
        mapping = _mapping_of(buf.tensor.data_ptr())
        assert mapping["perms"].endswith("p"), mapping  # private, not shmem
        assert "hg" in mapping["VmFlags"], mapping
        assert mapping["AnonHugePages"] >= 8 << 10, mapping  # most of its 16 MiB (the kernel may miss a page or two)
        view = buf.memory()
        assert len(view) == 16 << 20
        assert torch.frombuffer(view, dtype=torch.uint8).data_ptr() == buf.tensor.data_ptr()
        del view
    finally:
        buf.release()


@needs_thp
def test_small_pages_on_request_and_below_a_huge_page():
    """`huge=False` (the raw benchmark's comparison) keeps 4 KiB pages even where THP is "always"; a buffer
    under 2 MiB is only page-aligned and maps no more than its pages."""
    small = hostmem.HostBuffer(16 << 20, huge=False)
    tiny = hostmem.HostBuffer(100_000)
    try:
        small.tensor.fill_(1)
        mapping = _mapping_of(small.tensor.data_ptr())
        assert mapping["AnonHugePages"] == 0 and "nh" in mapping["VmFlags"], mapping
        assert tiny.tensor.data_ptr() % 4096 == 0 and len(tiny.memory()) == 25 * 4096
        # A buffer's tail past its last whole huge page keeps small pages: no huge page reaches past the buffer
        ragged = hostmem.HostBuffer((4 << 20) + 5000)
        try:
            ragged.tensor.fill_(1)
            assert "nh" in _mapping_of(ragged.tensor.data_ptr() + (4 << 20))["VmFlags"]
            assert "hg" in _mapping_of(ragged.tensor.data_ptr())["VmFlags"]
        finally:
            ragged.release()
    finally:
        small.release()
        tiny.release()
