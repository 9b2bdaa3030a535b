"""Growing layers in the file tiers: one file per layer, each block appended once at the file's end.

A block of tokens (`blocks.Block`: K then V, flat, a multiple of 4 KiB) is copied into a page-aligned host buffer
at `append` and written at the next free offset by the tier's write lane (one thread, first in first out), its
xxh3-64 digest taken from the bytes written and kept in memory. A prefix is read back as one request of its whole
blocks (adjacent on disk), each block's digest checked before its tokens reach the slot: a block changed on disk
is a `KVFileError` naming the file, never wrong K/V. Nothing already in a file is written again. The files live
in the tier's private directory, which goes with the tier.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Deque, Dict, Hashable, Iterator, List, Optional

import torch

from ...host.devices import DONE, Fence
from ...layout import layout_for, views
from . import fileos
from ..base import LOADED, Pending, TierContext
from ..blocks import Block, covering, into, next_at
from .fileio import KVFileError, KVWriteError, corrupted, digest, pread_exact
from .filesave import pwrite_all
from .iopool import IOPool, wait_all

QUEUED_WRITES = 8  # blocks whose write may wait behind the disk before an append waits for the oldest


@dataclass
class GrowingFile:
    path: str
    handle: fileos.Handle
    blocks: List[Block] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)  # each block's place in the file
    digests: List[Optional[int]] = field(default_factory=list)  # set by the block's write
    writes: List[Future] = field(default_factory=list)
    size: int = 0  # bytes the blocks appended so far take (written or queued)


class GrowingFiles:
    """The growing layers of one file tier (`file.FileTier` delegates `append`, `load_prefix`, `drop_growing`)."""

    def __init__(self, ctx: TierContext, directory: str, cache_mode: str, write: IOPool, read: Optional[IOPool],
                 names: Iterator[int]):
        self._ctx, self.directory, self.cache_mode = ctx, directory, cache_mode
        self._write, self._read, self._names = write, read, names
        self._files: Dict[Hashable, GrowingFile] = {}
        self._queued: Deque[Future] = deque()  # writes not yet waited for, oldest first
        self.written = 0  # bytes on disk (blocks whose write finished)
        self.failed: Optional[BaseException] = None

    def _file(self, key: Hashable) -> GrowingFile:
        f = self._files.get(key)
        if f is None:
            path = os.path.join(self.directory, f"grow-{next(self._names):05d}.kv")
            fs = fileos.current()
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
            f = self._files[key] = GrowingFile(path, fs.open(path, flags, cache_mode=self.cache_mode))
        return f

    def append(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, at: int) -> Fence:
        if self.failed is not None:
            raise KVWriteError(f"KV offload: an earlier block in {self.directory!r} could not be written "
                               f"({self.failed}); this store takes no more blocks.") from self.failed
        f = self._file(key)
        next_at(f.blocks, key, at, k.shape[1])
        layout = layout_for(k, v)
        streams = self._ctx.streams
        buf = self._ctx.allocator.alloc(layout.data_bytes, spare=True)
        try:
            side = streams.side
            if side is not None:  # ordered after the consumer's write of the block, before any later load into its slot
                streams.record().make_wait(side)
            with streams.on_side(), streams.timed("transfer", side):
                dst_k, dst_v = views(buf.tensor, layout)
                streams.copy(dst_k, k, non_blocking=buf.pinned and side is not None)
                streams.copy(dst_v, v, non_blocking=buf.pinned and side is not None)
            fence = streams.record(side)
        except BaseException:
            self._ctx.allocator.free(buf, spare=True)
            raise
        index, offset = len(f.blocks), f.size
        f.blocks.append(Block(at, k.shape[1], layout))
        f.offsets.append(offset)
        f.digests.append(None)
        f.size += layout.data_bytes

        def write() -> None:
            try:
                fence.synchronize()  # the copy into the buffer has finished
                view = buf.memory()[:layout.data_bytes]
                pwrite_all(f.handle, view, offset, f.path)
                f.digests[index] = digest(view)
                self.written += layout.data_bytes
            except BaseException as exc:
                self.failed = self.failed or exc
                raise
            finally:
                self._ctx.allocator.free(buf, spare=True)

        self._write.submit(write, f"the append to {f.path}", into=f.writes)
        self._queued.append(f.writes[-1])
        if len(self._queued) > QUEUED_WRITES:  # the disk sets the pace: a few blocks' staging in host RAM at most
            wait_all([self._queued.popleft()], f"the append to {f.path}")
        return fence

    def load(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, release: Fence) -> Pending:
        f = self._files.get(key)
        blocks = covering(f.blocks if f is not None else [], k.shape[1], key)
        if not blocks:
            return LOADED
        count = len(blocks)
        total = f.offsets[count - 1] + blocks[-1].layout.data_bytes

        def read() -> Fence:
            try:
                wait_all(f.writes[:count], f"the appends to {f.path}")
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                raise KVFileError(f"KV layer file {f.path!r} was never written whole ({exc}).") from exc
            staging = self._ctx.allocator.alloc(total, spare=True)
            try:
                mem = staging.memory()
                pread_exact(f.handle, mem[:total], 0, f.path)
                for i, block in enumerate(blocks):
                    off, n = f.offsets[i], block.layout.data_bytes
                    if digest(mem[off:off + n]) != f.digests[i]:
                        raise corrupted(f.path, off, n)
                return self._copy(staging, f, blocks, k, v, release)
            finally:
                self._ctx.allocator.free(staging, spare=True)

        if self._read is None:
            return Pending(read())
        return Pending(future=self._read.submit(read, f"the read of {f.path}"))

    def _copy(self, staging, f: GrowingFile, blocks: List[Block], k, v, release: Fence) -> Fence:
        """The checked blocks into the slot's token ranges; waits for the copies (the staging is freed next)."""
        streams = self._ctx.streams
        side = streams.side
        with streams.on_side():
            release.make_wait(side)
            with streams.timed("transfer", side):
                for i, block in enumerate(blocks):
                    src_k, src_v = views(staging.tensor, block.layout, f.offsets[i])
                    dst_k, dst_v = into(k, v, block)
                    streams.copy(dst_k, src_k, non_blocking=staging.pinned and side is not None)
                    streams.copy(dst_v, src_v, non_blocking=staging.pinned and side is not None)
            fence = streams.record(side)
        fence.synchronize()
        return DONE

    def drop(self, key: Hashable) -> None:
        f = self._files.pop(key, None)
        if f is not None:
            wait_all(f.writes, f"the appends to {f.path}")
            self.written -= f.size
            f.handle.close()
            fileos.current().unlink(f.path)

    def flush(self) -> None:
        """Waits until every block appended so far is on disk; raises the first write error."""
        for f in list(self._files.values()):
            wait_all(list(f.writes), f"the appends to {f.path}")

    def nbytes(self) -> int:
        return self.written

    def count(self) -> int:
        return len(self._files)

    def close(self) -> None:
        """Closes every layer file (the tier's I/O has stopped); the tier deletes the directory."""
        for f in self._files.values():
            if f.handle.fd >= 0:
                f.handle.close()
        self._files.clear()
        self.written = 0
