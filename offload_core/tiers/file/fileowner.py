"""Private cache directories locked by their owner for life, and reclaiming those whose owner is gone.

The system drops the lock (`flock`, `msvcrt.locking` on Windows: `fileos`) when its process dies, even by SIGKILL,
so a lock that can be taken means a dead owner. A directory is born locked: made under a hidden staging name,
locked, then renamed into place (Windows renames no folder holding an open file: there it is made in place, and the
maker waits, bounded, for a racing reclaimer to let go). Our descriptors close before deletion (Windows requires it),
the lock file last."""

from __future__ import annotations

import logging
import os
import secrets
import stat
import tempfile
import time
import weakref
from typing import Callable, List, Optional, Tuple

from . import fileos

log = logging.getLogger(__name__)

LOCK_NAME = ".owner"
STAGING_GRACE_S = 60.0  # a staging directory without its lock yet is being made right now; older is debris


def _staging_prefix(prefix: str) -> str:
    return f".{prefix}new-"


def remove_tree(path: str, keep: Optional[str] = None) -> List[Tuple[str, str]]:
    """Deletes the file or folder `path` but the top folder's entry `keep`; returns (path, reason) for what stayed.
    Symbolic links are deleted, never followed."""
    fs = fileos.current()
    problems: List[Tuple[str, str]] = []

    def attempt(fn, target: str) -> None:
        try:
            fn(target)
        except FileNotFoundError:
            pass  # removed meanwhile by its owner or another reclaimer
        except OSError as exc:
            problems.append((target, f"{type(exc).__name__}: {exc}"))

    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return problems
    if not is_dir:
        attempt(fs.unlink, path)
        return problems
    try:
        names = os.listdir(path)
    except OSError as exc:
        return [(path, f"{type(exc).__name__}: {exc}")]
    for name in names:
        if name != keep:
            problems += remove_tree(os.path.join(path, name))
    if keep is None:
        attempt(fs.rmdir, path)
    return problems


def remove_owned(path: str, unlock: Callable[[], None]) -> List[Tuple[str, str]]:
    """Deletes the owned directory `path`, its lock file last, after `unlock()`; if anything else stays, the lock
    file stays too, so a later owner recognises the remains and reclaims them."""
    problems = remove_tree(path, keep=LOCK_NAME)
    unlock()
    if not problems:
        problems += remove_tree(path)
    return problems


def reclaim(parent: str, prefix: str) -> List[str]:
    """Deletes the directories `prefix*` in `parent` whose owner is gone; returns the ones deleted."""
    fs = fileos.current()
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    reclaimed = []
    for name in names:
        staging = name.startswith(_staging_prefix(prefix))
        if not (name.startswith(prefix) or staging):
            continue
        path = os.path.join(parent, name)
        if staging and _age(path) <= STAGING_GRACE_S:
            continue  # being made now: its lock file may not be locked yet
        try:
            with fileos.deferred_interrupts():  # into `held` before a Ctrl-C is raised
                held = [fs.os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | fs.open_flags | fs.no_follow)]
        except FileNotFoundError:
            # No lock file: another program's directory (not ours to judge), or staging whose maker died.
            if staging:
                _delete_logged(path, "an unfinished cache directory")
                reclaimed.append(path)
            continue
        except OSError:
            continue  # not a directory, unreadable: leave it

        def unlock(held=held) -> None:
            if held:
                fs.unlock_and_close(held.pop())

        try:
            if not fs.try_lock(held[0]):
                continue  # its owner is alive, or locks do not work here (nobody can tell): leave it
            # We hold the dead owner's lock while deleting, so a second reclaimer skips this directory.
            _delete_logged(path, "a cache directory whose owner is gone", lambda p: remove_owned(p, unlock))
            reclaimed.append(path)
        finally:
            unlock()
    return reclaimed


def _age(path: str) -> float:
    try:
        return time.time() - os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _delete_logged(path: str, what: str, remove=remove_tree) -> None:
    problems = remove(path)
    if problems:
        log.warning("KV offload: could not delete %s %r: %s", what, path,
                    "; ".join(f"{p}: {why}" for p, why in problems[:5]))
    else:
        log.info("KV offload: reclaimed %s: %s", what, path)


