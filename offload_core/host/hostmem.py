"""Page-aligned host buffers, page-locked lazily within a budget, with a visible fallback to pageable memory.

Every buffer is a private anonymous `mmap` viewed as a uint8 tensor: page-aligned, as `O_DIRECT` reads need
(torch's CPU allocator only aligns to 64 bytes), in transparent huge pages from 2 MiB up where the OS has them
(`HostBuffer`), and returned to the OS the moment it is freed — but for the file tiers' staging, whose idle
buffers wait in `SPARES` for the next capture or store (given back lazily: the OS takes them at once when it
needs the memory, else they are reused without a page fault). Pinning registers the
existing pages (`cudaHostRegister`, or the host's own `pin`, e.g. ComfyUI's budgeted `pin_memory`) one layer
at a time, never the whole cache up front; past the budget or when the driver refuses, the buffer stays
pageable and the store reports `pinned_fallback`.

The budget is one per process, shared by every store (both CFG branches of a run, several runs at once):
- with a host pinning service (`HostServices.pin`, e.g. ComfyUI's `pin_memory` behind `ensure_pin_budget`)
  the host's own budget is the one: the engine adds no cap of its own and pins until the host refuses;
- without one, the engine pins with `cudaHostRegister` within `process_pin_budget()`: a quarter of the
  physical RAM, fixed when it is first needed, shared by every store of the process.
`OffloadConfig.pin_budget` caps one store further, inside that shared budget.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import Callable, List, Optional

import psutil
import torch

from ..places import GiB

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # a transparent huge page (x86-64; arm64 with 4 KiB base pages)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
HUGE_PAGES = _MADV_HUGEPAGE is not None and hasattr(mmap, "MAP_PRIVATE")
# Private memory where the OS has it (POSIX; `mmap` adds MAP_ANONYMOUS itself for fileno -1): Python's default
# there is a shared mapping, which is memory of the in-RAM filesystem (shmem) and gets no transparent huge pages.
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


def round_up(n: int, align: int = 4096) -> int:
    return (n + align - 1) // align * align


class HostBuffer:
    """One page-aligned host allocation. `tensor` is a flat uint8 view; owned by the allocator that made it.

    From `HUGE_PAGE` up, where the OS offers transparent huge pages (Linux), the buffer starts on a huge-page
    boundary and asks for them (`MADV_HUGEPAGE`): a disk's DMA then takes each 2 MiB as one segment. With 4 KiB
    pages the physical pages of a buffer are as scattered as the machine's free memory, and a request whose
    pages are scattered goes to the disk as several requests (docs/benchmark.md, "Huge pages"). The head and
    tail of the mapping outside those pages are never touched.
    """

    __slots__ = ("tensor", "nbytes", "pinned", "_map", "_view")

    def __init__(self, nbytes: int, huge: bool = True):
        self.nbytes = nbytes
        length = max(round_up(nbytes, PAGE), PAGE)
        huge = huge and HUGE_PAGES and length >= HUGE_PAGE
        self._map = mmap.mmap(-1, length + (HUGE_PAGE if huge else 0), **_PRIVATE)
        # Through a memoryview, which the tensor's storage keeps: while any tensor of the buffer lives (a view a
        # caller still holds), `release` cannot unmap the memory under it; the mapping goes with the last one.
        whole = torch.frombuffer(memoryview(self._map), dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE if huge else 0
        try:
            if huge:  # whole huge pages inside the buffer; the rest (the buffer's tail) never gets one
                whole_pages = length // HUGE_PAGE * HUGE_PAGE
                self._map.madvise(_MADV_HUGEPAGE, start, whole_pages)
                if whole_pages < len(self._map) - start:
                    self._map.madvise(mmap.MADV_NOHUGEPAGE, start + whole_pages, len(self._map) - start - whole_pages)
            elif HUGE_PAGES:  # small pages asked for (the raw benchmark's comparison), also where THP is "always"
                self._map.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:
            pass  # a kernel without transparent huge pages: small pages either way
        self._view = (start, length)
        self.tensor = whole[start:start + nbytes] if nbytes else torch.empty(0, dtype=torch.uint8)
        self.pinned = False

    def memory(self) -> memoryview:
        """The whole page-aligned buffer (`nbytes` rounded up to a page), for system calls (O_DIRECT reads and
        writes)."""
        start, length = self._view
        return memoryview(self._map)[start:start + length]

    def lazy_free(self) -> None:
        """Lets the OS take the buffer's pages whenever it needs memory; their content is lost then (`Spares`)."""
        start, length = self._view
        self._map.madvise(_MADV_FREE, start, length)

    def release(self) -> None:
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a tensor or view of it is still alive; the mapping is unmapped when the last dies
            log.debug("host buffer still referenced at release; unmapped once the last view of it is gone")


