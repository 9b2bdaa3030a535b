"""What the operating system gives the file tiers, decided once per process by this one module (docs/platforms.md).

Stdlib only (the ComfyUI pack loads `fileowner` without torch). Tests swap `CURRENT` for a stand-in of another
system (tests/core/simplatform.py); `self.os` is read at call time, so a test that patches `os.pwrite` reaches it."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import struct
import sys
import threading
import time
from typing import List, Optional, Tuple

try:
    import fcntl as _fcntl
except ImportError:
    _fcntl = None
try:
    import msvcrt as _msvcrt
except ImportError:
    _msvcrt = None

F_NOCACHE, F_PREALLOCATE = 48, 42  # macOS fcntl commands (sys/fcntl.h), which CPython's fcntl may not name
_F_ALLOCATEALL, _F_PEOFPOSMODE = 0x4, 3  # F_PREALLOCATE's fstore_t flag and position mode
DIRECT_MODES = ("o_direct", "no_buffering")  # bypass modes: every request must be page-aligned
# Win32 (fileapi.h): what `CreateFileW` takes for an unbuffered layer file.
GENERIC_READ, GENERIC_WRITE = 0x80000000, 0x40000000
FILE_SHARE_READ, FILE_SHARE_WRITE = 0x1, 0x2  # what the CRT's os.open shares: delete and rename stay refused
CREATE_NEW, CREATE_ALWAYS, OPEN_EXISTING, OPEN_ALWAYS, TRUNCATE_EXISTING = 1, 2, 3, 4, 5
FILE_FLAG_NO_BUFFERING = 0x20000000
_SHARING_VIOLATIONS = (5, 32, 33)  # winerror: access denied, sharing violation, lock violation
BUSY_RETRY_S = 2.0  # how long a delete or rename waits for a file an antivirus scanner holds open
# `posix_fallocate` pieces: powers of two, which ext4 starts on a 2 MiB boundary (docs/benchmark.md, "Where the
# data lies on the disk").
RESERVE_GRAIN, RESERVE_PIECE = 2 << 20, 32 << 20


def reserve_pieces(start: int, length: int) -> List[Tuple[int, int]]:
    """(offset, length) pieces of [start, start + length): powers of two from `RESERVE_PIECE` down to
    `RESERVE_GRAIN`, largest first, then what is left under a grain as one."""
    pieces, size = [], RESERVE_PIECE
    while length:
        while size > RESERVE_GRAIN and size > length:
            size //= 2
        n = min(size, length)
        pieces.append((start, n))
        start, length = start + n, length - n
    return pieces


class FileOS:
    """The file-tier operations of one system. `name`: 'linux', 'macos', 'windows' or 'posix' (other Unix)."""

    def __init__(self, os_module, platform: str, fcntl_module=None, msvcrt_module=None, win32=None):
        self.os, self.fcntl, self.msvcrt, self.win32 = os_module, fcntl_module, msvcrt_module, win32
        o = os_module
        self.name = ("windows" if platform == "win32" else "macos" if platform == "darwin"
                     else "linux" if platform.startswith("linux") else "posix")
        self.o_direct = getattr(o, "O_DIRECT", 0) if self.name == "linux" else 0
        self.open_flags = getattr(o, "O_BINARY", 0) | getattr(o, "O_CLOEXEC", 0) | getattr(o, "O_NOINHERIT", 0)
        self.no_follow = getattr(o, "O_NOFOLLOW", 0) | getattr(o, "O_NONBLOCK", 0)  # a FIFO must not block the open
        self.per_thread = not hasattr(o, "pwrite")  # Windows: no positional I/O in `os`
        self.renames_open = self.name != "windows"  # Windows refuses a rename of a folder holding an open file
        self.problem = self._problem()

    def _problem(self) -> Optional[str]:
        missing = [n for n in ("lseek", "write", "fsync") if not hasattr(self.os, n)]
        if self.per_thread and self.name != "windows":
            missing.append("pwrite")
        if self.fcntl is None and self.msvcrt is None:
            missing.append("fcntl.flock or msvcrt.locking")
        return ", ".join(missing) or None

    def cache_modes(self) -> List[str]:
        """The bypass modes this system may offer, best first (the tier probes `o_direct` per directory)."""
        if self.name == "linux":
            return ["o_direct", "fadvise"] if self.o_direct else ["fadvise"]
        if self.name == "macos" and self.fcntl is not None:
            return ["f_nocache"]
        if self.name == "windows" and self.win32 is not None and self.msvcrt is not None:
            return ["no_buffering", "buffered"]
        return ["buffered"]

    def open(self, path: str, flags: int, mode: int = 0o600, cache_mode: str = "off") -> "Handle":
        with deferred_interrupts():  # the descriptor is the handle's before a Ctrl-C can be raised
            fd = self.open_fd(path, flags, mode, cache_mode)
            try:
                if cache_mode == "f_nocache":
                    self.fcntl.fcntl(fd, F_NOCACHE, 1)
                return Handle(self, fd, path, flags, cache_mode)
            except BaseException:  # the descriptor is nobody's yet
                self.os.close(fd)
                raise

    def open_fd(self, path: str, flags: int, mode: int = 0o600, cache_mode: str = "off") -> int:
        """A descriptor of `path`; `no_buffering` goes through `CreateFileW`, which the CRT's open cannot ask for."""
        if cache_mode != "no_buffering":
            return self.os.open(path, flags | self.open_flags | (self.o_direct if cache_mode == "o_direct" else 0),
                                mode)
        o = self.os
        access = {o.O_RDONLY: GENERIC_READ, o.O_WRONLY: GENERIC_WRITE}.get(flags & 3, GENERIC_READ | GENERIC_WRITE)
        create, excl, trunc = flags & o.O_CREAT, flags & o.O_EXCL, flags & getattr(o, "O_TRUNC", 0)
        disposition = (CREATE_NEW if create and excl else CREATE_ALWAYS if create and trunc else OPEN_ALWAYS
                       if create else TRUNCATE_EXISTING if trunc else OPEN_EXISTING)
        handle = self.win32.create_file(path, access, FILE_SHARE_READ | FILE_SHARE_WRITE, disposition,
                                        FILE_FLAG_NO_BUFFERING)
        try:
            return self.msvcrt.open_osfhandle(handle, (flags & 3) | self.open_flags)  # O_BINARY: no newline translation
        except BaseException:
            self.win32.close_handle(handle)  # not the CRT's yet: ours to close
            raise

    def sync(self, fd: int) -> None:
        """Data on disk, so its pages can be dropped: `fdatasync` where it exists, else `fsync`."""
        (getattr(self.os, "fdatasync", None) or self.os.fsync)(fd)

    def drop_pages(self, fd: int) -> None:
        if hasattr(self.os, "posix_fadvise"):
            self.os.posix_fadvise(fd, 0, 0, self.os.POSIX_FADV_DONTNEED)

    def reserve(self, fd: int, extents: List[Tuple[int, int]]) -> None:
        """Allocates the (offset, length) `extents` of the new file `fd` (adjacent, in order, the last ending it),
        each apart and in `reserve_pieces`, so a full disk fails now (OSError ENOSPC), not at a write."""
        o = self.os
        total = sum(length for _, length in extents)
        if hasattr(o, "posix_fallocate"):
            try:
                for start, length in extents:
                    for off, n in reserve_pieces(start, length):
                        o.posix_fallocate(fd, off, n)
                return
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
            return  # a filesystem without allocation (some network ones): the writes report a full disk
        if self.name == "macos" and self.fcntl is not None and total:
            store = struct.pack("Iiqqq", _F_ALLOCATEALL, _F_PEOFPOSMODE, 0, total, 0)
            try:
                self.fcntl.fcntl(fd, F_PREALLOCATE, store)
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EINVAL):
                    raise
        if self.name in ("macos", "windows"):
            o.ftruncate(fd, total)  # Windows: NTFS allocates the extension (a full disk fails here)

    def replace(self, src: str, dst: str) -> None:
        self._retrying(self.os.replace, src, dst)

    def unlink(self, path: str) -> None:
        self._retrying(self.os.unlink, path)

    def rmdir(self, path: str) -> None:
        self._retrying(self.os.rmdir, path)

    def _retrying(self, fn, *args) -> None:
        """`fn(*args)`, retrying a Windows sharing violation (never ours: we close first) for `BUSY_RETRY_S`."""
        deadline, pause = time.monotonic() + BUSY_RETRY_S, 0.005
        while True:
            try:
                return fn(*args)
            except PermissionError as exc:
                if (self.name != "windows" or getattr(exc, "winerror", None) not in _SHARING_VIOLATIONS
                        or time.monotonic() > deadline):
                    raise
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def try_lock(self, fd: int) -> bool:
        """An exclusive lock on the lock file `fd` without waiting; False if another holder has it (or locks fail)."""
        try:
            if self.fcntl is not None:
                self.fcntl.flock(fd, self.fcntl.LOCK_EX | self.fcntl.LOCK_NB)
            else:
                self.os.lseek(fd, 0, 0)
                self.msvcrt.locking(fd, self.msvcrt.LK_NBLCK, 1)  # the first byte, held by this handle
            return True
        except OSError:
            return False

    def unlock_and_close(self, fd: int) -> None:
        try:
            if self.fcntl is None and self.msvcrt is not None:  # Windows wants a locked region unlocked first
                self.os.lseek(fd, 0, 0)
                self.msvcrt.locking(fd, self.msvcrt.LK_UNLCK, 1)
        except OSError:
            pass  # not held any more: closing the descriptor below releases whatever is left
        finally:
            self.os.close(fd)


