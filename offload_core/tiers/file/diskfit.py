"""The request size and the requests in flight of the file tiers, fitted to the disk their directory is on.

The pattern that keeps one disk at its limit leaves another below it (a virtual disk is flat from 4 MiB x 1 up;
an NVMe drive wants several requests at once), so a fixed pair is wrong somewhere. Once per process, filesystem
(`st_dev`) and page-cache mode, the first file tier made there probes its own fresh directory: it writes and
reads a 64 MiB file in each `CANDIDATES` pattern with the tier's own I/O threads (`iopool.IOPool`) and
page-aligned buffers, twice, in opposite orders, for at most `PROBE_SECONDS`, and keeps the pattern whose
worse side (write against the best write seen, read against the best read) is best. Among patterns within
`TIE` of it the default stays, else the one with the most bytes in flight wins: noise never moves the
pattern, and a short probe of the bare calls cannot see what a tier adds to each request (its copy into
staging, its checksum), which more requests in flight hide. Every later tier on that filesystem uses the answer at once.

Every write pattern stays within the staging a tier held before the probe existed: (requests in flight + 2)
requests of write staging, at most 48 MiB. Reads hold no staging per request (they land in the layer's slot,
or in a layer-sized read buffer), so their depth is probed on its own, up to `READ_DEPTHS[-1]` requests of the
chosen size: a disk that wants 16 requests in flight to read at its limit gets them, for the price of idle
threads, while writes keep their bound. No probe runs where it would measure RAM instead of the disk (a
filesystem in RAM, reads and writes through the page cache), nor where `KV_OFFLOAD_IO_REQUEST_MIB` or
`KV_OFFLOAD_IO_DEPTH` fix the pattern, nor with `KV_OFFLOAD_IO_PROBE=0`; a probe that fails (a full disk) falls
back to the default pattern, says why in `stats()["file_io"]`, and is tried again by the next tier (one that
timed out is not: the disk did not answer, and a request stuck in the kernel keeps the probe's file open until
it returns, then a thread of its own closes it).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from ...host.env import env_int, is_set
from ...host.hostmem import HostBuffer
from ...places import GiB, MiB
from . import fileio, fileos, iopool
from .filesave import discard, pwrite_all, reserve

log = logging.getLogger(__name__)

STAGING_BOUND = 48 * MiB  # write staging of the fixed 8 MiB x 4 pattern: (4 + 2) x 8 MiB
PROBE_BYTES = 64 * MiB  # file size of each probed pattern
PROBE_SECONDS = 2.0  # the probe stops starting patterns after this, and chooses among those it measured
# Where reads and writes reach the disk: direct I/O (Linux, Windows) and macOS's F_NOCACHE.
PROBED_MODES = (*fileos.DIRECT_MODES, "f_nocache")
TIE = 0.10  # patterns this close to the best score count as equal: the default stays, else the most in flight wins


@dataclass(frozen=True)
class IOPattern:
    """How a file tier moves a layer: `request` bytes per request, `depth` writes and `read_depth` reads in
    flight, and why. `read_depth` 0 means `depth`."""

    request: int
    depth: int
    chosen: str  # "probe", "default" or "environment"
    reason: str = ""
    probe: Dict[str, Dict[str, float]] = field(default_factory=dict, compare=False)  # label -> write/read GiB/s
    read_depth: int = 0

    @property
    def reads(self) -> int:
        """Reads in flight: the I/O threads a file tier runs (writes are bounded by their staging instead)."""
        return self.read_depth or self.depth

    @property
    def label(self) -> str:
        return label(self.request, self.depth, self.reads)

    def as_dict(self) -> Dict[str, object]:
        return {"request_bytes": self.request, "in_flight": self.depth, "reads_in_flight": self.reads,
                "pattern": self.label, "chosen": self.chosen, "reason": self.reason,
                "probe_gib_s": {k: dict(v) for k, v in self.probe.items()}}


def label(request: int, depth: int, reads: int = 0) -> str:
    """`8MiBx4` (writes and reads alike), or `8MiBx4/r16` where reads keep more requests in flight."""
    return f"{request // MiB}MiBx{depth}" + (f"/r{reads}" if reads and reads != depth else "")


def _candidates() -> List[Tuple[int, int]]:
    """(request, depth) pairs within the staging bound and with at least 8 MiB in flight (less starves any disk)."""
    pairs = [(r * MiB, d) for r in (2, 4, 8, 16) for d in (1, 2, 4, 8, 16)]
    return [(r, d) for r, d in pairs if (d + 2) * r <= STAGING_BOUND and r * d >= 8 * MiB]


CANDIDATES = _candidates()
READ_DEPTHS = (1, 2, 4, 8, 16)  # reads in flight probed for each request size (no staging bounds them)
READ_TIE = 0.05  # read depths this close to the best read count as equal: the fewest threads win


def default() -> Tuple[int, int]:
    """The pattern used without a probe: `fileio.CHUNK` requests, `iopool.IO_DEPTH` in flight (read at call time)."""
    return fileio.CHUNK, iopool.IO_DEPTH


_FITS: Dict[Tuple[int, str], IOPattern] = {}
_LOCK = threading.Lock()
if hasattr(os, "register_at_fork"):  # a child must not inherit the lock held by a parent's probing thread
    os.register_at_fork(after_in_child=lambda: globals().update(_LOCK=threading.Lock()))


def pattern_for(directory: str, cache_mode: str, ram_fs: Optional[str]) -> IOPattern:
    """The pattern for a file tier in `directory` (its own, fresh and empty): fixed, default or probed."""
    request, depth = default()
    fixed = [name for name in ("KV_OFFLOAD_IO_REQUEST_MIB", "KV_OFFLOAD_IO_DEPTH") if is_set(name)]
    if fixed:
        if is_set("KV_OFFLOAD_IO_REQUEST_MIB"):
            request = env_int("KV_OFFLOAD_IO_REQUEST_MIB", request // MiB, low=1, high=256) * MiB
        return IOPattern(request, depth, "environment", f"set by {' and '.join(fixed)}")
    refused = _no_probe(cache_mode, ram_fs)
    if refused is not None:
        return IOPattern(request, depth, "default", refused)
    key = (os.stat(directory).st_dev, cache_mode)
    with _LOCK:  # one probe per filesystem: a second tier made meanwhile (another device's thread) waits for it
        fit = _FITS.get(key)
        if fit is None:
            try:
                fit = probe(directory, cache_mode)
            except (OSError, fileio.KVFileError) as exc:  # a full disk, an I/O error: the layers' writes will say
                cause = str(exc) if isinstance(exc, (fileio.KVFileError, TimeoutError)) else fileio.os_cause(exc)
                log.info("KV offload: the I/O probe in %s failed (%s); using %s", directory, cause,
                         label(request, depth))
                fallback = IOPattern(request, depth, "default", f"the probe failed ({cause})")
                if isinstance(exc, TimeoutError):  # a disk that did not answer: no later tier probes it again
                    _FITS[key] = fallback
                return fallback
            _FITS[key] = fit
            log.info("KV offload: file I/O in %s: %s requests in flight of %d MiB (%s)", directory, fit.depth,
                     fit.request // MiB, fit.reason)
    return fit


def _no_probe(cache_mode: str, ram_fs: Optional[str]) -> Optional[str]:
    if not env_int("KV_OFFLOAD_IO_PROBE", 1, low=0, high=1):
        return "KV_OFFLOAD_IO_PROBE=0"
    if ram_fs is not None:
        return f"on {ram_fs}, which keeps files in RAM: a probe would measure RAM"
    if cache_mode not in PROBED_MODES:
        return f"page cache {cache_mode}: a probe would measure the page cache, not the disk"
    return None


def forget() -> None:
    """Drops every probed pattern (tests; a process whose disks changed)."""
    with _LOCK:
        _FITS.clear()


def probe(directory: str, cache_mode: str, candidates: Optional[List[Tuple[int, int]]] = None,
          seconds: Optional[float] = None, nbytes: Optional[int] = None) -> IOPattern:
    """Measures `candidates` (default `CANDIDATES`) in `directory` and chooses one (see the module's doc).

    Leaves nothing behind, also when interrupted: the file is removed, the buffers freed, the threads stopped.
    Raises `KVWriteError` (or `OSError`) where the directory refuses the file (a full disk)."""
    candidates = list(candidates or CANDIDATES)
    limit = PROBE_SECONDS if seconds is None else seconds
    nbytes = nbytes or PROBE_BYTES
    first = default()
    candidates.sort(key=lambda p: p != first)  # the default first: a slow disk measures at least it
    figures: Dict[Tuple[int, int], Dict[str, float]] = {}
    reads: Dict[Tuple[int, int], float] = {}  # (request, reads in flight) -> read GiB/s
    start = time.monotonic()
    for pattern in candidates + candidates[::-1]:
        if figures and time.monotonic() - start > limit:
            break
        got = measure(directory, cache_mode, *pattern, nbytes, deeper_reads(pattern, candidates))
        best = figures.setdefault(pattern, {"write": 0.0, "read": 0.0})
        for kind in best:
            best[kind] = max(best[kind], got[kind])
        for depth, gib_s in got["reads"].items():
            reads[pattern[0], depth] = max(reads.get((pattern[0], depth), 0.0), gib_s)
    request, depth = choose(figures, reads)
    spent = time.monotonic() - start
    shown = {label(*p): {k: round(v, 3) for k, v in f.items()} for p, f in figures.items()}
    shown.update({f"{label(r, d)}/read": {"read": round(v, 3)} for (r, d), v in reads.items() if (r, d) not in figures})
    return IOPattern(request, depth, "probe", f"probed {len(figures)} patterns in {spent:.1f} s", shown,
                     read_depth=read_depth(reads, figures, request, depth))


def deeper_reads(pattern: Tuple[int, int], candidates: List[Tuple[int, int]]) -> Tuple[int, ...]:
    """The read depths beyond the write bound measured with `pattern`: once per request size, with its deepest
    write pattern (whose file is then read again at each)."""
    request, depth = pattern
    if depth != max(d for r, d in candidates if r == request):
        return ()
    return tuple(d for d in READ_DEPTHS if d > depth and request * d >= 8 * MiB)


def _reads_at(request: int, figures, reads) -> Dict[int, float]:
    """Read GiB/s at `request` by reads in flight, from the patterns' own reads and the deeper ones."""
    got = {d: f["read"] for (r, d), f in figures.items() if r == request}
    for (r, d), gib_s in (reads or {}).items():
        if r == request:
            got[d] = max(got.get(d, 0.0), gib_s)
    return got


def choose(figures: Dict[Tuple[int, int], Dict[str, float]],
           reads: Optional[Dict[Tuple[int, int], float]] = None) -> Tuple[int, int]:
    """The pattern whose worse side against the best of that side is best; a pattern's read side is the best
    read at its request size with any depth (`read_depth` picks it). Within `TIE` of it the default stays (a
    short probe's samples scatter by that much on a shared disk: only a clear gain moves it), else the one
    with the most bytes in flight (on this project's disk a probe that preferred less staging chose 8 MiB x 1,
    and the tier then wrote at 60 % of the disk: per-request costs the probe does not have), then the fewest
    threads."""
    side = {p: {"write": f["write"], "read": max(_reads_at(p[0], figures, reads).values())} for p, f in figures.items()}
    best = {kind: max(f[kind] for f in side.values()) or 1.0 for kind in ("write", "read")}
    score = {p: min(f[kind] / best[kind] for kind in best) for p, f in side.items()}
    top = max(score.values())
    near = [p for p, s in score.items() if s >= top - TIE]
    return min(near, key=lambda p: (p != default(), -p[0] * p[1], p[1]))


def read_depth(reads: Dict[Tuple[int, int], float], figures, request: int, depth: int) -> int:
    """Reads in flight for `request`: the fewest within `READ_TIE` of the best read at that size, and never
    fewer than the writes' `depth` (the threads are there anyway)."""
    got = _reads_at(request, figures, reads)
    top = max(got.values())
    return max(depth, min(d for d, gib_s in got.items() if gib_s >= top * (1 - READ_TIE)))


def measure(directory: str, cache_mode: str, request: int, depth: int, nbytes: int,
            deeper: Tuple[int, ...] = ()) -> Dict[str, object]:
    """Write then read GiB/s of a file of `nbytes` in `directory`, `request` bytes a request, `depth` at once,
    through the same calls the tiers make (`reserve`, `pwrite_all`, `Handle.preadv`); then the same file read
    again with each of `deeper` requests in flight ("reads": depth -> GiB/s; those reads share the buffers,
    whose bytes nobody looks at)."""
    nbytes = max(request, nbytes // request * request)
    path = os.path.join(directory, f".io-probe-{request // MiB}x{depth}")
    ring, views, f, pool = [], [], None, None
    try:  # from the first allocation on: an interrupt anywhere frees what was made
        for _ in range(depth):
            ring.append(HostBuffer(request))
            ring[-1].tensor.fill_(1)  # touched now, so no page fault is timed
            views.append(ring[-1].memory())
        pool = iopool.IOPool(max((depth, *deeper)), "kv_offload_probe")
        f = reserve(path, [(0, nbytes)], cache_mode)
        write = timed(pool, nbytes, request, depth, lambda i, off: pwrite_all(f, views[i % depth], off, path))
        f.close()
        f = fileos.current().open(path, os.O_RDONLY, cache_mode=cache_mode)
        got: Dict[str, object] = {"write": write, "reads": {}}
        for n in (depth, *deeper):
            got["reads"][n] = timed(pool, nbytes, request, n,
                                    lambda i, off: fileio.pread_exact(f, views[i % depth], off, path))
        got["read"] = got["reads"].pop(depth)
        return got
    finally:
        def release() -> None:
            if f is not None:
                f.close()
            for view in views:
                view.release()
            for buf in ring:
                buf.release()

        stuck = pool.shutdown(iopool.io_timeout()) if pool is not None else []
        if not stuck:
            release()
        else:  # a request stuck in the kernel keeps its descriptor and buffers until it returns, then they go
            threading.Thread(target=_release_after, args=(pool, release), name="kv_offload_probe_release",
                             daemon=True).start()
        discard(path)


def _release_after(pool: iopool.IOPool, release: Callable[[], None]) -> None:
    pool.join()
    release()


def timed(pool: iopool.IOPool, nbytes: int, request: int, depth: int, fn: Callable[[int, int], None]) -> float:
    """GiB/s of `fn(i, offset)` for every request of `nbytes`, at most `depth` at once on `pool`'s threads."""
    begin = time.perf_counter()
    futures: list = []
    slots = threading.Semaphore(depth)

    def one(i: int, off: int) -> None:
        try:
            fn(i, off)
        finally:
            slots.release()

    for i, off in enumerate(range(0, nbytes, request)):
        if not slots.acquire(timeout=iopool.io_timeout()):
            raise iopool.IOStuckError(f"KV offload: the I/O probe's requests did not finish within "
                                      f"{iopool.io_timeout():g} s: the disk is not answering.")
        pool.submit(functools.partial(one, i, off), "the I/O probe", into=futures)
    iopool.wait_all(futures, "the I/O probe")
    return nbytes / GiB / (time.perf_counter() - begin)