SPARE_BYTES = 64 << 20  # idle staging kept for reuse, at most: a file tier's write staging (48 MiB) and more
_MADV_FREE = getattr(mmap, "MADV_FREE", None)  # Linux 4.5 and newer


class Spares:
    """Staging buffers that a pool let go of, kept for the next pool that wants one of the same size.

    A fresh buffer costs a page fault per page at its first touch, and on a virtual machine that hands freed
    memory back to its host (free page reporting) each of those faults goes to the host: a fresh store's
    capture is measurably slower without them (docs/benchmark.md, "Fresh write staging"). A kept
    buffer is given back lazily (`MADV_FREE`): the OS takes its pages at once when it needs memory (they come
    back zero-filled, which staging does not mind) and otherwise leaves them, so reuse costs nothing. At most
    `limit` bytes are kept, the oldest dropped first; only where the OS has lazy freeing and huge pages.
    """

    def __init__(self, limit: int = SPARE_BYTES):
        self.limit = limit
        self._kept: List[HostBuffer] = []  # oldest first
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._kept)

    def keep(self, buf: HostBuffer) -> bool:
        """Keeps the unpinned `buf` (nothing may use it any more) for reuse; False where it is not kept (the
        caller releases it)."""
        if _MADV_FREE is None or not HUGE_PAGES or buf.pinned or buf.nbytes < HUGE_PAGE or buf.nbytes > self.limit:
            return False
        try:
            buf.lazy_free()
        except OSError:
            return False
        dropped = []
        with self._lock:
            while self._kept and sum(b.nbytes for b in self._kept) + buf.nbytes > self.limit:
                dropped.append(self._kept.pop(0))
            self._kept.append(buf)
        for old in dropped:
            old.release()
        return True

    def take(self, nbytes: int) -> Optional[HostBuffer]:
        """A kept buffer of exactly `nbytes` (the newest), its every page written once, or None."""
        with self._lock:
            found = next((i for i in range(len(self._kept) - 1, -1, -1) if self._kept[i].nbytes == nbytes), None)
            buf = None if found is None else self._kept.pop(found)
        if buf is not None:
            # A write per page ends its lazy freeing before any use: the OS can no longer drop a page that a
            # device or an O_DIRECT read fills next (kernels before 6.0 could, under memory pressure).
            buf.tensor[::PAGE].fill_(0)
        return buf

    def clear(self) -> None:
        with self._lock:
            kept, self._kept = self._kept, []
        for buf in kept:
            buf.release()


SPARES = Spares()
if hasattr(os, "register_at_fork"):  # a child must not inherit the lock held by a parent's thread
    os.register_at_fork(after_in_child=lambda: setattr(SPARES, "_lock", threading.Lock()))


_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's


