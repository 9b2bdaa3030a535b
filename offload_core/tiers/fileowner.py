"""Private cache directories that prove their owner alive, and reclaiming those whose owner is gone.

Each directory holds a lock file on which its creator keeps an exclusive `flock` for the directory's whole
life. The kernel drops that lock when the process dies, however it dies (SIGKILL included), so "the lock can
be taken" means exactly "nobody owns this any more". A new directory is born locked: it is made under a
hidden staging name, locked, then renamed into place, so no scan ever sees a live directory unlocked. Before
making its own, every owner reclaims the dead ones of the same prefix in the same parent — an engine store,
a diffusers session or the ComfyUI pack, in this or another process — and never touches a live one, nor
anything else in the parent.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional, Tuple

try:
    import fcntl
except ImportError:  # Windows: no flock; directories are still private, dead ones are not reclaimed
    fcntl = None

log = logging.getLogger(__name__)

LOCK_NAME = ".owner"
STAGING_GRACE_S = 60.0  # a staging directory without its lock yet is being made right now; older is debris


def _staging_prefix(prefix: str) -> str:
    return f".{prefix}new-"


def remove_tree(path: str) -> List[Tuple[str, str]]:
    """Deletes `path` as far as possible; returns (path, reason) for everything that could not be deleted."""
    problems: List[Tuple[str, str]] = []

    def note(_func, failed, exc_info):
        exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
        if not isinstance(exc, FileNotFoundError):
            problems.append((failed, f"{type(exc).__name__}: {exc}"))

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:
        shutil.rmtree(path, onerror=note)
    return problems


def remove_owned(path: str) -> List[Tuple[str, str]]:
    """Deletes the owned directory `path`, its lock file last: if anything stays, the lock file stays too, so a
    later owner still recognises the remains as a cache directory (unlocked once we let go) and reclaims them."""
    problems: List[Tuple[str, str]] = []
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return problems
    for name in names:
        if name == LOCK_NAME:
            continue
        child = os.path.join(path, name)
        if os.path.isdir(child) and not os.path.islink(child):
            problems += remove_tree(child)
            continue
        try:
            os.unlink(child)
        except FileNotFoundError:
            pass
        except OSError as exc:
            problems.append((child, f"{type(exc).__name__}: {exc}"))
    if not problems:
        problems += remove_tree(path)
    return problems


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:  # held by a live owner; or locks do not work here, so nobody can tell: leave it
        return False


def reclaim(parent: str, prefix: str) -> List[str]:
    """Deletes the directories `prefix*` in `parent` whose owner is gone; returns the ones deleted."""
    if fcntl is None:
        return []
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
        try:
            fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            # No lock file: a directory of another program (or an older version) — not ours to judge; or a
            # staging directory whose maker died before locking it, once it is clearly not being made now.
            if staging and _age(path) > STAGING_GRACE_S:
                _delete_logged(path, "an unfinished cache directory")
                reclaimed.append(path)
            continue
        except OSError:
            continue  # not a directory, unreadable: leave it
        try:
            if not _try_lock(fd):
                continue  # its owner is alive
            # We hold the dead owner's lock while deleting, so a second reclaimer skips this directory.
            _delete_logged(path, "a cache directory whose owner is gone", remove_owned)
            reclaimed.append(path)
        finally:
            os.close(fd)
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


class OwnedDir:
    """A fresh private directory under `parent`, locked for as long as this object is open."""

    def __init__(self, parent: Optional[str], prefix: str):
        parent = parent or tempfile.gettempdir()
        reclaim(parent, prefix)
        staging = tempfile.mkdtemp(prefix=_staging_prefix(prefix), dir=parent)
        self._fd: Optional[int] = None
        try:
            if fcntl is not None:
                self._fd = os.open(os.path.join(staging, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as exc:  # e.g. a network filesystem without locks: private, not reclaimable
                    log.warning("KV offload: cannot lock %s (%s); if this process dies, its cache files there are "
                                "not reclaimed automatically.", parent, exc)
                os.write(self._fd, f"{os.getpid()}\n".encode())
            self.path = os.path.join(parent, prefix + os.path.basename(staging)[len(_staging_prefix(prefix)):])
            os.rename(staging, self.path)  # a live directory is never empty, so this cannot replace one
        except BaseException:
            self._unlock()
            remove_tree(staging)
            raise

    def _unlock(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # releases the flock: from now on any new owner may reclaim what is left

    def delete(self) -> List[Tuple[str, str]]:
        """Deletes the directory, then drops the lock; logs and returns what could not be deleted.

        An interrupt (Ctrl-C) while deleting does not stop it: the deletion is finished, then the interrupt
        is raised again.
        """
        interrupt: Optional[BaseException] = None
        problems: List[Tuple[str, str]] = []
        for _ in range(10):
            try:
                problems = remove_owned(self.path)
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
