"""The protocol every storage tier implements, and what a tier is given to do its work.

A tier knows *how* to keep a layer and how to copy it into a device slot; the store (`store.py`) decides
*what* to load and *when*. Capabilities are flags (`on_device`), not `isinstance` checks.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Dict, Hashable, Optional, Tuple

import torch

from ..devices import DONE, Fence, Streams
from ..hostmem import HostAllocator
from ..layout import LayerLayout
from .iopool import load_timeout

TRANSFER_TIMEOUT_S = load_timeout()  # a load that has not finished by then is a hang, not a slow disk


@dataclass
class TierContext:
    device: torch.device
    streams: Streams
    allocator: HostAllocator
    depth: int  # layers in flight ahead of the consumer (0: synchronous tier)


class Pending:
    """A load in progress: an optional host-side future (file reads) that yields the device-side fence."""

    __slots__ = ("_fence", "_future")

    def __init__(self, fence: Fence = DONE, future: Optional[Future] = None):
        self._fence, self._future = fence, future

    def wait(self, stream) -> None:
        """Blocks the host until the data is queued, then orders `stream` after the copy (no host sync)."""
        if self._future is not None:
            self._fence = _result(self._future)
            self._future = None
        self._fence.make_wait(stream)

    def cancel(self) -> None:
        """Drops the load if it has not started yet (used by close). One that runs is not waited for here: the
        tiers' close waits for it (`close_tiers` drains the streams; a file tier stops its I/O threads, then
        waits for the fence of every copy out of its staging before freeing anything), also for a store that
        is garbage-collected without `close`, where nothing cancels."""
        if self._future is not None and self._future.cancel():
            self._future = None

    def settle(self) -> None:
        """Waits for the load to finish completely, swallowing its error (used when cancelling).

        Whatever the background job raised is dropped, a `KeyboardInterrupt` or `SystemExit` that reached the
        I/O thread included: it belonged to that job, not to the caller closing the store. An interrupt of the
        calling thread while it waits here still propagates.
        """
        future = self._future
        try:
            if future is not None:
                self._fence = _result(future)
                self._future = None
            self._fence.synchronize()
        except BaseException as exc:
            if not isinstance(exc, Exception) and not _raised_by(future, exc):
                raise


def _raised_by(future: Optional[Future], exc: BaseException) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception(0) is exc


def check_unmodified(key: Hashable, version: int, served: int) -> None:
    """Refuses to serve a layer whose tensors were written in place since the store handed them out."""
    if version != served:
        raise RuntimeError(
            f"KVStore.get: the K/V of layer {key!r} returned by an earlier get were modified in place; the store "
            "serves its own buffers, which consumers must only read. Copy them first (e.g. torch.cat, .clone()) "
            "before changing them. This layer is not served again as it is; recompute the prefix.")


def _result(future: Future) -> Fence:
    try:
        return future.result(timeout=TRANSFER_TIMEOUT_S)
    except FutureTimeout:
        if future.done():
            raise  # the load failed with a timeout of its own, whose message says what it waited for
        raise TimeoutError(f"KV offload: a layer load did not finish within {TRANSFER_TIMEOUT_S:.0f} s (waiting for "
                           "its background read and copy); the disk or device is not answering.") from None


class Tier:
    """Where a store keeps its layers between uses.

    store(key, k, v, layout): called once per layer; takes a private copy of `k` and `v` (which live on the
        consuming device) before returning or, for asynchronous copies, before any later work on the current
        stream can change them.
    load(key, slot, release) -> Pending: copies the layer into the device buffer `slot` (uint8, laid out as
        `layout`), not before `release` (the consumer finished with what the slot held before).
    view(key) -> (k, v): only for `on_device` tiers, which need no slots.
    flush(): waits until everything stored is in place (the file tiers write in the background).
    nbytes() -> bytes held, by place: {"device", "host_pinned", "host_pageable", "file"}.
    close(): waits for or cancels its own background work, then frees everything. Idempotent.
    """

    name = "base"
    on_device = False
    note: Optional[str] = None  # a fact the store's reason should carry (e.g. files on a RAM-backed filesystem)

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        raise NotImplementedError

    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        raise NotImplementedError

    def view(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def new_slot(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 buffer of `nbytes` on `device` for the store's ring (a tier may want it aligned)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release_slot(self, slot: torch.Tensor) -> None:
        """The store drops a ring slot this tier made with `new_slot` (nothing to do for a plain device buffer)."""

    def flush(self) -> None:
        """Waits (bounded) until every layer stored so far is in place; raises the first error storing one."""

    def seal(self) -> None:
        """No more layers come: `flush`, then free what only storing needed (a file tier's write staging)."""
        self.flush()

    def nbytes(self) -> Dict[str, int]:
        raise NotImplementedError

    def info(self) -> Dict[str, object]:
        return {}

    def close(self) -> None:
        raise NotImplementedError
