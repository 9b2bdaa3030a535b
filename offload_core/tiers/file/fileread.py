"""Reading layer files for the file tiers: checked opens, chunked reads, every chunk's checksum verified.

The file is opened and checked (a regular file of the right size), read in chunks by the I/O threads (`file_sync`:
the last wave of a layer in quarter-chunk requests, each chunk's checksum taken part by part as they arrive, so
the queue drains for less time at its end and the last checksum is short) into a read
staging buffer, every chunk's digest (checked by the hash threads, beside the I/O) and the header compared with
what the store wrote, then the data is copied into the device slot. A CPU consumer's slots are page-aligned, so
there the chunks are read straight into the slot, with no copy. `file_async` runs the per-layer steps on two lanes
(one thread each, first in first out, so copies into one slot stay in order): one that starts reads and one that
finishes them, so the next layer's chunks are queued while this one's complete. `file_sync` runs them inline.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch

from ...host.devices import DONE, Fence
from ...host.hostmem import HostBuffer
from ...layout import ALIGN, check_fits
from ..base import Pending, TierContext
from .fileio import (KVFileError, checksum_module, chunks, corrupted, digest, drop_pages, header_matches, open_checked, pread_exact)
from .filewrite import LayerFile
from .iopool import IOPool, IOStuckError, Then, io_timeout, wait_all, when_done
from .staging import StagingPool

TAIL_PARTS = 4  # requests per chunk in the last wave of a layer's read (see Reader._parts)


class _Parts:
    """The parts of one chunk read as several requests: its checksum is taken part by part, in order, as they
    arrive (on the hash threads; one at a time, by whichever thread finds the next part in)."""

    def __init__(self, starts: List[int], hashing: bool):
        self._order = starts
        self._arrived: Dict[int, memoryview] = {}
        self._next = 0  # index in `_order` of the next part to hash
        self._busy = False  # a thread is hashing; parts that arrive meanwhile are left to it
        self._hasher = checksum_module().xxh3_64() if hashing else None  # None: the chunk has no digest to check
        self._lock = threading.Lock()

    def arrived(self, start: int, piece: memoryview) -> Optional[int]:
        """Part `start` is in; hashes every part now in, in order. Returns the chunk's digest (0 where nothing
        is hashed) to the one call that finds the last part done, else None."""
        with self._lock:
            self._arrived[start] = piece
            if self._busy:
                return None
            self._busy = True
        while True:
            with self._lock:
                if self._next == len(self._order):
                    return self._hasher.intdigest() if self._hasher is not None else 0
                piece = self._arrived.pop(self._order[self._next], None)
                if piece is None:
                    self._busy = False  # the next part's own arrival hashes it (it takes the lock after this)
                    return None
            if self._hasher is not None:
                self._hasher.update(piece)
            self._next += 1


class _Read:
    """What one layer's read holds until it ends: its staging place, its open file and its queued requests.

    The thread that starts the read fills it in as it takes each (the place through `acquire`'s `into`, the
    requests through `submit`'s), so whoever ends the read finds everything taken so far, however far an
    interrupt let the start get. `file_async` has two owners, the start and the finish jobs; the last of the
    two to let go ends the read."""

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

    def __init__(self, ctx: TierContext, cache_mode: str, chunks: IOPool, hashes: IOPool, lanes: Dict[str, IOPool],
                 stuck: List[str], host_slots: Dict[int, HostBuffer]):
        self._ctx, self.cache_mode = ctx, cache_mode
        self._chunks, self._hashes, self._lanes, self._stuck = chunks, hashes, lanes, stuck
        self._host_slots = host_slots  # page-aligned CPU slots the tier made, by address
        self.staging = StagingPool(ctx.allocator, max(ctx.depth, 0) + 1, "read")
        # host slot address -> the requests of the last read into it, which fill it: however that read ended
        # (served, failed, interrupted, stuck, never finished), the next read into the slot starts once they have.
        self.filling: Dict[int, List[cf.Future]] = {}
        self._read: Optional[_Read] = None  # `file_sync`: the last read, which its consumer's thread ends

    def writing(self, address: int) -> bool:
        """True while a request of a read may still write into the host slot at `address`."""
        return not all(f.done() for f in self.filling.get(address, ()))

    def _host_slot(self, slot: torch.Tensor) -> bool:
        """True where the I/O threads may fill `slot` directly: host memory that no queued stream work can still
        read (a real CPU device; not a model of CUDA ordering, where the consumer's kernels may lag)."""
        return slot.device.type == "cpu" and self._ctx.streams.immediate

    def load(self, entry: LayerFile, slot: torch.Tensor, release: Fence) -> Pending:
        # A host slot is filled chunk by chunk by the I/O threads as the chunks arrive, instead of in one copy
        # after the whole read (on a CPU that copy costs as much as the read). A device slot gets one copy on
        # the side stream, ordered by fences.
        check_fits(slot.numel(), entry.layout, 0)  # before any read: a memoryview slice would come out shorter
        direct = slot if self._host_slot(slot) else None
        if not self._lanes:
            # A Ctrl-C that lands on the cleanup line below keeps the last read from ending: it ends here.
            self._end(self._read)
            read = self._read = _Read()
            try:
                self._start_read(entry, direct, read)
                read.fence = self._finish_read(entry, slot, release, read)
            finally:
                self._end(read)
            return Pending(read.fence)
        # Two owners, the start job and the finish job, each letting go once it is over (done, failed, cancelled
        # by close()); one that is never queued lets go here. The read ends when both have.
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

    def _start_read(self, entry: LayerFile, direct: Optional[torch.Tensor], read: _Read) -> None:
        """Checks the file and queues its chunk reads (which also fill `direct`, a host slot, if given), taking
        the staging place, the descriptor and the requests into `read`."""
        if direct is not None:
            # Only their end matters here, not how they ended: the requests of the last read into the slot (an
            # interrupted, failed or stuck one may have left some running) must not land over this read's.
            # `wait` never raises their errors, so a Ctrl-C that arrives while this thread waits (`file_sync`
            # runs it on the consumer's thread) is the only thing it can raise; nothing is taken yet.
            earlier = self.filling.get(direct.data_ptr(), ())
            if not all(f.done() for f in earlier) and cf.wait(earlier, timeout=io_timeout()).not_done:
                raise TimeoutError(f"KV offload: reading {entry.path!r} waited {io_timeout():g} s for an earlier "
                                   "read into the same buffer; the disk is not answering.")
            self.filling[direct.data_ptr()] = read.requests  # before the first is queued
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
        target = self._host_slots.get(direct.data_ptr()) if direct is not None else None
        self.staging.acquire(base if target is not None else entry.total, into=read.held)  # the slot takes the data
        item = read.held[0]
        read.fd = fd = open_checked(entry.path, entry.total, self.cache_mode)
        mem = item[0].memory()
        into = target.memory() if target is not None else None

        def read_chunk(off: int, n: int, expected: Optional[int], part: Optional[Tuple[int, int, "_Parts"]] = None):
            """Reads the chunk at `off` (or one `part` of it: offset in the chunk, length, the chunk's parts); its
            checksum follows (a part's share of it, in order)."""
            view = into[off - base:off - base + n] if into is not None else mem[off:off + n]
            if part is not None:
                start, size, parts = part
                piece = view[start:start + size]
                pread_exact(fd, piece, off + start, entry.path)
                return Then(functools.partial(check_part, view, off, n, expected, parts, start, piece), self._hashes)
            if off == base:  # the header comes with the first chunk: one request fewer per layer
                head = mem[:base]
                pread_exact(fd, view, 0, entry.path, head=head)
                bad = header_matches(head, entry.header)
                if bad is not None:
                    raise KVFileError(f"KV layer file {entry.path!r} is corrupted: its header differs from what this "
                                      f"store wrote (first at byte {bad}). It was modified while in use.")
            else:
                pread_exact(fd, view, off, entry.path)
            return Then(functools.partial(check_chunk, view, off, n, expected), self._hashes)  # next request first

        def check_part(view: memoryview, off: int, n: int, expected: Optional[int], parts: "_Parts", start: int,
                       piece: memoryview) -> None:
            got = parts.arrived(start, piece)
            if got is not None:  # the chunk's last part to be hashed: the whole chunk is in
                check_chunk(view, off, n, expected, got)

        def check_chunk(view: memoryview, off: int, n: int, expected: Optional[int], got: Optional[int] = None) -> None:
            if expected is not None and (digest(view) if got is None else got) != expected:
                raise corrupted(entry.path, off, n)
            if direct is not None and into is None:
                with self._ctx.streams.timed("transfer"):
                    direct[off - base:off - base + n].copy_(item[0].tensor[off:off + n])

        jobs = [(base + off, n, d) for (off, n), d in zip(chunks(0, entry.layout.data_bytes, entry.chunk), entry.digests)]
        jobs = jobs or [(base, 0, None)]  # an empty layer: its header is still read and compared
        what = f"the read of {entry.path}"
        for job, part in self._requests(jobs):
            self._chunks.submit(functools.partial(read_chunk, *job, part), what, into=read.requests)
            # Hands the GIL to the I/O thread just woken, which starts its read now instead of once every
            # request is queued: file_sync's disk idled 0.93 instead of 1.07 ms per layer (docs/benchmark.md).
            time.sleep(0)

    def _requests(self, jobs: list) -> list:
        """(chunk job, part) in the order they are queued: whole chunks in file order, then the last wave's
        parts round by round (every chunk's first part, then every chunk's second, ...). So each chunk's parts
        arrive spread over the wave and its checksum is mostly taken before its last part is in: at the end
        only the last round's parts are left to hash."""
        whole, rounds = [], {}
        for index, job in enumerate(jobs):
            parts = self._parts(index, len(jobs), job[1], job[2] is not None)
            if parts == [None]:
                whole.append((job, None))
                continue
            for place, part in enumerate(parts):
                rounds.setdefault(place, []).append((job, part))
        return whole + [request for place in sorted(rounds) for request in rounds[place]]

    def _parts(self, index: int, count: int, n: int, hashing: bool) -> List[Optional[Tuple[int, int, "_Parts"]]]:
        """How chunk `index` of `count` (`n` bytes; `hashing`: it has a digest to check) is requested: whole
        (`[None]`), or, in `file_sync`, for the last wave of a layer (its last `workers` chunks, never the first,
        which carries the header), as `TAIL_PARTS` requests.

        A `file_sync` read ends when its slowest last request does, and the disk's queue drains while the last
        wave's requests end one by one: shorter requests there keep it fuller up to the layer's end, and the
        chunk's checksum, taken part by part as they arrive, leaves only a part's share of it after the last
        read. Not in `file_async`, whose start lane queues the next layer's requests behind these, so its queue
        never drains at a layer's end (docs/benchmark.md has the measurements)."""
        part = (n // TAIL_PARTS) // ALIGN * ALIGN
        if self._lanes or index == 0 or index < count - self._chunks.workers or part == 0:
            return [None]
        starts = range(0, n, part)
        parts = _Parts(list(starts), hashing)
        return [(start, min(part, n - start), parts) for start in starts]

    def _finish_read(self, entry: LayerFile, slot: torch.Tensor, release: Fence, read: _Read) -> Fence:
        """Waits for `read`'s requests and, into a device slot, copies the layer there; the fence of that copy."""
        try:
            wait_all(read.requests, f"the read of {entry.path}")
        except IOStuckError:
            # A request may still be inside preadv: its staging buffer is never reused (the pool gets an empty
            # place instead); the descriptor closes and the slot takes the next read once the request ends.
            self.staging.quarantine(read.held.pop())
            self._stuck.append(f"the read of {entry.path}")
            raise
        if self.cache_mode == "fadvise":
            drop_pages(read.fd)
        if self._host_slot(slot):
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
        """Closes `read`'s file and gives its staging place back: at once where none of its requests runs any
        more, else (after an error, an interrupt or a stuck request) once none does; queued ones never start.
        Once only: a second call finds nothing left to give back."""
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
