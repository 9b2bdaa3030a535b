"""Ownership, not wipe: a store's directory is locked for its life; new stores reclaim only dead owners' ones.

Real processes share one parent directory: a live one keeps its files whatever the others create, a SIGKILLed
one's directory goes with the next store made there, and nothing else in the parent is touched.
"""

import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.tiers.file import fileowner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import sys, torch
    if sys.argv[3] != "linux":  # the test's system stand-in, in the child too
        sys.path.insert(0, sys.argv[4])
        import simplatform
        simplatform.activate(sys.argv[3])
    from offload_core import KVStore, OffloadConfig
    store = KVStore(OffloadConfig(mode=sys.argv[1], file_dir=sys.argv[2]), "cpu")
    data = {i: (torch.full((64, 64), float(i)), torch.full((64, 64), -float(i))) for i in range(4)}
    for key, (k, v) in data.items():
        store.put(key, k, v)
    store.get(0)
    print(store.stats()["file_dir"], flush=True)
    for line in sys.stdin:  # each line: read every layer back and say whether it is exact
        ok = all(torch.equal(store.get(i)[0], data[i][0]) and torch.equal(store.get(i)[1], data[i][1]) for i in data)
        print("exact" if ok else "WRONG", flush=True)
""")


class Child:
    def __init__(self, mode, parent, system):
        here = os.path.dirname(os.path.abspath(__file__))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(parent), system.name, here],
                                     stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        self._directory = None

    @property
    def directory(self) -> str:
        if self._directory is None:
            self._directory = self.proc.stdout.readline().strip()
            assert os.path.isdir(self._directory), "the child did not start its store"
        return self._directory

    def check(self) -> str:
        self.proc.stdin.write("check\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def small_store(parent, mode="file_sync"):
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(parent)), "cpu")
    store.put(0, torch.ones(8, 8), torch.zeros(8, 8))
    return store


@pytest.mark.slow
def test_two_processes_share_a_parent_and_a_killed_ones_files_are_reclaimed(tmp_path, system):
    mode = "file_async"  # ownership is the same for both file tiers; the children start side by side
    unrelated = tmp_path / "kv_offload-not-a-cache"  # no lock file: not ours to judge, whatever its name
    unrelated.mkdir()
    (tmp_path / "user-file.bin").write_bytes(b"x")
    first, second = Child(mode, tmp_path, system), Child(mode, tmp_path, system)
    try:
        ours = small_store(tmp_path, mode)  # a third owner, made while both others live
        assert os.path.isdir(first.directory) and os.path.isdir(second.directory)
        assert first.check() == "exact" and second.check() == "exact"
        first.kill()  # SIGKILL: no close, no finalizer, no atexit
        assert os.path.isdir(first.directory)
        again = small_store(tmp_path, mode)  # the next store made in that parent reclaims the dead one's files
        assert not os.path.exists(first.directory)
        assert second.check() == "exact"  # the live one is untouched
        assert ours.get(0)[0].sum() == 64
        assert unrelated.is_dir() and (tmp_path / "user-file.bin").exists()
        ours.close()
        again.close()
    finally:
        first.stop()
        second.stop()
    assert not os.path.exists(second.directory)  # closed normally at exit
    assert sorted(os.listdir(tmp_path)) == ["kv_offload-not-a-cache", "user-file.bin"]


def test_reclaim_skips_a_live_owner_in_this_process(tmp_path):
    live = small_store(tmp_path)
    directory = live.stats()["file_dir"]
    assert fileowner.reclaim(str(tmp_path), "kv_offload-") == []
    assert os.path.isdir(directory) and live.get(0)[0].sum() == 64
    live.close()


def test_a_dead_owners_unfinished_staging_directory_is_reclaimed_once_old(tmp_path):
    fresh = tmp_path / ".kv_offload-new-abc"
    old = tmp_path / ".kv_offload-new-def"
    fresh.mkdir()
    old.mkdir()
    os.utime(old, (0, 0))
    assert fileowner.reclaim(str(tmp_path), "kv_offload-") == [str(old)]
    assert fresh.is_dir() and not old.exists()


def test_a_directory_that_cannot_be_deleted_is_logged_with_the_reason(tmp_path, caplog):
    store = small_store(tmp_path)
    busy = os.path.join(store.stats()["file_dir"], "busy")
    os.mkdir(busy)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", busy], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
    try:
        with caplog.at_level(logging.WARNING, logger="offload_core.tiers.file.fileowner"):
            store.close()  # a mount point cannot be removed: EBUSY
        assert "could not delete the cache directory" in caplog.text and "busy" in caplog.text
        assert "Device or resource busy" in caplog.text
        assert not [f for f in os.listdir(store.stats()["file_dir"]) if f.endswith(".safetensors")]
    finally:
        subprocess.run(["umount", "-l", busy], capture_output=True)
    # Its lock is released: the next store there reclaims what is left.
    again = small_store(tmp_path)
    assert not os.path.exists(busy)
    again.close()


@pytest.mark.sweep
def test_ctrl_c_at_every_line_of_making_a_directory_leaves_nothing_in_the_parent(tmp_path, system):
    # (On Windows under a staging name first.) An empty directory without a lock file is not ours to judge for any
    # later store (it may be another program's), so one left by an interrupted make would stay for good.
    import tempfile

    from interrupt_lines import ctrl_c_at, lines_of

    lines = [(fn, line) for fn in (fileowner.OwnedDir.__init__, fileowner._make_dir, tempfile.mkdtemp)
             for line in lines_of(fn)]
    interrupted = 0
    for function, line in lines:
        with ctrl_c_at(function, line) as fired:
            try:
                fileowner.OwnedDir(str(tmp_path), "kv_offload-").delete()
            except KeyboardInterrupt:
                pass
        interrupted += bool(fired)
        assert os.listdir(tmp_path) == [], (function.__qualname__, line)
    assert interrupted >= 12


def test_a_directory_being_made_is_never_reclaimed_between_its_lock_files_creation_and_its_lock(tmp_path,
                                                                                              monkeypatch):
    # Another process's store reclaims dead owners' directories in the same parent at the worst moment: after the
    # new directory's lock file exists, before it is locked. The new one must survive, locked.
    if not fileowner.fileos.current().renames_open:
        pytest.skip("made under its final name here: the lock is retried while a reclaimer holds it")
    real_lock, reclaimed = fileowner.OwnedDir._lock, []

    def lock_late(self, fs, bounded):
        reclaimed.extend(fileowner.reclaim(str(tmp_path), "kv_offload-"))
        return real_lock(self, fs, bounded)
    monkeypatch.setattr(fileowner.OwnedDir, "_lock", lock_late)
    owned = fileowner.OwnedDir(str(tmp_path), "kv_offload-")
    monkeypatch.undo()
    assert reclaimed == [] and os.path.isdir(owned.path)
    assert fileowner.reclaim(str(tmp_path), "kv_offload-") == []  # locked: alive
    owned.delete()
    assert os.listdir(tmp_path) == []
