"""The file tier (place `file`): one safetensors-compatible file per layer in a private directory.

The tier owns the directory (locked while it lives, deleted at close), the I/O pools and the layer entries;
`filewrite.Writer` and `fileread.Reader` move the bytes (docs/engine.md, "Layers, files and failures"). Both
modes write on one write lane (first in first out); `file_async` adds the two read lanes. Reads and writes have
separate staging pools, so neither waits for the other's buffers; `close()` walks away from I/O stuck in the kernel."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import itertools
import logging
import os
import tempfile
import time
from typing import Dict, Hashable, List, Optional

import torch

from ...host.devices import Fence, Streams
from ...host.hostmem import HostBuffer
from ...layout import LayerLayout
from ...places import FILE, PAGEABLE, PINNED
from ..base import Pending, Tier, TierContext
from . import fileio, iopool
from .fileappend import GrowingFiles
from .fileio import KVWriteError, checksum_module, os_cause, probe_page_cache_mode, ram_backed
from .fileowner import OwnedDir
from .fileread import Reader
from .filewrite import LayerFile, Writer
from .iopool import IOPool, io_timeout

log = logging.getLogger(__name__)


class FileTier(Tier):
    own_slots = True  # on a CPU its reads fill page-aligned slots it made in place (`new_slot`)

    def __init__(self, ctx: TierContext, parent_dir: Optional[str], bypass: bool, asynchronous: bool):
        checksum_module()  # a missing checksum package fails before anything is made
        self._ctx = ctx
        # Our own directory, even in a caller's `file_dir`: close() deletes just it; a later store, if we die first.
        try:
            self._owner = OwnedDir(parent_dir, "kv_offload-")
        except OSError as exc:  # a full disk, or one that turned read-only (remounted after an error, chattr +i)
            where = parent_dir or tempfile.gettempdir()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise KVWriteError(f"KV offload: the disk holding {where!r} is full ({os_cause(exc)}): not even the "
                                   "cache's directory fits. Free space there, point `file_dir` at a bigger disk, or "
                                   "pick a RAM mode.") from None
            raise KVWriteError(f"KV offload: the cache's directory cannot be made in {where!r} ({os_cause(exc)}): "
                               "the folder is not writable now. Make it writable, point `file_dir` at another "
                               "folder, or pick a RAM mode.") from None
        self.directory = self._owner.path
        self._closed = False
        self._chunks = None
        self._lanes: Dict[str, IOPool] = {}
        try:  # an interrupt (Ctrl-C, SIGTERM) while the tier is being made leaves no directory and no thread
            self._open(ctx, bypass, asynchronous)
        except BaseException:
            for pool in [*self._lanes.values(), self._chunks]:
                if pool is not None:
                    pool.shutdown(io_timeout())
            self._owner.delete()
            raise

    def _open(self, ctx: TierContext, bypass: bool, asynchronous: bool) -> None:
        self.cache_mode = probe_page_cache_mode(self.directory, bypass)
        self.ram_fs = ram_backed(self.directory)
        self.note = None
        if self.ram_fs is not None:
            self.note = (f"{self.directory} is on {self.ram_fs}, which keeps files in RAM: the file tier saves no "
                         "RAM here; point `file_dir` at a disk, or use a RAM mode")
            log.warning("KV offload: %s.", self.note)
        request, depth = fileio.CHUNK, iopool.IO_DEPTH
        self.io = {"request_bytes": request, "in_flight": depth, "pattern": f"{request >> 20}MiBx{depth}"}
        self._chunks = IOPool(depth, "kv_offload_io")
        for name in ("write", "read_start", "read_finish") if asynchronous else ("write",):
            self._lanes[name] = IOPool(1, f"kv_offload_{name}")
        self._files: Dict[Hashable, LayerFile] = {}
        self._names = itertools.count()  # layer file numbers, shared by whole and growing layers
        self._stuck: List[str] = []  # I/O abandoned in the kernel, reported at close
        self._host_slots: Dict[int, HostBuffer] = {}  # page-aligned CPU slots made by new_slot, by address
        self._writer = Writer(ctx, self.directory, self.cache_mode, request, self._chunks, self._lanes["write"],
                              self._stuck)
        reads = {name: lane for name, lane in self._lanes.items() if name.startswith("read")}
        self._reader = Reader(ctx, self.cache_mode, self._chunks, reads, self._stuck, self._host_slots)
        self._grow = GrowingFiles(ctx, self.directory, self.cache_mode, self._lanes["write"],
                                  self._lanes.get("read_start"), self._names)

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        path = os.path.join(self.directory, f"layer-{next(self._names):05d}.safetensors")
        self._files[key] = self._writer.write(key, k, v, layout, path)

    def append(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, at: int) -> Fence:
        return self._grow.append(key, k, v, at)  # a growing layer: one file, each block appended once (fileappend.py)

    def load_prefix(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, release: Fence) -> Pending:
        return self._grow.load(key, k, v, release)

    def drop_growing(self, key: Hashable) -> None:
        self._grow.drop(key)

    def new_slot(self, nbytes: int, streams: Streams) -> torch.Tensor:
        """On a CPU (no streams to order), a page-aligned slot that `O_DIRECT` reads fill directly, without staging."""
        if streams.device.type != "cpu" or not streams.immediate:
            return super().new_slot(nbytes, streams)
        buf = HostBuffer(nbytes)
        self._host_slots[buf.tensor.data_ptr()] = buf  # kept until close: a stuck read may still fill it
        return buf.tensor

    def release_slot(self, slot: torch.Tensor) -> None:
        """Frees a `new_slot` host slot now (the store parks), unless a read stuck in the kernel may still fill it."""
        address = slot.data_ptr()
        if self._reader.writing(address):
            return
        self._reader.filling.pop(address, None)
        buf = self._host_slots.pop(address, None)
        if buf is not None:
            buf.release()

    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        entry = self._files[key]
        self._writer.trim_if_idle()  # the capture is over: its staging would only hold host RAM from now on
        return self._reader.load(entry, slot, release)

    def flush(self) -> None:
        """Waits until every layer stored so far is on disk, then raises the first write error, if any. Cancels
        nothing; each wait is bounded by one layer operation, since the write lane finishes layers in order."""
        first: Optional[BaseException] = None
        for entry in list(self._files.values()):  # a snapshot: puts may go on meanwhile
            if entry.write is None:
                continue
            try:
                entry.write.result(timeout=io_timeout())
            except cf.TimeoutError:
                if not entry.write.done():
                    raise TimeoutError(f"KV offload: the write of {entry.path!r} did not finish within "
                                       f"{io_timeout():g} s; the disk is not answering.") from None
                first = first or entry.write.exception()
            except Exception as exc:  # the write's own error, or its cancellation by close() (Ctrl-C goes through)
                first = first or exc
        if first is not None:
            raise first
        self._grow.flush()

    def seal(self) -> None:
        """`flush`, then frees the write staging at once (the store takes no more puts)."""
        self.flush()
        self._writer.trim_if_idle()

    def nbytes(self) -> Dict[str, int]:
        staging = self._reader.staging.buffers() + self._writer.staging.buffers()
        return {
            FILE: sum(e.total for e in list(self._files.values()) if e.written) + self._grow.nbytes(),  # written only
            PINNED: sum(b.nbytes for b in staging if b.pinned),
            PAGEABLE: sum(b.nbytes for b in staging if not b.pinned),
        }

    def info(self) -> Dict[str, object]:
        mode = self.cache_mode if self.ram_fs is None else f"{self.ram_fs}: in RAM"
        files = sum(e.written for e in list(self._files.values())) + self._grow.count()
        return {"page_cache": mode, "file_dir": self.directory, "files": files, "file_io": self.io}

    def _stop_io(self) -> List[str]:
        """Cancels queued I/O and waits (bounded, in total) for running I/O; returns what is still running."""
        deadline = time.monotonic() + io_timeout()
        stuck: List[str] = []
        for pool in [*self._lanes.values(), self._chunks]:  # each waits on the ones after it
            stuck += pool.shutdown(max(0.0, deadline - time.monotonic()))
        return stuck

    def close(self) -> None:
        """Stops the I/O (abandoning stuck threads), frees the staging, deletes the directory. Idempotent.

        A Ctrl-C inside a step is raised again once the directory is gone; one between steps stops the cleanup,
        and the next call repeats every step (each is safe to repeat): closed only once the last step has run."""
        if self._closed:
            return
        interrupt: Optional[BaseException] = None
        stuck: List[str] = []
        stopped = False
        for _ in range(3):
            try:
                self._reader.close()
                stuck = self._stop_io()
                stopped = True
                break
            except KeyboardInterrupt as exc:
                interrupt = exc
        stuck = sorted(set(stuck + self._stuck))
        if stuck:
            log.error("KV offload: closing %s left %d I/O request(s) stuck in the kernel behind (%s); their threads "
                      "and buffers are abandoned.", self.directory, len(stuck), "; ".join(stuck[:4]))
        elif not stopped:
            log.warning("KV offload: closing %s was interrupted before its I/O had stopped; the buffers requests may "
                        "still fill are left to the garbage collector.", self.directory)
        abandoned = bool(stuck) or not stopped  # a request may still run: no buffer of this store is reused
        try:
            self._reader.staging.close(abandoned_io=abandoned)
            self._writer.staging.close(abandoned_io=abandoned)
        except KeyboardInterrupt as exc:
            interrupt = interrupt or exc
        finally:
            self._files.clear()
            if not abandoned:  # nothing reads into the host slots or writes the growing files any more
                self._grow.close()  # the descriptors go before the directory (Windows refuses to delete open files)
                self._host_slots.clear()
            try:
                self._owner.delete()
            except KeyboardInterrupt as exc:
                interrupt = interrupt or exc
        if interrupt is not None:  # not closed yet: a step it stopped is done again by the next call
            raise interrupt
        self._closed = True
