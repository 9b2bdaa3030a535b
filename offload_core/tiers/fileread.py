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

from ..devices import DONE, Fence
from ..hostmem import HostBuffer
from ..layout import ALIGN, check_fits
from .base import Pending, TierContext
from .fileio import (KVFileError, checksum_module, chunks, corrupted, digest, drop_pages, header_matches, open_checked,
                     pread_exact)
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


class Reader:
    """The read path of one file store: its read staging, and the last load queued into each host slot."""

    def __init__(self, ctx: TierContext, cache_mode: str, chunks: IOPool, hashes: IOPool, lanes: Dict[str, IOPool],
                 stuck: List[str], host_slots: Dict[int, HostBuffer]):
        self._ctx, self.cache_mode = ctx, cache_mode
        self._chunks, self._hashes, self._lanes, self._stuck = chunks, hashes, lanes, stuck
        self._host_slots = host_slots  # page-aligned CPU slots the tier made, by address
        self.staging = StagingPool(ctx.allocator, max(ctx.depth, 0) + 1, "read")
        self.filling: Dict[int, cf.Future] = {}  # host slot address -> the last load queued into it

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
        # Loads into one slot never overlap: a later one starts filling it only once the earlier one is done.
        previous = self.filling.get(slot.data_ptr()) if direct is not None else None
        if not self._lanes:
            return Pending(self._finish_read(entry, slot, release, self._start_read(entry, direct, previous)))
        started = self._lanes["read_start"].submit(functools.partial(self._start_read, entry, direct, previous),
                                                   f"opening {entry.path}")

        def finish() -> Fence:
            try:
                opened = started.result(timeout=io_timeout())
            except cf.TimeoutError:
                if started.done():
                    raise  # the start's own timeout, which says what it waited for
                started.add_done_callback(self._abandon_opened)  # if it ever opens, give its buffer back
                raise TimeoutError(f"KV offload: opening layer file {entry.path!r} for reading did not finish within "
                                   f"{io_timeout():g} s; the disk is not answering.") from None
            return self._finish_read(entry, slot, release, opened)

        finished = self._lanes["read_finish"].submit(finish, f"the read of {entry.path}")
        if direct is not None:
            self.filling[slot.data_ptr()] = finished
        # Cancelled by close() after its start ran: the opened file and the buffer go back here.
        finished.add_done_callback(lambda f: started.add_done_callback(self._abandon_opened) if f.cancelled() else None)
        return Pending(future=finished)

    def _start_read(self, entry: LayerFile, direct: Optional[torch.Tensor] = None,
                    previous: Optional[cf.Future] = None):
        """Checks the file and queues its chunk reads (which also fill `direct`, a host slot, if given);
        returns (staging item, fd, futures)."""
        if previous is not None:
            # Only its end matters here, not how it ended: a failed earlier load no longer writes into the slot,
            # and its error is its own reader's. `wait` never raises that error, so a Ctrl-C that arrives while
            # this thread waits (`file_sync` runs it on the consumer's thread) is the only thing it can raise;
            # nothing is taken yet, so it propagates as it is.
            if not cf.wait([previous], timeout=io_timeout()).done:
                raise TimeoutError(f"KV offload: reading {entry.path!r} waited {io_timeout():g} s for an earlier "
                                   "read into the same buffer; the disk is not answering.")
        if entry.write is not None:
            try:
                entry.write.result(timeout=io_timeout())
            except cf.TimeoutError as exc:
                if entry.write.done():
                    raise KVFileError(f"KV layer file {entry.path!r} was never written ({exc}).") from exc
                raise TimeoutError(f"KV offload: waited {io_timeout():g} s for the write of {entry.path!r} to finish "
                                   "before reading it back; the disk is not answering.") from None
            except BaseException as exc:
                raise KVFileError(f"KV layer file {entry.path!r} was never written ({exc}).") from exc
        base = len(entry.header)
        target = self._host_slots.get(direct.data_ptr()) if direct is not None else None
        item = self.staging.acquire(base if target is not None else entry.total)  # the slot takes the data
        try:
            fd = open_checked(entry.path, entry.total, self.cache_mode)
        except BaseException:
            self.staging.release(item)
            raise
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
        futures: List[cf.Future] = []
        try:
            for job, part in self._requests(jobs):
                self._chunks.submit(functools.partial(read_chunk, *job, part), what, into=futures)
                # Hands the GIL to the I/O thread just woken, which starts its read now instead of once every
                # request is queued: file_sync's disk idled 0.93 instead of 1.07 ms per layer (docs/benchmark.md).
                time.sleep(0)
        except BaseException:  # the requests already queued may run into the slot: they are waited for
            self._drop_after(futures, fd, item, DONE, direct)
            raise
        return item, fd, futures

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

    def _finish_read(self, entry: LayerFile, slot: torch.Tensor, release: Fence, opened) -> Fence:
        item, fd, futures = opened
        fence = DONE
        running = True
        try:
            wait_all(futures, f"the read of {entry.path}")
            running = False  # every request has ended: the descriptor and the place go back at once
            if self.cache_mode == "fadvise":
                drop_pages(fd)
            if self._host_slot(slot):
                return fence  # the I/O threads filled the slot chunk by chunk
            streams = self._ctx.streams
            side = streams.side
            with streams.on_side():
                release.make_wait(side)
                with streams.timed("transfer", side):
                    data = item[0].tensor[len(entry.header):entry.total]
                    streams.copy(slot[:entry.layout.data_bytes], data, non_blocking=item[0].pinned and side is not None)
                fence = streams.record(side)
        except IOStuckError:
            self.staging.quarantine(item)  # a request may still be inside preadv: never reuse buffer or descriptor
            item = None
            self._stuck.append(f"the read of {entry.path}")
            raise
        finally:
            if item is not None and not running:
                self._drop_read(fd, item, fence)
            elif item is not None:  # after an error or an interrupt, requests may still run: clean up once they stop
                self._drop_after(futures, fd, item, fence, slot if self._host_slot(slot) else None)
        return fence

    def _drop_after(self, futures: List[cf.Future], fd, item: list, fence: Fence,
                    direct: Optional[torch.Tensor]) -> None:
        """Closes `fd` and gives `item` back once none of `futures` runs any more; until then the next load into
        `direct` (a host slot the requests fill) waits. Only in `file_sync`: `file_async` orders loads into a
        slot by their lane futures."""
        gate: cf.Future = cf.Future()
        if direct is not None and not self._lanes:
            self.filling[direct.data_ptr()] = gate
        when_done(futures, functools.partial(self._drop_read, fd, item, fence, gate))

    def _drop_read(self, fd, item: list, fence: Fence = DONE, gate: Optional[cf.Future] = None) -> None:
        try:
            fd.close()
        finally:  # a close that fails still gives the place back and lets the next load into the slot go on
            try:
                self.staging.release(item, fence)
            finally:
                if gate is not None:
                    gate.set_result(None)

    def _abandon_opened(self, future: cf.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        item, fd, futures = future.result()
        when_done(futures, functools.partial(self._drop_read, fd, item))
