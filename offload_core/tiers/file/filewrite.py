"""Writing layer files for the file tiers: chunked, checksummed, atomic, and safe to interrupt anywhere.

Each chunk is copied on the consumer's stream into a free buffer of a small staging ring and its write queued at
once; the I/O thread that writes it takes its digest and frees the buffer. Once every chunk is on disk, the write
lane (one thread, first in first out) writes the header with the digests and renames the file whole (design:
docs/engine.md, "Layers, files and failures")."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import uuid
from dataclasses import dataclass, field
from typing import Hashable, List, Optional, Tuple

import torch

from ...host.hostmem import HostBuffer
from ...layout import LayerLayout, copy_range, safetensors_header
from . import fileos
from ..base import TierContext
from .fileos import Handle
from .fileio import CHECKSUM, KVWriteError, chunks, digest
from .filesave import discard, finish_write, pwrite_all, reserve
from .iopool import IOPool, IOStuckError, wait_all, when_done
from .staging import StagingPool

FORMAT = {"format": "kv_offload.layer", "version": "2"}


@dataclass
class LayerFile:
    path: str
    header: bytes
    layout: LayerLayout
    chunk: int  # bytes per chunk (the last one may be shorter): one request, one digest
    digests: List[int] = field(default_factory=list)
    write: Optional[cf.Future] = None
    written: bool = False  # the file is complete on disk (counted in stats only from then on)

    @property
    def total(self) -> int:
        return len(self.header) + self.layout.data_bytes

    @property
    def extents(self) -> List[Tuple[int, int]]:
        """(offset, length) of the file's header and of its data, allocated apart (`fileos.FileOS.reserve`)."""
        return [(0, len(self.header)), (len(self.header), self.layout.data_bytes)]


@dataclass
class _Write:
    """One layer file being written. Its finish cleans it up, or, if the finish never runs (never queued, or
    cancelled), `Writer._drop_write` does: exactly one of them, as a descriptor closed twice may be another file's."""
    tmp: str
    file: Optional[Handle] = None  # open from its reserve until its finish or cleanup closes it
    chunks: List[cf.Future] = field(default_factory=list)
    lane: List[cf.Future] = field(default_factory=list)  # the finish, queued on the write lane


