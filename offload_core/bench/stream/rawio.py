"""Raw limits of this machine, measured as a careful plain reader and writer would, for `python -m offload_core stream`.

- files: `O_DIRECT` writes and reads of one file in the benchmark's directory in every `Pattern`: request
  size, requests in flight (one thread each), the file's space `fallocate`d first or not; the destination is
  a ring of at least 4 requests of pre-touched memory in huge pages where the OS has them, as the tiers'
  buffers are (`hostmem.HostBuffer`; `small_pages` measures what 4 KiB pages cost instead). The best pattern
  is the disk's limit. A pattern may also be read verifying: each request's xxh3 taken by its thread as soon as it
  lands, as the file tiers verify every chunk, which says what checking the bytes costs on this disk.
  Without `O_DIRECT` (macOS, some filesystems) the file is written, flushed and dropped from the page cache
  before each read, and the table says so.
- RAM: one layer copied host to host (`Tensor.copy_`), best of a few.
- CUDA: one layer copied pinned host to device and back.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Collection, Dict, List

import torch

from ...host.hostmem import HostBuffer
from ...places import GiB
from ...tiers.file.fileio import O_DIRECT, digest, drop_pages

RING_CAP = 256 << 20  # the largest destination ring a pattern may use


@dataclass(frozen=True)
class Pattern:
    """One way of moving a file: `request` bytes a request, `inflight` requests at once, space allocated first."""

    request: int
    inflight: int
    fallocate: bool = True
    huge: bool = True  # the ring in transparent huge pages, as the tiers' buffers are (where the OS has them)
    ring_bytes: int = 0  # the destination ring's size; 0: `ring` requests

    @property
    def ring(self) -> int:
        """Requests in the destination ring: `ring_bytes` of them (at least one), else at least 4 and one per
        request in flight."""
        return max(1, self.ring_bytes // self.request) if self.ring_bytes else max(4, self.inflight)

    @property
    def label(self) -> str:
        return f"{self.request >> 20}MiBx{self.inflight}" + ("" if self.fallocate else "-nofalloc") + \
            ("" if self.huge else "-4k") + (f"-ring{self.ring_bytes >> 20}MiB" if self.ring_bytes else "")


def patterns(requests: List[int], inflights: List[int], ring_cap: int = RING_CAP, ring_bytes: int = 0) -> List[Pattern]:
    """Every request size x in-flight count, with and without `fallocate`, whose ring fits in `ring_cap`;
    with `ring_bytes`, every ring that size (requests in flight beyond it share its buffers)."""
    tried = [Pattern(r, n, f, ring_bytes=ring_bytes) for r in requests for n in inflights for f in (True, False)]
    return [p for p in tried if p.ring * p.request <= max(ring_cap, ring_bytes)]


def _ring(pattern: Pattern) -> List[HostBuffer]:
    ring = [HostBuffer(pattern.request, huge=pattern.huge) for _ in range(pattern.ring)]
    for buf in ring:  # touched now, so no page fault is timed
        buf.tensor.fill_(1)
    return ring


def _run(pattern: Pattern, total: int, fn, ring: List[HostBuffer]) -> float:
    """GiB/s of `fn(offset, buffer)` over every request of `total` bytes, `pattern.inflight` at a time, request i
    into ring slot i mod ring size."""
    views = [b.memory() for b in ring]
    start = time.perf_counter()
    with ThreadPoolExecutor(pattern.inflight) as pool:
        list(pool.map(lambda i: fn(i * pattern.request, views[i % len(views)]), range(total // pattern.request)))
    seconds = time.perf_counter() - start
    for view in views:
        view.release()
    return total // pattern.request * pattern.request / GiB / seconds


def file_limits(directory: str, total: int, tried: List[Pattern], verified: Collection[str] = ()) -> Dict[str, object]:
    """Write and read GiB/s of every pattern in `tried` over a file of `total` bytes, and the best of each; for
    the labels in `verified`, the read again with every request's checksum taken (`verified_read_gib_s`)."""
    path = os.path.join(directory, f".kv_offload-raw-{os.getpid()}.bin")
    direct = bool(O_DIRECT)
    write, read, checked = {}, {}, {}
    try:
        for pattern in tried:
            if os.path.exists(path):
                os.unlink(path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if pattern.fallocate and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, total)
            os.close(fd)
            ring = _ring(pattern)
            fd = _open(path, os.O_WRONLY, direct)
            direct = direct and fd[1]
            write[pattern.label] = _run(pattern, total, lambda off, buf: os.pwrite(fd[0], buf, off), ring)
            os.close(fd[0])
            _flush_to_disk(path, direct)
            fd = _open(path, os.O_RDONLY, direct)
            # Twice, the better kept: the tiers' get loop is the better of two passes too, and a disk with a
            # cache below the OS (a virtual disk) serves a second pass faster.
            read[pattern.label] = max(_run(pattern, total, lambda off, buf: os.preadv(fd[0], [buf], off), ring)
                                      for _ in range(2))
            if pattern.label in verified:
                checked[pattern.label] = max(_run(pattern, total, functools.partial(_read_verified, fd[0]), ring)
                                             for _ in range(2))
            os.close(fd[0])
            for buf in ring:
                buf.release()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"o_direct": direct, "write_gib_s": write, "read_gib_s": read, "verified_read_gib_s": checked,
            "best_write_gib_s": max(write.values()), "best_read_gib_s": max(read.values()),
            "best_write_pattern": max(write, key=write.get), "best_read_pattern": max(read, key=read.get)}


def _read_verified(fd: int, off: int, buf: memoryview) -> int:
    """One request read and its checksum taken at once, by the thread that read it, as a file tier's I/O thread
    does (the digest is thrown away: the cost is the point)."""
    return digest(buf[:os.preadv(fd, [buf], off)])


def small_pages(directory: str, total: int, sweep: Dict[str, object]) -> Dict[str, float]:
    """What huge pages are worth: the sweep's best write and read patterns again with their ring in 4 KiB
    pages (one pass where they are the same pattern), each as a fraction of the same pattern in the sweep."""
    best = {kind: parse(sweep[f"best_{kind}_pattern"]) for kind in ("write", "read")}
    small = {kind: dataclasses.replace(p, huge=False) for kind, p in best.items()}
    got = file_limits(directory, total, list(dict.fromkeys(small.values())))
    return {kind: got[f"{kind}_gib_s"][small[kind].label] / sweep[f"{kind}_gib_s"][best[kind].label] for kind in best}


def parse(label: str) -> Pattern:
    """The pattern a label names (the inverse of `Pattern.label`)."""
    head, *tails = label.split("-")
    request, inflight = head.split("MiBx")
    ring = next((int(t[len("ring"):-len("MiB")]) << 20 for t in tails if t.startswith("ring")), 0)
    return Pattern(int(request) << 20, int(inflight), "nofalloc" not in tails, "4k" not in tails, ring)


def _open(path: str, flags: int, direct: bool):
    if direct:
        try:
            return os.open(path, flags | O_DIRECT), True
        except OSError:
            pass  # the filesystem refuses O_DIRECT: measured buffered, and reported so (the False below)
    return os.open(path, flags), False


def _flush_to_disk(path: str, direct: bool) -> None:
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