_OPEN: "weakref.WeakSet[OwnedDir]" = weakref.WeakSet()  # the directories this process owns and holds locked


def _forget_in_child() -> None:
    """A forked child closes (never unlocks: that drops the parent's `flock`) its copies of the lock descriptors,
    so a child that outlives its parent does not keep the parent's directory locked."""
    for owned in list(_OPEN):
        fd, owned._fd = owned._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _make_dir(parent: str, prefix: str, names: List[str]) -> str:
    """`tempfile.mkdtemp`, but named in `names` before it exists: on an interrupt the caller's cleanup knows it."""
    while True:
        names.append(os.path.join(parent, prefix + secrets.token_hex(6)))
        try:
            os.mkdir(names[-1], 0o700)
            return names[-1]
        except FileExistsError:
            names.pop()  # another one's


def _remove_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # never made, or not empty: not ours to remove


class OwnedDir:
    """A fresh private directory under `parent`, locked for as long as this object is open."""

    _fd: Optional[int] = None  # the lock's descriptor, while held

    def __init__(self, parent: Optional[str], prefix: str):
        parent = parent or tempfile.gettempdir()
        fs = fileos.current()
        reclaim(parent, prefix)
        staged = fs.renames_open
        names: List[str] = []  # the directory's name, taken before it is made
        try:
            made = _make_dir(parent, _staging_prefix(prefix) if staged else prefix, names)
            with fileos.deferred_interrupts():  # the descriptor is recorded before a Ctrl-C is raised
                self._fd = fs.os.open(os.path.join(made, LOCK_NAME), os.O_RDWR | os.O_CREAT | fs.open_flags, 0o600)
            if not self._lock(fs, bounded=not staged):  # e.g. a network filesystem without locks
                log.warning("KV offload: cannot lock a cache directory in %s; if this process dies, its cache files "
                            "there are not reclaimed automatically.", parent)
            fs.os.write(self._fd, f"{os.getpid()}\n".encode())
            _OPEN.add(self)
            self.path = made
            if staged:
                self.path = os.path.join(parent, prefix + os.path.basename(made)[len(_staging_prefix(prefix)):])
                fs.os.rename(made, self.path)  # a live directory is never empty, so this cannot replace one
        except BaseException:
            locked = self._fd is not None  # its lock file made: what is in it is ours
            self._unlock()
            for made in names:
                if locked:
                    remove_tree(made)
                else:  # interrupted inside the make: only an empty one (a live one holds a lock)
                    _remove_empty(made)
            raise

    def _lock(self, fs, bounded: bool) -> bool:
        """Takes the lock; `bounded`: for a moment, while a reclaimer that raced the directory's birth lets go."""
        deadline = time.monotonic() + (1.0 if bounded else 0.0)
        while not fs.try_lock(self._fd):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _unlock(self) -> None:
        with fileos.deferred_interrupts():  # forgotten and closed together: a repeated call finds it open or gone
            if self.__dict__.get("_fd") is not None:  # `_fd` then reads the class's None
                fileos.current().unlock_and_close(self.__dict__.pop("_fd"))  # a new owner may reclaim what is left

    def delete(self) -> List[Tuple[str, str]]:
        """Deletes the directory, then drops the lock; logs and returns what could not be deleted. A Ctrl-C while
        deleting is raised again once the deletion is finished."""
        interrupt: Optional[BaseException] = None
        problems: List[Tuple[str, str]] = []
        for _ in range(10):
            try:
                problems = remove_owned(self.path, self._unlock)
                break
            except KeyboardInterrupt as exc:
                interrupt = exc
        self._unlock()
        if problems:
            log.warning("KV offload: could not delete the cache directory %r: %s", self.path,
                        "; ".join(f"{p}: {why}" for p, why in problems[:5]))
        if interrupt is not None:
            raise interrupt
        return problems