def layer_chunk(data_bytes: int, request: int) -> int:
    """Bytes per chunk (one request, one digest): `request`, or for a layer under four of them a quarter of the layer
    rounded up to a power of two, >= `fileos.RESERVE_GRAIN`: disks want several (docs/benchmark.md, "Layer size")."""
    quarter = 1 << max(0, data_bytes // 4 - 1).bit_length()
    return min(request, max(fileos.RESERVE_GRAIN, quarter))


def layer_header(key: Hashable, layout: LayerLayout, digests: List[int], chunk: int) -> bytes:
    meta = dict(FORMAT, key=repr(key)[:200], checksum=CHECKSUM, chunk_bytes=str(chunk),
                digests=",".join(f"{d:016x}" for d in digests))
    return safetensors_header(layout, meta)


class Writer:
    """The write path of one file store: its ring of chunk staging buffers, the writes in flight, the first error."""

    def __init__(self, ctx: TierContext, directory: str, cache_mode: str, chunk: int, chunks: IOPool, lane: IOPool,
                 stuck: List[str]):
        self._ctx, self.directory, self.cache_mode, self.chunk = ctx, directory, cache_mode, chunk
        self._chunks, self._lane, self._stuck = chunks, lane, stuck
        # A chunk per I/O thread and two more: the disk's queue stays full while the consumer copies the next.
        self.staging = StagingPool(ctx.allocator, chunks.workers + 2, "write")
        self.failed: Optional[BaseException] = None
        self._writing = 0  # layers queued or being written; changed under _count_lock
        self._count_lock = threading.Lock()

    def trim_if_idle(self) -> None:
        """Frees the write staging once no write is in flight (the capture is over: it would only hold RAM)."""
        if self._writing == 0 and self.staging.buffers():
            self.staging.trim()

    def write(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout, path: str) -> LayerFile:
        """Starts writing layer `key` to `path`; returns its entry (`written` once the file is whole) once the last
        chunk's copy out of `k`/`v` is done or, on a device, queued. A later failure is raised by the next `write`,
        by `flush` or by the read of that layer."""
        if self.failed is not None:
            raise KVWriteError(f"KV offload: an earlier layer file in {self.directory!r} could not be written "
                               f"({self.failed}); this store takes no more layers.") from self.failed
        chunk = layer_chunk(layout.data_bytes, self.chunk)
        pieces = chunks(0, layout.data_bytes, chunk)
        entry = LayerFile(path, layer_header(key, layout, [0] * len(pieces), chunk), layout, chunk)
        job = _Write(f"{entry.path}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._count(1)
            job.file = reserve(job.tmp, entry.extents, self.cache_mode)  # a full disk fails here, before any write
            self._queue_writes(job, entry, k, v, pieces)
            self._lane.submit(functools.partial(self._finish_write, key, entry, job), f"the write of {entry.path}",
                              into=job.lane, done=functools.partial(self._cancelled_write, job))
        except BaseException:  # stopped before its finish took over: dropped once its chunk writes end
            if job.lane:
                job.lane[0].cancel()  # if it never ran, `_cancelled_write` drops the write; a running one cleans up
            else:
                self._drop_write(job)
            raise
        entry.write = job.lane[0]
        return entry

    def _queue_writes(self, job: "_Write", entry: LayerFile, k: torch.Tensor, v: torch.Tensor, pieces) -> None:
        """Copies the layer chunk by chunk into free staging buffers on the consumer's stream (after the producer,
        before anything that changes `k`/`v`), queueing each chunk's write once copied; a buffer wait is bounded."""
        streams, base = self._ctx.streams, len(entry.header)
        size = pieces[0][1] if pieces else 0

        def write_chunk(item: list, offset: int, n: int) -> int:
            try:
                item[1].synchronize()  # the copy into the buffer has finished
                view = item[0].memory()[:n]
                pwrite_all(job.file, view, offset, job.tmp, entry.total)
                return digest(view)
            finally:  # before the future completes: a wait for the chunk finds its buffer back (never if stuck)
                self.staging.release(item, item[1])

        def never_ran(item: list, future: cf.Future) -> None:
            if future.cancelled():  # cancelled (close, a failed chunk): its buffer is still to give back
                self.staging.release(item, item[1])

        for off, n in pieces:
            queued, held = len(job.chunks), []
            try:
                self.staging.acquire(size, into=held)
                buffer = held[0][0]
                with streams.timed("transfer"):
                    streams.copy_with(functools.partial(copy_range, buffer.tensor, entry.layout, k, v, off, off + n,
                                                        non_blocking=buffer.pinned), buffer.tensor, k, v,
                                      non_blocking=buffer.pinned)
                held[0][1] = streams.record()  # the staging pool waits for this copy before the buffer's next use
                item = held[0]
                self._chunks.submit(functools.partial(write_chunk, item, base + off, n), f"the write of {entry.path}",
                                    into=job.chunks, done=functools.partial(never_ran, item))
            except BaseException:
                if held and len(job.chunks) == queued:  # not handed to a request: still ours to give back
                    self.staging.release(held[0], held[0][1])
                raise

    def _cancelled_write(self, job: "_Write", future: cf.Future) -> None:
        if future.cancelled():  # by close() or by `write`'s own failure: the finish never ran, so its cleanup is here
            self._drop_write(job)

    def _count(self, n: int) -> None:
        with self._count_lock:
            self._writing += n

    def _finish_write(self, key, entry: LayerFile, job: "_Write") -> None:
        fd_open, head = True, None
        try:
            digests = wait_all(job.chunks, f"the write of {entry.path}")
            header = layer_header(key, entry.layout, digests, entry.chunk)
            assert len(header) == len(entry.header), "digests are fixed-width: the header keeps its size"
            head = HostBuffer(len(header))  # page-aligned, as O_DIRECT needs; a few KiB
            with head.memory() as mem:
                mem[:len(header)] = header
                pwrite_all(job.file, mem[:len(header)], 0, job.tmp, entry.total)
            entry.header, entry.digests = header, digests
            fd_open, f, job.file = False, job.file, None
            finish_write(f, job.tmp, entry.path, self.cache_mode, entry.total)  # closes fd, renames or discards
            entry.written = True
        except BaseException as exc:
            if isinstance(exc, IOStuckError):
                # A request may still be in pwrite: its buffer and descriptor stay held (a recycled descriptor number
                # would let it write into another file); if it ever returns, they and the temp file go, as below.
                self._stuck.append(f"the write of {entry.path}")
            if fd_open:  # once none of the chunk requests runs any more
                when_done(job.chunks, functools.partial(self._release_write, job))
            if isinstance(exc, (KVWriteError, IOStuckError)) and self.failed is None:
                self.failed = exc
            raise
        finally:
            if head is not None:
                head.release()
            self._count(-1)  # last: a load that sees 0 may free the staging

    def _drop_write(self, job: "_Write") -> None:
        """Cleanup of a write whose finish never runs: once none of its chunk requests runs any more."""
        self._count(-1)
        when_done(job.chunks, functools.partial(self._release_write, job))

    def _release_write(self, job: "_Write") -> None:
        f, job.file = job.file, None
        try:
            if f is not None:
                f.close()  # before the delete, which Windows refuses for an open file
        finally:
            discard(job.tmp)  # also one whose reserve an interrupt stopped after the file was made
