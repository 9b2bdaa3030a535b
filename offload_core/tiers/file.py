"""`file_sync` / `file_async` tiers: one safetensors-compatible file per layer in a private directory.

Writes: the layer is copied (on the consumer's stream, so later kernels cannot change it first) into a
staging buffer, then written atomically. Reads: the whole file goes into a staging buffer, its size and header
are checked against what this store wrote, then the data section is copied into the device slot.
`file_async` runs both on one background I/O thread (FIFO, so a layer's read always follows its write) and
copies to the device on the side stream; `file_sync` runs the same jobs inline. Staging is bounded to
`depth + 1` buffers, reused only after the copy out of them has finished.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional

import torch

from ..devices import DONE, Fence
from ..hostmem import HostAllocator, HostBuffer
from ..layout import LayerLayout, copy_in, safetensors_header
from .base import TRANSFER_TIMEOUT_S, Pending, Tier, TierContext
from .fileio import KVFileError, header_matches, probe_page_cache_mode, read_exact, write_atomic

FORMAT = {"format": "kv_offload.layer", "version": "1"}


@dataclass
class _LayerFile:
    path: str
    header: bytes
    layout: LayerLayout
    write: Optional[Future] = None

    @property
    def total(self) -> int:
        return len(self.header) + self.layout.data_bytes


class _StagingPool:
    """`count` reusable host buffers; a buffer comes back with the fence of the last copy out of it."""

    def __init__(self, allocator: HostAllocator, count: int):
        self._allocator = allocator
        self._free: "queue.Queue[list]" = queue.Queue()
        self._all: List[list] = [[None, DONE] for _ in range(count)]
        for item in self._all:
            self._free.put(item)

    def acquire(self, nbytes: int) -> list:
        try:
            item = self._free.get(timeout=TRANSFER_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"KV offload: no staging buffer came free in {TRANSFER_TIMEOUT_S:.0f} s") from None
        try:
            item[1].synchronize()  # the device copy out of this buffer has finished: safe to overwrite
            if item[0] is None or item[0].nbytes < nbytes:
                if item[0] is not None:
                    self._allocator.free(item[0])
                item[0] = None
                item[0] = self._allocator.alloc(nbytes)
        except BaseException:
            self._free.put(item)  # a failed allocation must not shrink the pool (the next acquire would hang)
            raise
        return item

    def release(self, item: list, fence: Fence = DONE) -> None:
        item[1] = fence
        self._free.put(item)

    def buffers(self) -> List[HostBuffer]:
        return [item[0] for item in self._all if item[0] is not None]

    def close(self) -> None:
        for item in self._all:
            item[1].synchronize()
            if item[0] is not None:
                self._allocator.free(item[0])
                item[0] = None


class FileTier(Tier):
    name = "file"

    def __init__(self, ctx: TierContext, parent_dir: Optional[str], bypass: bool, asynchronous: bool):
        self._ctx = ctx
        # Always a fresh directory of our own, also inside a caller's `file_dir`: close() deletes exactly it.
        self.directory = tempfile.mkdtemp(prefix="kv_offload-", dir=parent_dir)
        self.cache_mode = probe_page_cache_mode(self.directory, bypass)
        self._pool = _StagingPool(ctx.allocator, max(ctx.depth, 0) + 1)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv_offload_io") if asynchronous else None
        self._files: Dict[Hashable, _LayerFile] = {}

    def _run(self, job) -> Optional[Future]:
        if self._io is None:
            job()
            return None
        return self._io.submit(job)

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        header = safetensors_header(layout, dict(FORMAT, key=repr(key)[:200]))
        entry = _LayerFile(os.path.join(self.directory, f"layer-{len(self._files):05d}.safetensors"), header, layout)
        item = self._pool.acquire(entry.total)
        staging = item[0]
        try:
            staging.memory()[:len(header)] = header
            with self._ctx.streams.timed("transfer"):
                # On the consumer's stream: ordered after the producer and before anything that changes k/v.
                copy_in(staging.tensor[len(header):entry.total], layout, k, v, non_blocking=staging.pinned)
            copied = self._ctx.streams.record()
        except BaseException:
            self._pool.release(item)
            raise
        item[1] = copied  # if the write is cancelled, closing the pool still waits for this copy

        def write() -> None:
            try:
                copied.synchronize()
                write_atomic(entry.path, staging, entry.total, self.cache_mode)
            finally:
                self._pool.release(item)

        entry.write = self._run(write)
        self._files[key] = entry

    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        entry = self._files[key]
        streams = self._ctx.streams

        def read() -> Fence:
            if entry.write is not None and entry.write.exception() is not None:
                raise KVFileError(f"KV layer file {entry.path!r} was never written") from entry.write.exception()
            item = self._pool.acquire(entry.total)
            fence = DONE
            try:
                read_exact(entry.path, item[0], entry.total, self.cache_mode)
                bad = header_matches(item[0], entry.header)
                if bad is not None:
                    raise KVFileError(f"KV layer file {entry.path!r} is corrupted: its header differs from what "
                                      f"this store wrote (first at byte {bad}). It was modified while in use.")
                side = streams.side
                with streams.on_side():
                    release.make_wait(side)
                    with streams.timed("transfer", side):
                        data = item[0].tensor[len(entry.header):entry.total]
                        streams.copy(slot[:entry.layout.data_bytes], data, non_blocking=item[0].pinned and side is not None)
                    fence = streams.record(side)
            finally:
                self._pool.release(item, fence)
            return fence

        future = self._run(read)
        return Pending(future=future) if future is not None else Pending(DONE)

    def nbytes(self) -> Dict[str, int]:
        staging = self._pool.buffers()
        return {
            "file": sum(e.total for e in list(self._files.values())),  # a snapshot: stats() runs on any thread
            "host_pinned": sum(b.nbytes for b in staging if b.pinned),
            "host_pageable": sum(b.nbytes for b in staging if not b.pinned),
        }

    def info(self) -> Dict[str, object]:
        return {"page_cache": self.cache_mode, "file_dir": self.directory, "files": len(self._files)}

    def close(self) -> None:
        try:
            if self._io is not None:
                # Queued jobs are cancelled; a running one finishes (its reads and writes are bounded) before
                # we free the buffers it uses or delete the files it touches.
                self._io.shutdown(wait=True, cancel_futures=True)
                self._io = None
            self._pool.close()
        finally:
            self._files.clear()
            shutil.rmtree(self.directory, ignore_errors=True)
