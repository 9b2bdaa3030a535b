"""Page-aligned host buffers, page-locked lazily within a budget, with a visible fallback to pageable memory.

Every buffer is an anonymous `mmap` viewed as a uint8 tensor: page-aligned, as `O_DIRECT` reads need (torch's
CPU allocator only aligns to 64 bytes), and returned to the OS the moment it is freed. Pinning registers the
existing pages (`cudaHostRegister`, or the host's own `pin`, e.g. ComfyUI's budgeted `pin_memory`) one layer
at a time, never the whole cache up front; past the budget or when the driver refuses, the buffer stays
pageable and the store reports `pinned_fallback`.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


def round_up(n: int, align: int = 4096) -> int:
    return (n + align - 1) // align * align


class HostBuffer:
    """One page-aligned host allocation. `tensor` is a flat uint8 view; owned by the allocator that made it."""

    __slots__ = ("tensor", "nbytes", "pinned", "_map")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(round_up(nbytes, PAGE), PAGE))
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.pinned = False

    def memory(self) -> memoryview:
        """The whole page-aligned mapping, for system calls (O_DIRECT reads and writes)."""
        return memoryview(self._map)

    def release(self) -> None:
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere; the OS gets it back when that dies
            log.debug("host buffer still referenced at release; left to the garbage collector")


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


class HostAllocator:
    """Allocates `HostBuffer`s; pins them while `pinned_bytes + size <= budget` and the pinner accepts.

    Args:
        pin: try to page-lock buffers at all (only meaningful when copies go to a CUDA device).
        budget: bytes this allocator may keep pinned at once.
        pin_fn / unpin_fn: the host's pinning service; default `cudaHostRegister` / `cudaHostUnregister`.
    """

    def __init__(self, pin: bool, budget: int, pin_fn: Optional[Callable] = None, unpin_fn: Optional[Callable] = None):
        self.pin = pin
        self.budget = budget
        self._pin_fn = pin_fn or _cuda_register
        self._unpin_fn = unpin_fn or _cuda_unregister
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self.fallback_reason: Optional[str] = None

    def alloc(self, nbytes: int) -> HostBuffer:
        buf = HostBuffer(nbytes)
        if self.pin and nbytes:
            with self._lock:
                fits = self.pinned_bytes + nbytes <= self.budget
                if fits:
                    self.pinned_bytes += nbytes  # reserve before pinning so two threads cannot overshoot
            if fits and self._try_pin(buf):
                return buf
            if fits:
                with self._lock:
                    self.pinned_bytes -= nbytes
            self._note_fallback("pin budget exhausted" if not fits else "the pinning service refused", nbytes)
        with self._lock:
            self.pageable_bytes += nbytes
        return buf

    def _try_pin(self, buf: HostBuffer) -> bool:
        try:
            buf.pinned = bool(self._pin_fn(buf.tensor))
        except Exception as exc:  # a refused pin is a slower copy, never a failed request
            log.debug("pinning %d bytes failed: %s", buf.nbytes, exc)
            buf.pinned = False
        return buf.pinned

    def _note_fallback(self, why: str, nbytes: int) -> None:
        if self.fallback_reason is None:
            self.fallback_reason = why
            log.warning(
                "KV offload: %s (budget %.2f GiB, %.2f GiB pinned); the rest of this cache uses pageable memory, "
                "so its copies are slower and not overlapped.", why, self.budget / 2**30, self.pinned_bytes / 2**30,
            )

    def free(self, buf: HostBuffer) -> None:
        if buf.tensor is None:
            return
        with self._lock:
            if buf.pinned:
                self.pinned_bytes -= buf.nbytes
            else:
                self.pageable_bytes -= buf.nbytes
        if buf.pinned:
            self._unpin_fn(buf.tensor)
            buf.pinned = False
        buf.release()