class Handle:
    """An open layer file that any number of I/O threads read or write at offsets of their own, at once.

    Without positional I/O (Windows) each thread opens its own descriptor by path on first use: nobody can have
    replaced the file, since Windows refuses to rename or delete it while `fd` is open. Call `close()` only once
    no request uses the handle."""

    fd = -1  # once closed

    def __init__(self, fs: FileOS, fd: int, path: str, flags: int, cache_mode: str = "off"):
        self.fs, self.fd, self.path, self._cache_mode = fs, fd, path, cache_mode
        self._flags = flags & ~(os.O_CREAT | os.O_EXCL | getattr(os, "O_TRUNC", 0))
        self._own = {}  # thread id -> descriptor (per-thread systems only)
        self._lock = threading.Lock()

    def _fd(self) -> int:
        if not self.fs.per_thread:
            return self.fd
        me = threading.get_ident()
        fd = self._own.get(me)
        if fd is None:
            with self._lock:
                fd = self._own[me] = self.fs.open_fd(self.path, self._flags, cache_mode=self._cache_mode)
        return fd

    def pwrite(self, view: memoryview, offset: int) -> int:
        o = self.fs.os
        if not self.fs.per_thread:
            return o.pwrite(self.fd, view, offset)
        fd = self._fd()
        o.lseek(fd, offset, os.SEEK_SET)
        return o.write(fd, view)

    def preadv(self, views: List[memoryview], offset: int) -> int:
        """Fills `views` in order from `offset`; returns the bytes read (short at the end of the file)."""
        o = self.fs.os
        if not self.fs.per_thread and hasattr(o, "preadv"):
            return o.preadv(self.fd, views, offset)
        fd, done = self._fd(), 0
        if self.fs.per_thread:
            o.lseek(fd, offset, os.SEEK_SET)
        for view in views:
            if self.fs.per_thread:
                n = _readinto(o, fd, view)
            else:  # no preadv (macOS before 11): pread, then a copy
                data = o.pread(fd, len(view), offset + done)
                n = len(data)
                view[:n] = data
            done += n
            if n < len(view):
                break
        return done

    def close(self) -> None:
        """Closes every descriptor, each forgotten and closed in one line (Ctrl-C comes between lines): a second
        call after an interrupted one closes the rest, never one twice (its number may be reused)."""
        with self._lock:
            while self._own:
                self.fs.os.close(self._own.popitem()[1])
            if "fd" in self.__dict__:  # once popped, `fd` reads the class's -1
                self.fs.os.close(self.__dict__.pop("fd"))

    def __del__(self) -> None:
        # Unreferenced (a Ctrl-C as `open` returned it, before its caller stored it): no one else holds its lock.
        if "fd" in self.__dict__ or self.__dict__.get("_own"):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - a finalizer must not raise (at exit `os` may be half torn down)
                pass


