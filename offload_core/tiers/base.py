"""The protocol every storage tier implements, and what a tier is given to do its work.

A tier knows *how* to keep a layer and how to copy it into a device slot; the store (`store/kvstore.py`) decides
*what* to load and *when*, and uses every tier through `Tier` alone. Capabilities are flags (`own_slots`), not
`isinstance` checks.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Dict, Hashable, Optional, Tuple

import torch

from ..host.devices import DONE, Fence, Streams
from ..host.hostmem import HostAllocator
from ..layout import LayerLayout
from .file.iopool import load_timeout

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


LOADED = Pending()  # a load that finished on return (shared: a pending with no future never changes)


def _raised_by(future: Optional[Future], exc: BaseException) -> bool:
    return future is not None and future.done() and not future.cancelled() and future.exception(0) is exc


def _result(future: Future) -> Fence:
    try:
        return future.result(timeout=TRANSFER_TIMEOUT_S)
    except FutureTimeout:
        if future.done():
            raise  # the load failed with a timeout of its own, whose message says what it waited for
        raise TimeoutError(f"KV offload: a layer load did not finish within {TRANSFER_TIMEOUT_S:.0f} s (waiting for "
                           "its background read and copy); the disk or device is not answering.") from None


class Tier(abc.ABC):
    """Where a store keeps its layers between uses; the store and its ring use a tier through these methods only.

    store(key, k, v, layout): called once per layer; takes a private copy of `k` and `v` (which live on the
        consuming device) before returning or, for asynchronous copies, before any later work on the current
        stream can change them.
    load(key, slot, release) -> Pending: copies the layer into the device buffer `slot` (uint8, laid out as
        `layout`), not before `release` (the consumer finished with what the slot held before).
    view(key) -> (k, v): the layer itself, for a tier that keeps it on the consuming device (no slot needed).
    new_slot / release_slot: make a ring slot / take one back (the ring offers every slot to every tier).
    flush(): waits until everything stored is in place (the file tiers write in the background).
    nbytes() -> bytes held, by place (`places.PLACES`).
    close(): waits for or cancels its own background work, then frees everything. Idempotent.
    """

    note: Optional[str] = None  # a fact the store's reason should carry (e.g. files on a RAM-backed filesystem)
    own_slots = False  # the ring has this tier make its slots (it reads into slots it made, without staging)

    # Growing layers (`growing.store.GrowingKVStore`): a layer that grows by blocks of tokens and is read as a prefix.
    # append(key, k, v, at) -> Fence: keeps tokens [at, at + n) of layer `key` (k, v: (B, n, H, D) on the device,
    #     maybe a view of a ring slot); the first append opens the layer, every later one adds to its end. Its
    #     copy is queued after the consumer's work so far, and before any later load into a slot (side stream,
    #     first in first out); the fence returned is after that copy: the consumer's stream must wait for it
    #     before it writes over the source. Each block is kept once: nothing already kept is written again.
    # load_prefix(key, k, v, release) -> Pending: copies the layer's first `k.shape[1]` tokens (whole blocks) into
    #     `k` and `v` (slices of a device slot), not before `release`.
    # drop_growing(key): forgets a growing layer (a move to another place).

    def append(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, at: int) -> Fence:
        raise TypeError(f"{type(self).__name__} keeps no growing layers; layer {key!r} cannot grow here.")

    def load_prefix(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, release: Fence) -> Pending:
        raise TypeError(f"{type(self).__name__} keeps no growing layers; layer {key!r} cannot be read here.")

    def drop_growing(self, key: Hashable) -> None:
        """Frees growing layer `key` (a no-op for one this tier does not hold)."""

    @abc.abstractmethod
    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        """Keeps a private copy of layer `key`."""

    @abc.abstractmethod
    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        """Queues the copy of layer `key` into `slot`, after `release`."""

    def view(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        raise TypeError(f"{type(self).__name__} keeps no layer on the device; load layer {key!r} into a slot.")

    def new_slot(self, nbytes: int, streams: Streams) -> torch.Tensor:
        """A flat uint8 buffer of `nbytes` on the device of `streams` for the store's ring (from the caching
        allocator on the current stream)."""
        return streams.empty(nbytes)

    def release_slot(self, slot: torch.Tensor) -> None:
        """The ring drops `slot`: a tier that made it with `new_slot` frees it now; others have nothing to do."""

    def flush(self) -> None:
        """Waits (bounded) until every layer stored so far is in place; raises the first error storing one."""

    def seal(self) -> None:
        """No more layers come: `flush`, then free what only storing needed (a file tier's write staging)."""
        self.flush()

    @abc.abstractmethod
    def nbytes(self) -> Dict[str, int]:
        """Bytes held, by place (every place this tier keeps bytes in, staging included)."""

    def info(self) -> Dict[str, object]:
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Waits for or cancels background work, then frees everything. Idempotent."""
