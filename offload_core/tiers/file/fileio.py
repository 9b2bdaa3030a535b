"""Layer files on disk: checked opens, chunked reads, checksums, the page-cache probe; `filesave.py` writes them.

`O_DIRECT` and `FILE_FLAG_NO_BUFFERING` need buffer, offset and length page-aligned: buffers are anonymous mmaps,
files multiples of 4 KiB, chunks of whole MiB; one probe per directory decides (overlayfs and NFS may refuse it).
Design: docs/engine.md, "Layers, files and failures"; what each system offers: docs/platforms.md, `fileos`."""

from __future__ import annotations

import ctypes.util
import errno
import functools
import logging
import os
import stat
import uuid
from typing import List, Optional, Tuple

from ...host.env import env_int
from ...host.hostmem import HostBuffer
from . import fileos
from .fileos import Handle

log = logging.getLogger(__name__)

O_DIRECT = getattr(os, "O_DIRECT", 0)  # this process's own value, for the benchmark's raw I/O
# Bytes per request, `iopool.IO_DEPTH` in flight (docs/benchmark.md, "Measurements behind the file tiers' defaults")
CHUNK = env_int("KV_OFFLOAD_IO_REQUEST_MIB", 8, low=1, high=256) << 20
CHECKSUM = "xxh3_64"

# statfs f_type of filesystems whose files live in RAM (linux/magic.h): a file tier there saves no memory.
RAM_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}


class KVFileError(RuntimeError):
    """A layer file is missing, damaged, unreadable or not what this store wrote (the message names it)."""


class KVWriteError(KVFileError):
    """A layer file could not be written (disk full, I/O error): nothing partial is left behind."""


def checksum_module():
    try:
        import xxhash
    except ImportError:
        raise ImportError("The file tiers checksum every layer with xxhash, which is not installed. Install it with "
                          "`pip install xxhash` (or pick a RAM or gpu mode).") from None
    return xxhash


def digest(view: memoryview) -> int:
    """xxh3-64 of `view` (releases the GIL, so I/O threads hash in parallel)."""
    return checksum_module().xxh3_64_intdigest(view)


def chunks(start: int, end: int, size: Optional[int] = None) -> List[Tuple[int, int]]:
    """(offset, length) pieces of the byte range [start, end), `CHUNK` bytes each by default."""
    size = size or CHUNK
    return [(off, min(size, end - off)) for off in range(start, end, size)]


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    """The C library, looked up once: `find_library` may run `ldconfig`, milliseconds every store would pay."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None


def ram_backed(directory: str) -> Optional[str]:
    """The RAM filesystem (tmpfs...) `directory` is on, else None; Linux only: other RAM disks look ordinary."""
    libc = _libc() if fileos.current().name == "linux" else None
    if libc is None:
        return None
    try:
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a C long
        if libc.statfs(os.fsencode(directory), buf) != 0:
            return None
    except (OSError, AttributeError):
        return None
    f_type = ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    return RAM_FILESYSTEMS.get(f_type)


def probe_page_cache_mode(directory: str, bypass: bool) -> str:
    """The page-cache mode for `directory`: 'o_direct' or 'no_buffering' where a probe there works, else 'fadvise'
    or 'buffered' (not kept out, and said so); 'f_nocache' on macOS; 'off' without `bypass`."""
    if not bypass:
        return "off"
    fs = fileos.current()
    modes = fs.cache_modes()
    direct = modes[0]
    if direct not in fileos.DIRECT_MODES:
        return direct
    path = os.path.join(directory, f".probe-{uuid.uuid4().hex}")
    buf = HostBuffer(4096)
    try:
        f = fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, cache_mode=direct)
        try:
            f.pwrite(buf.memory()[:4096], 0)
        finally:
            f.close()
        f = fs.open(path, os.O_RDONLY, cache_mode=direct)
        try:
            f.preadv([buf.memory()[:4096]], 0)
        finally:
            f.close()
        return direct
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # not the mode's fault: a fallback would hide a full disk
            raise KVWriteError(f"KV offload: the disk holding {directory!r} is full ({os_cause(exc)}): not even a "
                               "4 KiB test file fits. Free space there, point `file_dir` at a bigger disk, or pick "
                               "a RAM mode.") from None
        log.info("%s refused in %s (%s); using %s", direct, directory, exc, modes[1])
        return modes[1]
    finally:
        buf.release()
        try:
            fs.unlink(path)
        except FileNotFoundError:
            pass  # the probe never created it


def drop_pages(f: Handle) -> None:
    fileos.current().drop_pages(f.fd)


def os_cause(exc: OSError) -> str:
    """`exc` as its errno name and message, e.g. "ENOSPC: No space left on device"."""
    return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror or exc}"


def open_checked(path: str, length: int, cache_mode: str) -> Handle:
    """The regular file `path` of exactly `length` bytes, open, or a `KVFileError` saying what it is instead."""
    fs = fileos.current()
    try:
        f = fs.open(path, os.O_RDONLY | fs.no_follow, cache_mode=cache_mode)
    except FileNotFoundError:
        raise KVFileError(f"KV layer file {path!r} is missing: it was deleted while the cache was in use. "
                          "Keep the cache directory untouched until the run ends.") from None
    except OSError as exc:
        try:
            kind = _kind(os.lstat(path).st_mode)
        except OSError:
            kind = None
        what = f"is {kind}, and cannot be opened" if kind not in (None, "a regular file") else "cannot be opened"
        raise KVFileError(f"KV layer file {path!r} {what} ({os_cause(exc)}); it was replaced or changed while the "
                          "cache was in use.") from None
    try:
        st = fs.os.fstat(f.fd)
        if not stat.S_ISREG(st.st_mode):
            raise KVFileError(f"KV layer file {path!r} is {_kind(st.st_mode)}, not the file this store wrote: it "
                              "was replaced while the cache was in use.")
        if st.st_size != length:
            raise KVFileError(f"KV layer file {path!r} has {st.st_size} bytes, expected {length}: it was truncated "
                              "or overwritten while the cache was in use.")
    except BaseException:
        f.close()
        raise
    return f


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device"


def pread_exact(f: Handle, view: memoryview, offset: int, path: str, head: Optional[memoryview] = None) -> None:
    """Fills `view` from `offset`, or `head` then `view` in one request (a header and the first chunk)."""
    views = [view] if head is None else [head, view]
    total, done = sum(len(v) for v in views), 0
    while done < total:
        rest, skip = [], done
        for v in views:
            if skip < len(v):
                rest.append(v[skip:])
            skip = max(0, skip - len(v))
        try:
            n = f.preadv(rest, offset + done)
        except OSError as exc:
            raise KVFileError(f"KV layer file {path!r} could not be read at byte {offset + done} "
                              f"({os_cause(exc)}).") from None
        if n <= 0:
            raise KVFileError(f"KV layer file {path!r} ended at byte {offset + done}, expected more: it was "
                              "truncated while the cache was in use.")
        done += n


def corrupted(path: str, offset: int, length: int) -> KVFileError:
    return KVFileError(f"KV layer file {path!r} is corrupted: the {CHECKSUM} checksum of bytes {offset}-"
                       f"{offset + length} differs from what this store wrote. It was modified while in use, or the "
                       "disk returned bad data.")
