"""Writing layer files for the file tiers: chunked, checksummed, atomic, and safe to interrupt anywhere.

A layer is copied chunk by chunk (on the consumer's stream) into a write staging buffer, each chunk's write
queued to the I/O threads as soon as it is copied, so the copy overlaps the writes; its checksum is computed
beside the I/O by the hash threads. The file is created under a temp name with its whole size allocated first
(a full disk fails right there, in `put`), the header with the chunk digests goes last, and a rename makes it
whole. `file_sync` finishes each layer inline; `file_async` on its write lane (one thread, first in first out).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Hashable, List, Optional

import torch

from ..devices import Fence
from ..layout import LayerLayout, copy_in, copy_range, safetensors_header
from . import fileio
from .base import TierContext
from .fileio import CHECKSUM, KVWriteError, chunks, digest, discard, finish_write, pwrite_all, reserve
from .iopool import IOPool, IOStuckError, Then, wait_all, when_done
from .staging import StagingPool

FORMAT = {"format": "kv_offload.layer", "version": "2"}


@dataclass
class LayerFile:
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


def layer_header(key: Hashable, layout: LayerLayout, digests: List[int]) -> bytes:
    meta = dict(FORMAT, key=repr(key)[:200], checksum=CHECKSUM, chunk_bytes=str(fileio.CHUNK),
                digests=",".join(f"{d:016x}" for d in digests))
    return safetensors_header(layout, meta)


class Writer:
    """The write path of one file store: its write staging, the writes in flight, the first write error."""

    def __init__(self, ctx: TierContext, directory: str, cache_mode: str, chunks: IOPool, hashes: IOPool,
                 lane: Optional[IOPool], stuck: List[str]):
        self._ctx, self.directory, self.cache_mode = ctx, directory, cache_mode
        self._chunks, self._hashes, self._lane, self._stuck = chunks, hashes, lane, stuck
        self.staging = StagingPool(ctx.allocator, 1 if lane is None else 2, "write")
        self.failed: Optional[BaseException] = None
        self._writing = 0  # writes queued or running (their staging is busy); changed under _count_lock
        self._count_lock = threading.Lock()

    def trim_if_idle(self) -> None:
        """Frees the write staging once no write is in flight (extraction is over: it would only hold RAM)."""
        if self._writing == 0 and self.staging.buffers():
            self.staging.trim()

    def write(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout, path: str) -> LayerFile:
        """Starts writing layer `key` to `path`; returns its entry (`written` once the file is whole)."""
        if self.failed is not None:
            raise KVWriteError(f"KV offload: an earlier layer file in {self.directory!r} could not be written "
                               f"({self.failed}); this store takes no more layers.") from self.failed
        pieces = chunks(0, layout.data_bytes)
        entry = LayerFile(path, layer_header(key, layout, [0] * len(pieces)), layout)
        job = _Write(f"{entry.path}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._count(+1)
            job.item = self.staging.acquire(entry.total)
            job.fd = reserve(job.tmp, entry.total, self.cache_mode)  # a full disk fails here, before any write
            self._queue_writes(job, entry, k, v, pieces)
            if self._lane is not None:
                lane = self._lane.submit(functools.partial(self._finish_write, key, entry, job),
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
        return entry

    def _queue_writes(self, job: "_Write", entry: LayerFile, k: torch.Tensor, v: torch.Tensor, pieces) -> None:
        """Copies the layer into the write staging and queues a write per chunk (its checksum follows on the
        hash threads).

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

    def _finish_write(self, key, entry: LayerFile, job: "_Write") -> None:
        if not job.claim():
            return  # an interrupt in `write` got there first and cleans up
        item, fd_open = job.item, True
        try:
            digests = wait_all(job.chunks, f"the write of {entry.path}")
            header = layer_header(key, entry.layout, digests)
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
                self.staging.quarantine(item)
                self._stuck.append(f"the write of {entry.path}")
            elif fd_open:
                when_done(job.chunks, functools.partial(self._release_write, job))
            else:
                self.staging.release(item, item[1])
            item = None
            if isinstance(exc, KVWriteError) and self.failed is None:
                self.failed = exc
            raise
        finally:
            if item is not None:
                self.staging.release(item, item[1])
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
            self.staging.release(job.item, job.item[1])  # keeps the copy's fence: the next user waits for it
