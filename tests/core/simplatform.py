"""SimPlatform: a test stand-in for the `os`, `fcntl` and `msvcrt` surface of macOS and of Windows, on Linux.

The file tiers ask `offload_core.tiers.fileos.CURRENT` for every system call that differs between systems;
`install(monkeypatch, "macos" | "windows")` swaps it for a `FileOS` built on this stand-in, so the same suites
run each system's branch on this machine's real files. What it models, as CPython has it on each system:

- macOS: no `fdatasync`, `posix_fadvise`, `posix_fallocate`, `O_DIRECT` (`without={"preadv"}`: macOS before
  11). Its `fcntl` takes `F_NOCACHE` (recorded per descriptor in `nocache`) and `F_PREALLOCATE` (an `fstore_t`,
  checked, then space really allocated), as the kernel does.
- Windows: no `pread`, `pwrite`, `preadv`, `fdatasync`, `posix_fadvise`, `posix_fallocate`, `statvfs`,
  `O_DIRECT`, `O_CLOEXEC`, `O_NOFOLLOW`, `O_NONBLOCK`, no `fcntl`; `O_BINARY` and `O_NOINHERIT` exist. A
  descriptor opened without `O_BINARY` is in text mode: each `\\n` written becomes `\\r\\n`. Deleting or renaming a
  file that is open, or renaming or removing a folder holding an open file, raises `PermissionError` with
  `winerror` 32 (recorded in `refusals`); `scanner(name, times)` makes an antivirus scanner hold files whose
  name contains `name` for the next `times` deletes or renames. `ftruncate` allocates what it extends (NTFS), writing zeros through the
  descriptor as the CRT does (so an unbuffered handle refuses it).
  `msvcrt.locking` locks through `flock` on the descriptor: per handle and dropped when the process dies, as
  on Windows. `CreateFileW` with FILE_FLAG_NO_BUFFERING (`SimWin32`) opens a real `O_DIRECT` descriptor, so the
  kernel refuses an unaligned offset, length or buffer (EINVAL) as NTFS does; `refuse_unbuffered` makes it a
  volume that does not allow unbuffered I/O. `msvcrt.open_osfhandle` hands the handle back as the descriptor.

Everything else goes to the real `os` at call time (so tests that patch `os.pwrite` still reach it).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from typing import Dict, List, Set

from offload_core.tiers.file import fileos

try:  # the stand-ins are built on a Linux host's own calls (flock, O_DIRECT, posix_fallocate)
    import fcntl as real_fcntl
except ImportError:  # Windows: the suites run on that system's own calls only
    real_fcntl = None

ABSENT = {
    "macos": {"fdatasync", "posix_fadvise", "posix_fallocate", "O_DIRECT", "POSIX_FADV_DONTNEED"},
    "windows": {"pwrite", "pread", "preadv", "pwritev", "readv", "writev", "fdatasync", "posix_fadvise",
                "posix_fallocate", "POSIX_FADV_DONTNEED", "statvfs", "O_DIRECT", "O_CLOEXEC", "O_NOFOLLOW",
                "O_NONBLOCK", "readinto"},
}
PLATFORM = {"macos": "darwin", "windows": "win32"}
# 'linux' is this machine's own system; the other two are stand-ins, where this machine can host them.
SYSTEMS = ["linux", "macos", "windows"] if real_fcntl is not None and hasattr(os, "O_DIRECT") else ["linux"]
NO_STAND_INS = "the macOS and Windows stand-ins run on a Linux host (they are built on its flock and O_DIRECT)"


def _busy(path: str) -> PermissionError:
    exc = PermissionError(errno.EACCES, "The process cannot access the file because it is being used by another "
                          "process", path)
    exc.winerror = 32
    return exc


class SimOS:
    """The stand-in `os` module of `system` ('macos' or 'windows')."""

    def __init__(self, system: str, without=()):
        self.system, self._absent = system, ABSENT[system] | set(without)
        self.windows = system == "windows"
        self.path = os.path
        self.refusals: List[str] = []
        self.text_writes = 0  # writes through a text-mode descriptor (Windows without O_BINARY)
        self.opens: List[tuple] = []  # (file name, unbuffered, for reading) of every open (Windows)
        self.writes: List[tuple] = []  # (file name, unbuffered) of every write (Windows)
        self._open: Dict[int, str] = {}  # fd -> real path (Windows: what may not be deleted or renamed)
        self._text: Set[int] = set()
        self._scanner: Dict[str, int] = {}
        self._lock = threading.RLock()  # re-entrant: a finalizer (a dropped handle) may close a descriptor while this thread opens one
        if self.windows:
            self.O_BINARY, self.O_NOINHERIT = 1 << 28, 1 << 29  # stand-in values, stripped before the real open

    def __getattr__(self, name):
        if name in self._absent:
            raise AttributeError(f"module 'os' has no attribute {name!r} (stand-in of {self.system})")
        return getattr(os, name)

    def scanner(self, name: str, times: int) -> None:
        self._scanner[name] = times

    # -- Windows semantics (macOS: the real calls) ---------------------------------------------------------
    def open(self, path, flags, mode=0o777):
        if not self.windows:
            return os.open(path, flags, mode)
        binary = flags & self.O_BINARY
        fd = os.open(path, flags & ~(self.O_BINARY | self.O_NOINHERIT), mode)
        with self._lock:
            self.opens.append((os.path.basename(path), bool(flags & os.O_DIRECT), flags & 3 == os.O_RDONLY))
            self._open[fd] = os.path.realpath(path)
            if not binary:
                self._text.add(fd)
        return fd

    def close(self, fd):
        with self._lock:
            self._open.pop(fd, None)
            self._text.discard(fd)
        os.close(fd)

    def write(self, fd, data):
        if self.windows:
            unbuffered = bool(real_fcntl.fcntl(fd, real_fcntl.F_GETFL) & os.O_DIRECT)
            self.writes.append((os.path.basename(self._open.get(fd, "")), unbuffered))
        if fd in self._text:
            self.text_writes += 1
            os.write(fd, bytes(data).replace(b"\n", b"\r\n"))
            return len(data)  # the CRT counts the caller's bytes
        return os.write(fd, data)

    def ftruncate(self, fd, length):
        size = os.fstat(fd).st_size
        if self.windows and length > size:
            # The CRT's _chsize_s extends a file by writing zeros through the descriptor from a buffer of its own
            # (the first of them written here, the rest allocated at once): an unbuffered handle refuses that.
            os.pwrite(fd, bytes(min(4096, length - size)), size)
            os.posix_fallocate(fd, 0, length)  # NTFS: a file extended is allocated, not sparse
        os.ftruncate(fd, length)

    def _refuse(self, *paths) -> None:
        if not self.windows:
            return
        for path in paths:
            real = os.path.realpath(path)
            with self._lock:
                held = [p for p in self._open.values() if p == real or p.startswith(real + os.sep)]
                scanned = [n for n, left in self._scanner.items() if left > 0 and n in os.path.basename(real)]
                for n in scanned:
                    self._scanner[n] -= 1
            if held or scanned:
                self.refusals.append(f"{os.path.basename(real)}: {'scanner' if scanned and not held else 'open'}")
                raise _busy(path)

    def unlink(self, path):
        self._refuse(path)
        os.unlink(path)

    remove = unlink

    def rmdir(self, path):
        self._refuse(path)
        os.rmdir(path)

    def replace(self, src, dst):
        self._refuse(src, dst)
        os.replace(src, dst)

    def rename(self, src, dst):
        self._refuse(src, dst)
        os.rename(src, dst)

    def open_count(self) -> int:
        return len(self._open)


class SimFcntl:
    """macOS `fcntl`: `flock` as on Linux; `F_NOCACHE` and `F_PREALLOCATE` as the kernel takes them."""

    def __init__(self):
        self.LOCK_EX, self.LOCK_NB, self.LOCK_UN, self.LOCK_SH = (real_fcntl.LOCK_EX, real_fcntl.LOCK_NB,
                                                                  real_fcntl.LOCK_UN, real_fcntl.LOCK_SH)
        self.F_GETFL, self.F_SETFL = real_fcntl.F_GETFL, real_fcntl.F_SETFL
        self.nocache: Set[int] = set()
        self.preallocated = 0

    def flock(self, fd, operation):
        return real_fcntl.flock(fd, operation)

    def fcntl(self, fd, cmd, arg=0):
        if cmd == fileos.F_NOCACHE:
            (self.nocache.add if arg else self.nocache.discard)(fd)
            return 0
        if cmd == fileos.F_PREALLOCATE:
            flags, posmode, offset, length, _ = struct.unpack("Iiqqq", arg)
            assert posmode == 3 and flags & 0x4, (flags, posmode)  # F_PEOFPOSMODE, F_ALLOCATEALL
            os.posix_fallocate(fd, 0, offset + length)  # (also sets the size: the caller's ftruncate agrees)
            self.preallocated += 1
            return struct.pack("Iiqqq", flags, posmode, offset, length, length)
        return real_fcntl.fcntl(fd, cmd, arg)


class SimWin32:
    """Win32 `CreateFileW` as the file tiers call it (FILE_FLAG_NO_BUFFERING), on a real `O_DIRECT` descriptor."""

    def __init__(self, sim_os: SimOS):
        self._os, self.refuse_unbuffered, self.opened = sim_os, False, 0

    def create_file(self, path, access, share, disposition, flags):
        assert flags == fileos.FILE_FLAG_NO_BUFFERING and share == fileos.FILE_SHARE_READ | fileos.FILE_SHARE_WRITE
        if self.refuse_unbuffered:
            exc = OSError(errno.EINVAL, "The parameter is incorrect", path)
            exc.winerror = 87  # ERROR_INVALID_PARAMETER
            raise exc
        rw = {fileos.GENERIC_READ: os.O_RDONLY, fileos.GENERIC_WRITE: os.O_WRONLY}.get(access, os.O_RDWR)
        how = {fileos.CREATE_NEW: os.O_CREAT | os.O_EXCL, fileos.CREATE_ALWAYS: os.O_CREAT | os.O_TRUNC,
               fileos.OPEN_ALWAYS: os.O_CREAT, fileos.TRUNCATE_EXISTING: os.O_TRUNC, fileos.OPEN_EXISTING: 0}
        fd = self._os.open(path, rw | how[disposition] | os.O_DIRECT | self._os.O_BINARY, 0o600)
        self.opened += 1
        return fd  # the handle: `open_osfhandle` hands it back as the descriptor

    def close_handle(self, handle):
        self._os.close(handle)


class SimMsvcrt:
    """Windows `msvcrt.locking`: an exclusive lock per handle, dropped when the process dies; `open_osfhandle`:
    the handle as a descriptor, in text mode unless `O_BINARY` is given."""

    LK_UNLCK, LK_LOCK, LK_NBLCK, LK_RLCK, LK_NBRLCK = 0, 1, 2, 3, 4

    def __init__(self, sim_os: SimOS = None):
        self._os = sim_os

    def open_osfhandle(self, handle, flags):
        if not flags & self._os.O_BINARY:
            with self._os._lock:
                self._os._text.add(handle)
        return handle

    def locking(self, fd, mode, nbytes):
        assert nbytes == 1 and os.lseek(fd, 0, os.SEEK_CUR) == 0, "the lock is on the first byte"
        if mode == self.LK_UNLCK:
            real_fcntl.flock(fd, real_fcntl.LOCK_UN)
            return
        assert mode == self.LK_NBLCK, mode
        try:
            real_fcntl.flock(fd, real_fcntl.LOCK_EX | real_fcntl.LOCK_NB)
        except BlockingIOError:
            raise PermissionError(errno.EACCES, "Permission denied") from None


def make(system: str, without=()) -> fileos.FileOS:
    """The `FileOS` of `system` ('linux': this machine's own)."""
    if system == "linux":
        return fileos.CURRENT
    sim = SimOS(system, without)
    windows = system == "windows"
    return fileos.FileOS(sim, PLATFORM[system], None if windows else SimFcntl(), SimMsvcrt(sim) if windows else None,
                         SimWin32(sim) if windows else None)


def install(monkeypatch, system: str, without=()) -> fileos.FileOS:
    """Makes every file tier opened from now on (until `monkeypatch` undoes it) use `system`'s surface."""
    fs = make(system, without)
    monkeypatch.setattr(fileos, "CURRENT", fs)
    return fs


def activate(system: str) -> None:
    """For a child process of a test: `system`'s surface for the rest of the process."""
    fileos.CURRENT = make(system)