def _readinto(o, fd: int, view: memoryview) -> int:
    readinto = getattr(o, "readinto", None)  # Python 3.14+
    if readinto is not None:
        return readinto(fd, view)
    with io.FileIO(fd, "rb", closefd=False) as f:
        return f.readinto(view) or 0


class Win32:
    """`CreateFileW` / `CloseHandle` through ctypes (Windows only): a handle, or OSError with the system's error."""

    def __init__(self):
        import ctypes
        from ctypes import wintypes
        self._ctypes = ctypes
        k32 = ctypes.WinDLL("kernel32", use_last_error=True)
        self._create = k32.CreateFileW
        self._create.argtypes = [wintypes.LPCWSTR, wintypes.DWORD, wintypes.DWORD, ctypes.c_void_p, wintypes.DWORD,
                                 wintypes.DWORD, wintypes.HANDLE]
        self._create.restype = wintypes.HANDLE
        self._close = k32.CloseHandle
        self._close.argtypes = [wintypes.HANDLE]

    def create_file(self, path: str, access: int, share: int, disposition: int, flags: int) -> int:
        handle = self._create(os.path.abspath(path), access, share, None, disposition, flags, None)
        if handle is None or handle == self._ctypes.c_void_p(-1).value:  # INVALID_HANDLE_VALUE
            raise self._ctypes.WinError(self._ctypes.get_last_error())
        return handle

    def close_handle(self, handle: int) -> None:
        self._close(handle)


CURRENT = FileOS(os, sys.platform, _fcntl, _msvcrt, Win32() if sys.platform == "win32" else None)


def current() -> FileOS:
    return CURRENT


@contextlib.contextmanager
def deferred_interrupts():
    """A Ctrl-C (SIGINT) inside is raised as the block ends, once what it acquired is recorded: CPython raises it
    right after the interrupted builtin call returns, so `fd = os.open(...)` could lose the descriptor. A no-op
    outside the main thread (ComfyUI samples in a worker) or under a host's own SIGINT handler."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: List[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            raise KeyboardInterrupt
