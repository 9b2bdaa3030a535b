"""`file_sync` / `file_async` tiers: one safetensors-compatible file per layer in a private directory.

Writes: the layer is copied (on the consumer's stream, so later kernels cannot change it first) into a write
staging buffer; its file is created under a temp name with the whole size allocated (a full disk fails right
there, in `put`); `IO_DEPTH` I/O threads then hash and write it in chunks, the header with the chunk digests
goes last, and a rename makes the file whole. Reads: the file is opened and checked (a regular file of the
right size), read in chunks by the same threads into a read staging buffer, every chunk's digest and the
header compared with what this store wrote, then the data is copied into the device slot. A CPU consumer's
slots are page-aligned (`new_slot`), so there the chunks are read straight into the slot, with no copy.

`file_async` runs the per-layer steps on lanes (one thread each, first-in-first-out, so a layer's read follows
its write and copies into a slot stay in order): one that finishes writes, one that starts reads and one that
finishes them, so the next layer's chunks are queued while this one's complete and the disk never idles
between layers. `file_sync` runs the same steps inline. Reads and writes have separate staging pools, so a
`put` never waits for a buffer that a read holds (and the other way round); every wait is bounded, and
`close()` walks away from I/O stuck in the kernel instead of hanging.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional

import torch

from ..devices import DONE, Fence
from ..hostmem import HostBuffer
from ..layout import LayerLayout, copy_in, copy_range, safetensors_header
from .base import Pending, Tier, TierContext
from . import fileio
from .fileio import (CHECKSUM, KVFileError, KVWriteError, checksum_module, chunks, corrupted, digest, discard,
                     drop_pages, finish_write, header_matches, open_checked, pread_exact, probe_page_cache_mode,
                     pwrite_all, ram_backed, reserve)
from .fileowner import OwnedDir
from .iopool import IOPool, IOStuckError, Then, io_timeout, wait_all, when_done
from .staging import StagingPool

log = logging.getLogger(__name__)

FORMAT = {"format": "kv_offload.layer", "version": "2"}
# Requests in flight per store. Measured on the ext4 virtual disk this was developed on: one 8 MiB stream
# reaches about 60 % of the disk, four reach its limit, more add nothing; `python -m offload_core stream`
# measures it on yours (KV_OFFLOAD_IO_DEPTH overrides it).
IO_DEPTH = int(os.environ["KV_OFFLOAD_IO_DEPTH"]) if os.environ.get("KV_OFFLOAD_IO_DEPTH", "").isdigit() else 4
IO_DEPTH = min(max(IO_DEPTH, 1), 64)
# Threads checksumming chunks (xxh3 runs at about 10 GiB/s a thread, releasing the GIL): two keep up with an
# NVMe drive and never delay a request, since the I/O threads hand them each chunk and go on.
HASH_THREADS = 2


@dataclass
class _LayerFile:
    path: str
    header: bytes
    layout: LayerLayout
    digests: List[int] = field(default_factory=list)
    write: Optional[cf.Future] = None
    written: bool = False  # the file is complete on disk (counted in stats only from then on)

    @property
    def total(self) -> int:
        return len(self.header) + self.layout.data_bytes


@dataclass
class _Write:
    """One layer file being written. Whoever claims it first cleans it up: its finish, or, if that never
    started, the interrupt or cancellation that stopped it (never both: a descriptor closed twice may be
    another file's by then)."""
    tmp: str
    item: Optional[list] = None  # [write staging buffer, fence of the last copy into it]
    fd: int = -1
    chunks: List[cf.Future] = field(default_factory=list)
    lane: List[cf.Future] = field(default_factory=list)  # file_async: the finish, queued on the write lane
    _claimed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> bool:
        with self._lock:
            first, self._claimed = not self._claimed, True
        return first


def _header(key: Hashable, layout: LayerLayout, digests: List[int]) -> bytes:
    meta = dict(FORMAT, key=repr(key)[:200], checksum=CHECKSUM, chunk_bytes=str(fileio.CHUNK),
                digests=",".join(f"{d:016x}" for d in digests))
    return safetensors_header(layout, meta)


class FileTier(Tier):
    name = "file"

    def __init__(self, ctx: TierContext, parent_dir: Optional[str], bypass: bool, asynchronous: bool):
        checksum_module()  # a missing checksum package fails before anything is made
        self._ctx = ctx
        # A fresh directory of our own, also inside a caller's `file_dir`, locked while we live: close() deletes
        # exactly it, and a later store reclaims it if this process dies first.
        self._owner = OwnedDir(parent_dir, "kv_offload-")
        self.directory = self._owner.path
        self._closed = False
        try:
            self.cache_mode = probe_page_cache_mode(self.directory, bypass)
            self.ram_fs = ram_backed(self.directory)
        except BaseException:
            self._owner.delete()
            raise
        self.note = None
        if self.ram_fs is not None:
            self.note = (f"{self.directory} is on {self.ram_fs}, which keeps files in RAM: the file tier saves no "
                         "RAM here; point `file_dir` at a disk, or use a RAM mode")
            log.warning("KV offload: %s.", self.note)
        self._chunks = IOPool(IO_DEPTH, "kv_offload_io")
        self._hashes = IOPool(HASH_THREADS, "kv_offload_hash")  # checksums, beside the I/O, in completion order
        self._lanes = {name: IOPool(1, f"kv_offload_{name}") for name in ("write", "read_start", "read_finish")} \
            if asynchronous else {}
        self._reads = StagingPool(ctx.allocator, max(ctx.depth, 0) + 1, "read")
        self._writes = StagingPool(ctx.allocator, 2 if asynchronous else 1, "write")
        self._files: Dict[Hashable, _LayerFile] = {}
        self._failed: Optional[BaseException] = None
        self._stuck: List[str] = []
        self._filling: Dict[int, cf.Future] = {}  # host slot address -> the last load queued into it
        self._host_slots: Dict[int, HostBuffer] = {}  # page-aligned CPU slots made by new_slot, by address
        self._writing = 0  # writes queued or running (their staging is busy); changed under _count_lock
        self._count_lock = threading.Lock()

    # -- writing ---------------------------------------------------------------------------------------------
    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        if self._failed is not None:
            raise KVWriteError(f"KV offload: an earlier layer file in {self.directory!r} could not be written "
                               f"({self._failed}); this store takes no more layers.") from self._failed
        pieces = chunks(0, layout.data_bytes)
        entry = _LayerFile(os.path.join(self.directory, f"layer-{len(self._files):05d}.safetensors"),
                           _header(key, layout, [0] * len(pieces)), layout)
        job = _Write(f"{entry.path}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._count(+1)
            job.item = self._writes.acquire(entry.total)
            job.fd = reserve(job.tmp, entry.total, self.cache_mode)  # a full disk fails here, before any write
            self._queue_writes(job, entry, k, v, pieces)
            if "write" in self._lanes:
                lane = self._lanes["write"].submit(functools.partial(self._finish_write, key, entry, job),
                                                   f"the write of {entry.path}", into=job.lane)
                lane.add_done_callback(functools.partial(self._cancelled_write, job))
            else:
                self._finish_write(key, entry, job)
        except BaseException:
            # Failed or interrupted before its finish took over: the chunk writes are waited for (or cancelled),
            # then the descriptor, the temp file and the buffer go. A finish that already runs cleans up itself.
            if not job.lane or job.lane[0].cancel():
                self._drop_write(job)
            raise
        entry.write = job.lane[0] if job.lane else None
        self._files[key] = entry

    def _queue_writes(self, job: "_Write", entry: _LayerFile, k: torch.Tensor, v: torch.Tensor, pieces) -> None:
        """Copies the layer into the write staging and queues a hash-and-write request per chunk.

        Chunk by chunk where `k` and `v` are contiguous: each chunk's write is queued as soon as it is copied, so
        the copy of a layer overlaps its writes instead of coming before them. The copies run on the consumer's
        stream: ordered after the producer and before anything that changes `k`/`v`.
        """
        streams, buffer = self._ctx.streams, job.item[0]
        base, mem = len(entry.header), buffer.memory()
        data = buffer.tensor[base:entry.total]
        pinned = buffer.pinned

        def write_chunk(off: int, n: int, copied: Fence) -> Then:
            copied.synchronize()
            view = mem[base + off:base + off + n]
            pwrite_all(job.fd, view, base + off, job.tmp)
            return Then(functools.partial(digest, view), self._hashes)  # the worker takes the next request first

        by_chunk = k.is_contiguous() and v.is_contiguous()
        if not by_chunk:
            with streams.timed("transfer"):
                copy_in(data, entry.layout, k, v, non_blocking=pinned)
            job.item[1] = streams.record()
        for off, n in pieces:
            if by_chunk:
                with streams.timed("transfer"):
                    copy_range(data, entry.layout, k, v, off, off + n, non_blocking=pinned)
                job.item[1] = streams.record()  # the last copy: the staging pool waits for it before reuse
            self._chunks.submit(functools.partial(write_chunk, off, n, job.item[1]), f"the write of {entry.path}",
                                into=job.chunks)

    def _cancelled_write(self, job: "_Write", future: cf.Future) -> None:
        if future.cancelled():  # by close(): the finish never ran, so its cleanup happens here
            self._drop_write(job)

    def _count(self, change: int) -> None:
        with self._count_lock:
            self._writing += change

    def _finish_write(self, key, entry: _LayerFile, job: "_Write") -> None:
        if not job.claim():
            return  # an interrupt in `store` got there first and cleans up
        item, fd_open = job.item, True
        try:
            digests = wait_all(job.chunks, f"the write of {entry.path}")
            header = _header(key, entry.layout, digests)
            assert len(header) == len(entry.header), "digests are fixed-width: the header keeps its size"
            mem = item[0].memory()
            mem[:len(header)] = header
            pwrite_all(job.fd, mem[:len(header)], 0, job.tmp)
            entry.header, entry.digests = header, digests
            fd_open, fd, job.fd = False, job.fd, -1
            finish_write(fd, job.tmp, entry.path, self.cache_mode, entry.total)  # closes fd, renames or discards
            entry.written = True
        except BaseException as exc:
            if isinstance(exc, IOStuckError):
                # A request may still be inside pwrite: its buffer and descriptor are never reused (no later
                # request may write through a recycled descriptor number into another file).
                self._writes.quarantine(item)
                self._stuck.append(f"the write of {entry.path}")
            elif fd_open:
                when_done(job.chunks, functools.partial(self._release_write, job))
            else:
                self._writes.release(item, item[1])
            item = None
            if isinstance(exc, KVWriteError) and self._failed is None:
                self._failed = exc
            raise
        finally:
            if item is not None:
                self._writes.release(item, item[1])
            self._count(-1)  # last: a load that sees 0 may free this buffer

    def _drop_write(self, job: "_Write") -> None:
        """Cleanup of a write whose finish never ran: once none of its chunk requests runs any more."""
        if job.claim():
            self._count(-1)
            when_done(job.chunks, functools.partial(self._release_write, job))

    def _release_write(self, job: "_Write") -> None:
        if job.fd >= 0:
            os.close(job.fd)
            job.fd = -1
            discard(job.tmp)
        if job.item is not None:
            self._writes.release(job.item, job.item[1])  # keeps the copy's fence: the next user waits for it

    # -- reading ---------------------------------------------------------------------------------------------
    def new_slot(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """On a CPU, a page-aligned slot, which `O_DIRECT` reads fill directly: no staging copy, no staging RAM."""
        if device.type != "cpu":
            return super().new_slot(nbytes, device)
        buf = HostBuffer(nbytes)
        self._host_slots[buf.tensor.data_ptr()] = buf  # kept until close: a stuck read may still fill it
        return buf.tensor

    def release_slot(self, slot: torch.Tensor) -> None:
        """Frees a host slot made by `new_slot` now (the store parks between requests), unless a read may still
        fill it: one stuck in the kernel keeps its slot until close, as before."""
        address = slot.data_ptr()
        filling = self._filling.get(address)
        if filling is not None and not filling.done():
            return
        self._filling.pop(address, None)
        buf = self._host_slots.pop(address, None)
        if buf is not None:
            buf.release()

    def _host_slot(self, slot: torch.Tensor) -> bool:
        """True where the I/O threads may fill `slot` directly: host memory that no queued stream work can still
        read (a real CPU device; not a model of CUDA ordering, where the consumer's kernels may lag)."""
        return slot.device.type == "cpu" and self._ctx.streams.immediate

    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        entry = self._files[key]
        if self._writing == 0 and self._writes.buffers():
            self._writes.trim()  # extraction is over: its staging would only hold host RAM from now on
        # A host slot is filled chunk by chunk by the I/O threads as the chunks arrive, instead of in one copy
        # after the whole read (on a CPU that copy costs as much as the read). A device slot gets one copy on
        # the side stream, ordered by fences.
        direct = slot if self._host_slot(slot) else None
        # Loads into one slot never overlap: a later one starts filling it only once the earlier one is done.
        previous = self._filling.get(slot.data_ptr()) if direct is not None else None
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
            self._filling[slot.data_ptr()] = finished
        # Cancelled by close() after its start ran: the opened file and the buffer go back here.
        finished.add_done_callback(lambda f: started.add_done_callback(self._abandon_opened) if f.cancelled() else None)
        return Pending(future=finished)

    def _start_read(self, entry: _LayerFile, direct: Optional[torch.Tensor] = None,
                    previous: Optional[cf.Future] = None):
        """Checks the file and queues its chunk reads (which also fill `direct`, a host slot, if given);
        returns (staging item, fd, futures)."""
        if previous is not None:
            try:
                previous.result(timeout=io_timeout())
            except cf.TimeoutError:
                if not previous.done():
                    raise TimeoutError(f"KV offload: reading {entry.path!r} waited {io_timeout():g} s for an earlier "
                                       "read into the same buffer; the disk is not answering.") from None
            except BaseException:
                pass  # the earlier load failed: it no longer writes into the slot
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
        item = self._reads.acquire(base if target is not None else entry.total)  # the slot takes the data
        try:
            fd = open_checked(entry.path, entry.total, self.cache_mode)
        except BaseException:
            self._reads.release(item)
            raise
        mem = item[0].memory()
        into = target.memory() if target is not None else None

        def read_chunk(off: int, n: int, expected: Optional[int]) -> Optional[Then]:
            view = into[off - base:off - base + n] if into is not None and expected is not None else mem[off:off + n]
            pread_exact(fd, view, off, entry.path)
            if expected is None:
                bad = header_matches(view, entry.header)
                if bad is not None:
                    raise KVFileError(f"KV layer file {entry.path!r} is corrupted: its header differs from what this "
                                      f"store wrote (first at byte {bad}). It was modified while in use.")
                return None
            return Then(functools.partial(check_chunk, view, off, n, expected), self._hashes)  # next request first

        def check_chunk(view: memoryview, off: int, n: int, expected: int) -> None:
            if digest(view) != expected:
                raise corrupted(entry.path, off, n)
            if direct is not None and into is None:
                with self._ctx.streams.timed("transfer"):
                    direct[off - base:off - base + n].copy_(item[0].tensor[off:off + n])

        jobs = [(0, base, None)] + [(base + off, n, d) for (off, n), d in zip(chunks(0, entry.layout.data_bytes),
                                                                           entry.digests)]
        what = f"the read of {entry.path}"
        futures: List[cf.Future] = []
        try:
            for job in jobs:
                self._chunks.submit(functools.partial(read_chunk, *job), what, into=futures)
        except BaseException:  # the requests already queued may run: fd and buffer go once they have stopped
            when_done(futures, functools.partial(self._drop_read, fd, item))
            raise
        return item, fd, futures

    def _finish_read(self, entry: _LayerFile, slot: torch.Tensor, release: Fence, opened) -> Fence:
        item, fd, futures = opened
        fence = DONE
        try:
            wait_all(futures, f"the read of {entry.path}")
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
            self._reads.quarantine(item)  # a request may still be inside preadv: never reuse buffer or descriptor
            item = None
            self._stuck.append(f"the read of {entry.path}")
            raise
        finally:
            if item is not None:  # after an interrupt, requests may still run: clean up once they stop
                gate: cf.Future = cf.Future()
                if self._host_slot(slot) and not self._lanes:  # (file_async orders loads by their futures)
                    self._filling[slot.data_ptr()] = gate  # the next load into this slot waits for them
                when_done(futures, functools.partial(self._drop_read, fd, item, fence, gate))
        return fence

    def _drop_read(self, fd: int, item: list, fence: Fence = DONE, gate: Optional[cf.Future] = None) -> None:
        os.close(fd)
        self._reads.release(item, fence)
        if gate is not None:
            gate.set_result(None)

    def _abandon_opened(self, future: cf.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        item, fd, futures = future.result()
        when_done(futures, functools.partial(self._drop_read, fd, item))

    def flush(self) -> None:
        """Waits (bounded) until every layer stored so far is on disk; raises the first write error."""
        wait_all([e.write for e in self._files.values() if e.write is not None], f"the writes in {self.directory}")

    # -- reporting and closing -------------------------------------------------------------------------------
    def nbytes(self) -> Dict[str, int]:
        staging = self._reads.buffers() + self._writes.buffers()
        return {
            "file": sum(e.total for e in list(self._files.values()) if e.written),  # snapshot (any thread); written only
            "host_pinned": sum(b.nbytes for b in staging if b.pinned),
            "host_pageable": sum(b.nbytes for b in staging if not b.pinned),
        }

    def info(self) -> Dict[str, object]:
        mode = self.cache_mode if self.ram_fs is None else f"{self.ram_fs}: in RAM"
        return {"page_cache": mode, "file_dir": self.directory, "files": sum(e.written for e in list(self._files.values()))}

    def _stop_io(self) -> List[str]:
        """Cancels queued I/O and waits (bounded, in total) for running I/O; returns what is still running."""
        deadline = time.monotonic() + io_timeout()
        stuck: List[str] = []
        for pool in [*self._lanes.values(), self._chunks, self._hashes]:  # each waits on the ones after it
            stuck += pool.shutdown(max(0.0, deadline - time.monotonic()))
        return stuck

    def close(self) -> None:
        """Stops the I/O (abandoning stuck threads), frees the staging, deletes the directory. Idempotent.

        An interrupt (Ctrl-C) inside close does not stop the cleanup: it is raised again once the directory
        is gone.
        """
        if self._closed:
            return
        self._closed = True
        interrupt: Optional[BaseException] = None
        stuck: List[str] = []
        for _ in range(3):
            try:
                stuck = self._stop_io()
                break
            except KeyboardInterrupt as exc:
                interrupt = exc
        stuck = sorted(set(stuck + self._stuck))
        if stuck:
            log.error("KV offload: closing %s left %d I/O request(s) stuck in the kernel behind (%s); their threads "
                      "and buffers are abandoned.", self.directory, len(stuck), "; ".join(stuck[:4]))
        try:
            self._reads.close(abandoned_io=bool(stuck))
            self._writes.close(abandoned_io=bool(stuck))
        except KeyboardInterrupt as exc:
            interrupt = interrupt or exc
        finally:
            self._files.clear()
            if not stuck:
                self._host_slots.clear()  # the store drops its slots too; nothing reads into them any more
            try:
                self._owner.delete()
            except KeyboardInterrupt as exc:
                interrupt = interrupt or exc
        if interrupt is not None:
            raise interrupt
