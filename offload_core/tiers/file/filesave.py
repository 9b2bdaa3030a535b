"""Writing one layer file: space reserved, chunks written whole, flushed as the page-cache mode needs and renamed
into place, or discarded: nothing partial is left. Every failure is a `KVWriteError` naming the file."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import List, Optional, Tuple

from ...places import KiB, MiB
from . import fileos
from .fileio import KVWriteError, os_cause, drop_pages
from .fileos import Handle

log = logging.getLogger(__name__)


def reserve(path: str, extents: List[Tuple[int, int]], cache_mode: str) -> Handle:
    """Creates `path` (a temp name) with its (offset, length) `extents` allocated (`fileos.FileOS.reserve`), open
    for writing: a full disk fails here, at the `put`, not in a background write. It allocates through a buffered
    descriptor, then sets `O_DIRECT` or opens the unbuffered Windows handle (the CRT extends a file by writing
    zeros from a buffer of its own, which an unbuffered handle refuses)."""
    fs = fileos.current()
    length = sum(n for _, n in extents)
    handles: List[Handle] = []  # what is open of the file, the one returned last
    try:  # the open inside, so that a Ctrl-C right after it still reaches the cleanup
        handles.append(fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                               cache_mode="off" if cache_mode in fileos.DIRECT_MODES else cache_mode))
        fs.reserve(handles[0].fd, extents)
        if cache_mode == "o_direct":
            fd = handles[0].fd
            fs.fcntl.fcntl(fd, fs.fcntl.F_SETFL, fs.fcntl.fcntl(fd, fs.fcntl.F_GETFL) | fs.o_direct)
        elif cache_mode == "no_buffering":
            handles.append(fs.open(path, os.O_WRONLY, cache_mode="no_buffering"))
            handles[0].close()
        return handles[-1]
    except BaseException as exc:  # an interrupt too: no descriptor or temp file may outlive a failed reserve
        for handle in handles:
            handle.close()
        if handles or not isinstance(exc, OSError):  # made (O_EXCL: the name is ours), or maybe made when interrupted
            discard(path)
        if isinstance(exc, OSError):
            raise write_error(path, length, exc) from None
        raise


def write_error(path: str, length: int, exc: OSError) -> KVWriteError:
    directory = os.path.dirname(path)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{shutil.disk_usage(directory).free / MiB:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        return KVWriteError(f"KV offload: the disk holding {directory!r} is full ({os_cause(exc)}): a layer file needs "
                            f"{_size(length)}, {free}. Free space there, point `file_dir` at a bigger "
                            "disk, or pick a RAM mode.")
    return KVWriteError(f"KV offload: could not write layer file {path!r} in {directory!r} ({os_cause(exc)}); "
                        f"{_size(length)} were to be written.")


def _size(n: int) -> str:
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / KiB:.1f} KiB"


def pwrite_all(f: Handle, view: memoryview, offset: int, path: str, file_bytes: Optional[int] = None) -> None:
    """Writes `view` whole at `offset`; an error names the file and its size, `file_bytes` (default: the view's)."""
    done = 0
    while done < len(view):
        try:
            n = f.pwrite(view[done:], offset + done)
        except OSError as exc:
            raise write_error(path, file_bytes or len(view), exc) from None
        if n <= 0:
            raise KVWriteError(f"KV offload: writing layer file {path!r} made no progress at byte {offset + done}.")
        done += n


def finish_write(f: Handle, tmp: str, path: str, cache_mode: str, length: int) -> None:
    """Flushes as `cache_mode` needs, closes `f` and renames `tmp` to `path` (atomic for readers)."""
    fs = fileos.current()
    try:
        if cache_mode == "fadvise":
            fs.sync(f.fd)  # dirty pages cannot be dropped; flush them first
            drop_pages(f)
        # No fsync otherwise: readers need only the rename; what a crash leaves, the next store reclaims.
        f.close()  # before the rename, which Windows refuses for an open file
        fs.replace(tmp, path)
    except OSError as exc:
        if f.fd >= 0:
            f.close()
        discard(tmp)
        raise write_error(path, length, exc) from None


def discard(path: str) -> None:
    try:
        fileos.current().unlink(path)
    except FileNotFoundError:
        pass  # gone already
    except OSError as exc:
        log.warning("KV offload: could not remove %r (%s)", path, exc)
