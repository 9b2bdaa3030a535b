"""A file store's park and close: the views a get served outlive a park, and a close that an interrupt stopped
anywhere is finished by the next `close()` (the line-by-line sweep is opt-in: `-m sweep`)."""

import os
import sys

import pytest

from filestores import MODES, file_store, layers
from offload_core.tiers.file import fileowner
from interrupt_lines import call_with_ctrl_c_at, lines_of


def test_the_views_a_get_served_stay_readable_after_a_park(tmp_path):
    """A caller that reads the last layer it got after the store parked (its views outlive the ring's slots)
    reads the layer, not unmapped memory: the slot's mapping goes only with its last view. In a child process,
    since the failure is a crash."""
    import subprocess
    import textwrap

    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from filestores import file_store, layers
        data = layers(2, shape=(1, 4, 1024, 64))
        for mode in ("file_sync", "file_async"):
            store = file_store(mode, {str(tmp_path)!r}, data, put=range(2))
            store.get(0)
            k, v = store.get(1)
            store.park()
            junk = [torch.full((1 << 20,), 7, dtype=torch.uint8) for _ in range(8)]  # memory the OS may reuse
            assert torch.equal(k, data[1][0]) and torch.equal(v, data[1][1]), mode
            del k, v
            assert torch.equal(store.get(0)[0], data[0][0])
            store.close()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def _close_lines():
    from offload_core.store.resources import StoreResources
    from offload_core.store.kvstore import KVStore as Store
    from offload_core.tiers.file.tier import FileTier
    from offload_core.tiers.registry import close_tiers

    functions = (Store._close, StoreResources.close, close_tiers, FileTier.close, fileowner.OwnedDir.delete,
                 fileowner.OwnedDir._unlock)
    return [(fn, line) for fn in functions for line in lines_of(fn)]


@pytest.mark.sweep
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts descriptors and threads in /proc")
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_at_every_line_of_close_then_close_again_leaves_nothing(mode, tmp_path, wait_until):
    """Ctrl-C at each line of a store's close, from the store down to its directory's lock: the second close()
    (what a user does next, or the interpreter's exit) deletes the directory, stops every I/O thread and closes
    every descriptor. Only once: the first close may well have done it all."""
    data = layers(2)
    fds, threads = len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
    interrupted = 0
    for function, line in _close_lines():
        store = file_store(mode, tmp_path, data, put=range(2))
        store.get(0)
        interrupted += call_with_ctrl_c_at(function, line, store.close)
        store.close()
        where = (function.__qualname__, line)
        assert os.listdir(tmp_path) == [], where
        wait_until(lambda: len(os.listdir("/proc/self/task")) <= threads)
        assert len(os.listdir("/proc/self/fd")) == fds, where
    assert interrupted >= 40