def _cuda_register(tensor: torch.Tensor) -> bool:
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel(), _HOST_REGISTER_PORTABLE)) == 0:
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """Resets the thread's last CUDA error left by a refused registration.

    Otherwise the next kernel launch check on this thread reports it as its own failure (e.g. "out of memory").
    """
    clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if clear is not None:
        clear()
        return
    import ctypes

    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _cuda_unregister(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class PinBudget:
    """Bytes of page-locked memory that every allocator drawing from it may hold together (thread-safe)."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> bool:
        """Takes `nbytes` if they fit (before pinning, so two stores cannot overshoot together)."""
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes

    @property
    def left(self) -> int:
        return max(0, self.limit - self.used)


_process_budget: Optional[PinBudget] = None
_process_lock = threading.Lock()


def process_pin_budget() -> PinBudget:
    """The budget of the pinning the engine does itself (no host service): a quarter of the physical RAM.

    Page-locked memory cannot be swapped, so the engine never locks most of it; the figure is fixed at first
    use and shared by every store of this process. A program may set `process_pin_budget().limit`.
    """
    global _process_budget
    with _process_lock:
        if _process_budget is None:
            _process_budget = PinBudget(psutil.virtual_memory().total // 4)
        return _process_budget


def pin_room(store_cap: Optional[int], host_pins: bool) -> Optional[int]:
    """Bytes a new store could pin now, for `auto`: None when the host's own budget decides (unknown here)."""
    if host_pins:
        return store_cap
    left = process_pin_budget().left
    return left if store_cap is None else min(store_cap, left)


class HostAllocator:
    """Allocates `HostBuffer`s; pins them while they fit the budgets and the pinner accepts.

    Args:
        pin: try to page-lock buffers at all (only meaningful when copies go to a CUDA device).
        budget: bytes this allocator may keep pinned at once (`OffloadConfig.pin_budget`); None: no own cap.
        pin_fn / unpin_fn: the host's pinning service; default `cudaHostRegister` / `cudaHostUnregister`.
        shared: the budget shared with every other allocator; default `process_pin_budget()` when the engine
            pins itself, none when the host pins (the host's service enforces its own budget).
    """

    _PROCESS = object()

    def __init__(self, pin: bool, budget: Optional[int] = None, pin_fn: Optional[Callable] = None,
                 unpin_fn: Optional[Callable] = None, shared=_PROCESS):
        self.pin = pin
        self.budget = budget
        self._pin_fn = pin_fn or _cuda_register
        self._unpin_fn = unpin_fn or _cuda_unregister
        if shared is HostAllocator._PROCESS:
            shared = process_pin_budget() if pin and pin_fn is None else None
        self.shared: Optional[PinBudget] = shared
        self._budgets = [b for b in (None if budget is None else PinBudget(budget), shared) if b is not None]
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self.fallback_reason: Optional[str] = None

    def alloc(self, nbytes: int, spare: bool = False) -> HostBuffer:
        """A buffer of `nbytes`, pinned where it fits; with `spare`, one that `free(..., spare=True)` kept, if any."""
        buf = (SPARES.take(nbytes) if spare else None) or HostBuffer(nbytes)
        if self.pin and nbytes:
            fits = self._reserve(nbytes)  # before pinning, so two threads (or two stores) cannot overshoot
            why = "pin budget exhausted"
            try:
                if fits:
                    why = self._try_pin(buf)
                    if why is None:
                        return buf
            except BaseException:  # a pinner that answered nonsense (or an interrupt): the budget is given back
                self._unreserve(nbytes)
                raise
            if fits:
                self._unreserve(nbytes)
            self._note_fallback(why, nbytes)
        with self._lock:
            self.pageable_bytes += nbytes
        return buf

    def _reserve(self, nbytes: int) -> bool:
        """Takes `nbytes` from the store's own budget and the process-wide one, or from neither."""
        taken = []
        for budget in self._budgets:
            if not budget.reserve(nbytes):
                for earlier in taken:
                    earlier.release(nbytes)
                return False
            taken.append(budget)
        with self._lock:
            self.pinned_bytes += nbytes
        return True

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self.pinned_bytes -= nbytes
        for budget in self._budgets:
            budget.release(nbytes)

    def _try_pin(self, buf: HostBuffer) -> Optional[str]:
        """Page-locks `buf` through the pinning service: None when it did, else why not (for the one warning)."""
        try:
            pinned = self._pin_fn(buf.tensor)
        except Exception as exc:  # a refused pin is a slower copy, never a failed request: said once, with this
            return f"the pinning service raised {type(exc).__name__}: {exc}"
        # Anything but a bool is no answer: a truthy tensor (`t.pin_memory()` returns a pinned *copy*) would be
        # taken for "pinned in place" and copied from asynchronously while it is pageable.
        if not isinstance(pinned, bool) and type(pinned).__name__ != "bool_":
            raise ValueError(f"HostServices: `pin` returned {type(pinned).__name__} {pinned!r:.60}; it must "
                             "page-lock the tensor it is given in place and return True, or return False when it "
                             "refuses. Fix that callable, or leave pin/unpin None so the engine pins itself.")
        buf.pinned = bool(pinned)
        return None if buf.pinned else "the pinning service refused"

    def _note_fallback(self, why: str, nbytes: int) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = why
            log.warning(
                "KV offload: %s (%s; this store has %.2f GiB pinned); the rest of this cache uses pageable memory, "
                "so its copies are slower and not overlapped.", why, self._describe_budget(), self.pinned_bytes / GiB,
            )

    def _describe_budget(self) -> str:
        parts = [] if self.budget is None else [f"store budget {self.budget / GiB:.2f} GiB"]
        if self.shared is not None:
            parts.append(f"process budget {self.shared.limit / GiB:.2f} GiB, {self.shared.used / GiB:.2f} GiB "
                         "of it in use by all stores")
        return "; ".join(parts) or "the host's pinned-memory budget"

    def free(self, buf: HostBuffer, spare: bool = False) -> None:
        """Unpins and releases `buf`; with `spare`, keeps it in `SPARES` for a later `alloc(..., spare=True)`."""
        if buf.tensor is None:
            return
        if buf.pinned:
            try:
                self._unpin_fn(buf.tensor)
            finally:  # after unpinning: the budget never counts less than is locked
                buf.pinned = False
                self._unreserve(buf.nbytes)
        else:
            with self._lock:
                self.pageable_bytes -= buf.nbytes
        if not (spare and SPARES.keep(buf)):
            buf.release()
