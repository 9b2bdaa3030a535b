"""Page-aligned host buffers (private anonymous `mmap`: `O_DIRECT` needs page alignment, torch's allocator gives 64
bytes), pinned one layer at a time within one budget per process (docs/engine.md, "Layers, files and failures"),
else pageable with one warning; unmapped when freed, except the staging kept in `SPARES`."""

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
# Private where the OS has it: Python's default is a shared (shmem) mapping, which gets no transparent huge pages.
_PRIVATE = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}


class HostBuffer:
    """One page-aligned host allocation. `tensor` is a flat uint8 view; owned by the allocator that made it.

    From `HUGE_PAGE` up (Linux) it starts on a huge-page boundary with `MADV_HUGEPAGE`, so a disk's DMA takes each
    2 MiB as one segment (docs/benchmark.md, "Huge pages"); the mapping's slack around it is never touched.
    """

    __slots__ = ("tensor", "nbytes", "pinned", "_map", "_view")

    def __init__(self, nbytes: int, huge: bool = True):
        self.nbytes = nbytes
        length = max(-(-nbytes // PAGE) * PAGE, PAGE)  # whole pages
        huge = huge and HUGE_PAGES and length >= HUGE_PAGE
        self._map = mmap.mmap(-1, length + (HUGE_PAGE if huge else 0), **_PRIVATE)
        # The tensor's storage keeps this memoryview, so `release` cannot unmap memory a live view still uses.
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
        """The whole page-aligned buffer (`nbytes` rounded up to a page), for system calls (O_DIRECT I/O)."""
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
    """Staging buffers a pool let go of, kept for the next pool wanting that size: reuse costs no page faults
    (docs/benchmark.md, "Fresh write staging"). Kept buffers are lazily freed (`MADV_FREE`; pages the OS takes come
    back zero-filled). At most `limit` bytes, oldest dropped first; only where the OS has lazy freeing and huge pages.
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
        """Keeps the unpinned, unused `buf` for reuse; False where it is not kept (the caller releases it)."""
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
            # A write per page ends lazy freeing, else the OS may drop a page a DMA fills next (kernels < 6.0).
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
    if int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), _HOST_REGISTER_PORTABLE)) == 0:
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """Resets the thread's CUDA error from a refused registration, which the next launch check would report
    (torch's `cudart()` binds no `cudaGetLastError`)."""
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
    """The engine's own pinning budget (no host service): a quarter of the physical RAM, as locked pages cannot
    be swapped; fixed at first use, shared by every store of this process. A program may set its `limit`."""
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

    `pin`: page-lock at all (for copies to a CUDA device); `budget`: bytes this allocator may keep pinned
    (`OffloadConfig.pin_budget`), None for no own cap; `pin_fn` / `unpin_fn`: the host's pinning service, default
    `cudaHostRegister` / `cudaHostUnregister`; `shared`: the budget shared with every allocator, by default
    `process_pin_budget()` when the engine pins, none when the host does (its service keeps its own budget).
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
        # Only a bool answers: a truthy tensor (`t.pin_memory()` returns a pinned *copy*) is not pinned in place.
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
