"""Raw limits of this machine, measured the way the tiers move bytes, for `python -m offload_core stream`.

- files: `O_DIRECT` writes and reads of one file in the benchmark's directory, in chunks of the tiers' size,
  with 1, 2, 4, ... requests in flight (one thread per request, page-aligned buffers, space allocated first,
  as the file tiers do); the best depth is the disk's limit. Without `O_DIRECT` (macOS, some filesystems) the
  file is written, flushed and dropped from the page cache before each read, and the table says so.
- RAM: one layer copied host to host (`Tensor.copy_`), best of a few.
- CUDA: one layer copied pinned host to device and back.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

import torch

from ..places import GiB
from ..tiers.fileio import O_DIRECT, drop_pages



def _buffers(depth: int, chunk: int) -> List[mmap.mmap]:
    return [mmap.mmap(-1, chunk) for _ in range(depth)]


def _run(depth: int, chunk: int, total: int, fn) -> float:
    """GiB/s of `fn(offset, buffer)` over every chunk of `total` bytes with `depth` requests in flight."""
    buffers = _buffers(depth, chunk)
    local = threading.local()
    index = iter(range(depth))
    lock = threading.Lock()

    def job(offset: int) -> None:
        if not hasattr(local, "buf"):
            with lock:
                local.buf = memoryview(buffers[next(index)])
        fn(offset, local.buf)

    start = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        list(pool.map(job, range(0, total, chunk)))
    return total / GiB / (time.perf_counter() - start)


def file_limits(directory: str, total: int, chunk: int, depths: List[int]) -> Dict[str, object]:
    """Best O_DIRECT write and read GiB/s over `depths`, with the figure of every depth."""
    path = os.path.join(directory, f".kv_offload-raw-{os.getpid()}.bin")
    direct = bool(O_DIRECT)
    write, read = {}, {}
    try:
        for depth in depths:
            if os.path.exists(path):
                os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, total)
            os.close(fd)
            fd = _open(path, os.O_WRONLY, direct)
            direct = direct and fd[1]
            write[depth] = _run(depth, chunk, total, lambda off, buf: os.pwrite(fd[0], buf, off))
            os.close(fd[0])
            _settle(path, direct)
            fd = _open(path, os.O_RDONLY, direct)
            # Twice, the better kept: the tiers' get loop is the better of two passes too, and a disk with a
            # cache below the OS (a virtual disk) serves a second pass faster.
            read[depth] = max(_run(depth, chunk, total, lambda off, buf: os.preadv(fd[0], [buf], off))
                              for _ in range(2))
            os.close(fd[0])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"o_direct": direct, "chunk_bytes": chunk, "write_gib_s": write, "read_gib_s": read,
            "best_write_gib_s": max(write.values()), "best_read_gib_s": max(read.values()),
            "best_write_depth": max(write, key=write.get), "best_read_depth": max(read, key=read.get)}


def _open(path: str, flags: int, direct: bool):
    if direct:
        try:
            return os.open(path, flags | O_DIRECT), True
        except OSError:
            pass  # the filesystem refuses O_DIRECT: measured buffered, and reported so (the False below)
    return os.open(path, flags), False


def _settle(path: str, direct: bool) -> None:
    if direct:
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        drop_pages(fd)  # so the buffered read that follows comes from the disk as far as the OS allows
    finally:
        os.close(fd)


def ram_limit(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, nbytes / GiB / (time.perf_counter() - start))
    return best


def cuda_limits(nbytes: int, device: torch.device, repeats: int = 5) -> Dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d_gib_s", dev, host), ("d2h_gib_s", host, dev)):
        best = 0.0
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = max(best, nbytes / GiB / (time.perf_counter() - start))
        out[name] = best
    return out
