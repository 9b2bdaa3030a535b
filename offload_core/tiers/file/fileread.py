"""Reading layer files for the file tiers: checked opens, chunked reads, every chunk's checksum verified.

The I/O threads fill a page-aligned slot this tier made (a CPU consumer's) in place; any other slot gets the read
staging, then one copy.
`file_async` starts and finishes reads on two one-thread lanes (first in first out, so copies into one slot stay in
order, and the next layer's chunks queue while this one's complete); `file_sync` runs both inline."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
from typing import Dict, List, Optional

import torch

from ...host.devices import DONE, Fence
from ...host.hostmem import HostBuffer
from ...layout import check_fits
from ..base import Pending, TierContext
from .fileio import KVFileError, chunks, corrupted, digest, drop_pages, open_checked, pread_exact
from .filewrite import LayerFile
from .iopool import IOPool, IOStuckError, io_timeout, wait_all, when_done
from .staging import StagingPool


class _Read:
    """What one layer's read holds until it ends: its staging place, its open file and its queued requests.

    Filled in as each is taken (`into=`), so whoever ends the read finds all that an interrupt let the start take.
    In `file_async` the start and finish jobs own it; the last to let go ends the read."""

    __slots__ = ("held", "fd", "requests", "fence", "_owners", "_lock")

    def __init__(self, owners: int = 1):
        self.held: List[list] = []  # the staging place, once taken
        self.fd = None  # the open layer file, once checked
        self.requests: List[cf.Future] = []
        self.fence: Optional[Fence] = None  # set once the read has served its layer (the device copy's fence)
        self._owners = owners
        self._lock = threading.Lock()

    def let_go(self) -> bool:
        """True for the call of the last owner: that one ends the read."""
        with self._lock:
            self._owners -= 1
            return self._owners == 0


class Reader:
    """The read path of one file store: its read staging, and the requests of the last read into each host slot."""

    def __init__(self, ctx: TierContext, cache_mode: str, chunks: IOPool, lanes: Dict[str, IOPool],
                 stuck: List[str], host_slots: Dict[int, HostBuffer]):
        self._ctx, self.cache_mode = ctx, cache_mode
        self._chunks, self._lanes, self._stuck = chunks, lanes, stuck
        self._host_slots = host_slots  # page-aligned CPU slots the tier made, by address
        self.staging = StagingPool(ctx.allocator, max(ctx.depth, 0) + 1, "read")
        # host slot address -> the last read's requests into it; however that read ended, the next one waits for them.
        self.filling: Dict[int, List[cf.Future]] = {}
        self._read: Optional[_Read] = None  # `file_sync`: the last read, which its consumer's thread ends

    def writing(self, address: int) -> bool:
        """True while a request of a read may still write into the host slot at `address`."""
        return not all(f.done() for f in self.filling.get(address, ()))

    def load(self, entry: LayerFile, slot: torch.Tensor, release: Fence) -> Pending:
        """Reads `entry` into `slot`; the I/O threads fill a host slot this tier made as chunks arrive (on a CPU a
        copy after the read costs as much as the read), any other slot gets one copy on the side stream after
        `release`."""
        check_fits(slot.numel(), entry.layout, 0)  # before any read: a memoryview slice would come out shorter
        direct = self._host_slots.get(slot.data_ptr())  # a slot this tier made: the I/O threads fill it in place
        if not self._lanes:
            read = self._read = _Read()  # a read whose end a Ctrl-C stopped is ended by close()
            try:
                self._start_read(entry, direct, read)
                read.fence = self._finish_read(entry, slot, release, read)
            finally:
                self._end(read)
            return Pending(read.fence)
        # Two owners: each job lets go once over (cancelled by close() too); the `finally` for a job never queued.
        read = _Read(owners=2)
        queued: List[cf.Future] = []
        let_go = functools.partial(self._let_go, read)
        try:
            self._lanes["read_start"].submit(functools.partial(self._start_read, entry, direct, read),
                                             f"opening {entry.path}", into=queued, done=let_go)
            started = queued[0]

            def finish() -> Fence:
                try:
                    started.result(timeout=io_timeout())
                except cf.TimeoutError:
                    if started.done():
                        raise  # the start's own timeout, which says what it waited for
                    raise TimeoutError(f"KV offload: opening layer file {entry.path!r} for reading did not finish "
                                       f"within {io_timeout():g} s; the disk is not answering.") from None
                read.fence = self._finish_read(entry, slot, release, read)
                return read.fence

            self._lanes["read_finish"].submit(finish, f"the read of {entry.path}", into=queued, done=let_go)
        finally:
            for _ in range(2 - len(queued)):  # the jobs an interrupt or a shut pool kept from being queued
                self._let_go(read)
        return Pending(future=queued[1])

    def _let_go(self, read: _Read, *_future) -> None:
        if read.let_go():
            self._end(read)

    def _start_read(self, entry: LayerFile, direct: Optional[HostBuffer], read: _Read) -> None:
        """Checks the file and queues its chunk reads (which also fill `direct`, a slot this tier made), taking
        the staging place, the descriptor and the requests into `read`."""
        if direct is not None:
            # The last read into the slot may have left requests running; theirs must not land over ours. `wait`
            # raises none of their errors, only this thread's Ctrl-C (`file_sync`), and nothing is taken yet.
            earlier = self.filling.get(direct.tensor.data_ptr(), ())
            if not all(f.done() for f in earlier) and cf.wait(earlier, timeout=io_timeout()).not_done:
                raise TimeoutError(f"KV offload: reading {entry.path!r} waited {io_timeout():g} s for an earlier "
                                   "read into the same buffer; the disk is not answering.")
            self.filling[direct.tensor.data_ptr()] = read.requests  # before the first is queued
        if entry.write is not None:
            try:
                entry.write.result(timeout=io_timeout())
            except cf.TimeoutError as exc:
                if entry.write.done():
                    raise KVFileError(f"KV layer file {entry.path!r} was never written ({exc}).") from exc
                raise TimeoutError(f"KV offload: waited {io_timeout():g} s for the write of {entry.path!r} to finish "
                                   "before reading it back; the disk is not answering.") from None
            except (KeyboardInterrupt, SystemExit):
                raise  # this thread's own Ctrl-C while it waits (a write's thread never gets one)
            except BaseException as exc:
                raise KVFileError(f"KV layer file {entry.path!r} was never written ({exc}).") from exc
        base = len(entry.header)
        self.staging.acquire(base if direct is not None else entry.total, into=read.held)  # the slot takes the data
        read.fd = fd = open_checked(entry.path, entry.total, self.cache_mode)
        mem = read.held[0][0].memory()
        into = direct.memory() if direct is not None else None

        def read_chunk(off: int, n: int, expected: Optional[int]) -> None:
            view = into[off - base:off - base + n] if into is not None else mem[off:off + n]
            if off == base:  # the header comes with the first chunk: one request fewer per layer
                head = mem[:base]
                pread_exact(fd, view, 0, entry.path, head=head)
                if head != entry.header:
                    raise KVFileError(f"KV layer file {entry.path!r} is corrupted: its header differs from what this "
                                      "store wrote. It was modified while in use.")
            else:
                pread_exact(fd, view, off, entry.path)
            if expected is not None and digest(view) != expected:
                raise corrupted(entry.path, off, n)

        pieces = chunks(0, entry.layout.data_bytes, entry.chunk)  # none for an empty layer: its header is still read
        jobs = [(base + off, n, d) for (off, n), d in zip(pieces, entry.digests)] or [(base, 0, None)]
        what = f"the read of {entry.path}"
        for job in jobs:
            self._chunks.submit(functools.partial(read_chunk, *job), what, into=read.requests)
            # Hands the GIL to the I/O thread just woken, so it reads now, not once all are queued (docs/benchmark.md).
            time.sleep(0)

    def _finish_read(self, entry: LayerFile, slot: torch.Tensor, release: Fence, read: _Read) -> Fence:
        """Waits for `read`'s requests and, into a slot this tier did not make, copies the layer there; the fence of
        that copy."""
        try:
            wait_all(read.requests, f"the read of {entry.path}")
        except IOStuckError:
            # A request may still be in preadv: its buffer is never reused; fd and slot are let go once it ends.
            self.staging.quarantine(read.held.pop())
            self._stuck.append(f"the read of {entry.path}")
            raise
        if self.cache_mode == "fadvise":
            drop_pages(read.fd)
        if slot.data_ptr() in self._host_slots:
            return DONE  # the I/O threads filled the slot chunk by chunk
        streams = self._ctx.streams
        side = streams.side
        item = read.held[0]
        with streams.on_side():
            release.make_wait(side)
            with streams.timed("transfer", side):
                data = item[0].tensor[len(entry.header):entry.total]
                streams.copy(slot[:entry.layout.data_bytes], data, non_blocking=item[0].pinned and side is not None)
            return streams.record(side)

    def _end(self, read: Optional[_Read]) -> None:
        """Closes `read`'s file and gives its staging place back once none of its requests runs (queued ones never
        start). A second call finds nothing left to give back."""
        if read is None:
            return
        fd, item, read.fd, read.held = read.fd, read.held[0] if read.held else None, None, []
        if read.fence is not None:  # served: every request has ended
            self._drop_read(fd, item, read.fence)
        else:
            when_done(read.requests, functools.partial(self._drop_read, fd, item))

    def close(self) -> None:
        """Ends a read that an interrupt kept from ending (`file_sync`), before the tier stops its I/O."""
        self._end(self._read)

    def _drop_read(self, fd, item: Optional[list], fence: Fence = DONE) -> None:
        try:
            if fd is not None:
                fd.close()
        finally:  # a close that fails still gives the place back
            if item is not None:
                self.staging.release(item, fence)
