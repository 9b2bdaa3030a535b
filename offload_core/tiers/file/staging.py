"""The file tiers' read and write staging: a bounded pool of page-aligned `[buffer, fence]` places. A buffer is
overwritten only once the last device copy out of it has finished; one a stuck I/O request may still fill is
quarantined, never reused or freed. Freed buffers go to `hostmem.SPARES`, and new ones come from there."""

from __future__ import annotations

import logging
import queue
from typing import List, Optional

from ...host.devices import DONE, Fence
from ...host.hostmem import HostAllocator, HostBuffer
from .iopool import io_timeout

log = logging.getLogger(__name__)


class StagingPool:
    def __init__(self, allocator: HostAllocator, count: int, name: str):
        self._allocator = allocator
        self.name = name
        self._free: "queue.Queue[list]" = queue.Queue()
        self._all: List[list] = [[None, DONE] for _ in range(count)]
        self._abandoned: List[HostBuffer] = []
        for item in self._all:
            self._free.put(item)

    def acquire(self, nbytes: int, into: Optional[list] = None) -> list:
        """[buffer, fence] with a buffer of at least `nbytes`; waits (bounded) for one to come free. With `into`, the
        place is appended to it before returning, so a caller interrupted just after still finds it to give back."""
        try:
            item = self._free.get(timeout=io_timeout())
        except queue.Empty:
            raise TimeoutError(f"KV offload: no {self.name} staging buffer came free within {io_timeout():g} s; "
                               "the I/O holding them is stuck or far too slow.") from None
        try:
            item[1].synchronize()  # the device copy out of this buffer has finished: safe to overwrite
            if item[0] is None or item[0].nbytes < nbytes:
                old, item[0] = item[0], None  # the place lets go first: a buffer kept for reuse is never also ours
                if old is not None:
                    self._allocator.free(old, spare=True)
                item[0] = self._allocator.alloc(nbytes, spare=True)
        except BaseException:
            self._free.put(item)  # a failed allocation must not shrink the pool (the next acquire would hang)
            raise
        if into is not None:
            into.append(item)
        return item

    def release(self, item: list, fence: Fence = DONE) -> None:
        item[1] = fence
        self._free.put(item)

    def quarantine(self, item: list) -> None:
        """Gives `item`'s place back empty; its buffer is kept alive and never touched again."""
        if item[0] is not None:
            self._abandoned.append(item[0])
        fresh = [None, DONE]
        self._all[self._all.index(item)] = fresh
        self._free.put(fresh)

    def trim(self) -> None:
        """Frees the buffers of every idle place; the places stay, empty. Buffers in use are not touched."""
        idle = []
        try:
            while True:
                try:
                    idle.append(self._free.get_nowait())
                except queue.Empty:
                    break
            for item in idle:
                item[1].synchronize()
                if item[0] is not None:
                    buffer, item[0], item[1] = item[0], None, DONE
                    self._allocator.free(buffer, spare=True)
        finally:  # also on Ctrl-C or a failed free: a lost place would leave later `acquire`s waiting for ever
            for item in idle:
                self._free.put(item)

    def buffers(self) -> List[HostBuffer]:
        return [item[0] for item in self._all if item[0] is not None]

    def close(self, abandoned_io: bool) -> None:
        """Frees every buffer; with `abandoned_io` the buffers a stuck request may still fill are left alone."""
        for item in self._all:
            item[1].synchronize()
            buffer, item[0] = item[0], None
            if buffer is not None and not abandoned_io:
                self._allocator.free(buffer, spare=True)
        if abandoned_io:
            if self._abandoned:
                log.warning("KV offload: %d staging buffer(s) left to stuck I/O requests are not freed",
                            len(self._abandoned))
            return
        for buf in self._abandoned:  # every I/O thread has finished: nothing writes into them any more
            self._allocator.free(buf)
        self._abandoned.clear()
