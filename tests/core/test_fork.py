"""A store belongs to the process that made it: in a forked child (multiprocessing's default start on Linux before
Python 3.14) every use of it fails at once, saying so, and nothing the child does or its exit runs deletes,
unlocks or closes the parent's files and buffers. Real forks, real files."""

import atexit
import gc
import multiprocessing
import os
import sys
import time

import pytest
import torch

from offload_core import KVStore, OffloadConfig

from store_helpers import make_layers, put_all

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="this system has no fork (Windows)")

MODES = ["file_sync", "file_async", "ram_async_spill"]


def config(mode, directory):
    if mode == "ram_async_spill":  # RAM within its budget, the rest in files
        return OffloadConfig(mode="ram_async", host_budget=16384, file_dir=str(directory))
    return OffloadConfig(mode=mode, file_dir=str(directory))


def interpreter_exit(code):
    """What a child's normal exit runs (atexit handlers, every pending `weakref.finalize` among them), then the
    exit itself; a `sys.exit` here would unwind into the test runner the child inherited."""
    atexit._run_exitfuncs()
    os._exit(code)


def in_child(action, *, exit_with=os._exit):
    """Forks; the child runs `action()` and exits 0 if it returned, 1 if it raised (its message on stderr);
    returns the child's exit status."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            action()
        except BaseException as exc:  # noqa: BLE001 - the child reports whatever happened through its status
            print(f"child: {type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
        exit_with(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def files_under(directory):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs)


def assert_serves(store, layers):
    for _ in range(2):
        for key, (k, v) in layers.items():
            got_k, got_v = store.get(key)
            assert torch.equal(got_k, k) and torch.equal(got_v, v), key


@pytest.fixture
def parent_store(tmp_path, monkeypatch, request):
    """A file-backed store with every layer on disk, and the files it holds."""
    monkeypatch.setenv("KV_OFFLOAD_IO_TIMEOUT_S", "2")  # a child that waits for I/O threads it lacks fails fast
    layers = make_layers(range(5), torch.float32, seed=40)
    store = KVStore(config(request.param, tmp_path), "cpu")
    put_all(store, layers)
    store.flush()
    assert_serves(store, layers)  # the layer order is learned; prefetches are in flight in file_async
    before = files_under(tmp_path)
    assert any(f.endswith(".safetensors") for f in before)
    yield store, layers, before
    store.close()
    assert files_under(tmp_path) == []  # the parent's close still deletes everything


def refused(call):
    """The child's `call()` must raise at once, naming the fork."""
    def action():
        start = time.monotonic()
        try:
            call()
        except RuntimeError as exc:
            assert "forked child" in str(exc) and str(os.getppid()) in str(exc), exc
            assert time.monotonic() - start < 1.0
            return
        raise AssertionError("the child's call was not refused")
    return action


@pytest.mark.parametrize("parent_store", MODES, indirect=True)
@pytest.mark.parametrize("what", ["get", "put", "flush", "park"])
def test_a_child_cannot_use_its_parents_store(parent_store, what, tmp_path):
    store, layers, before = parent_store
    calls = {"get": lambda: store.get(0), "put": lambda: store.put(99, *layers[0]), "flush": store.flush,
             "park": store.park}
    assert in_child(refused(calls[what])) == 0
    assert files_under(tmp_path) == before
    assert_serves(store, layers)


def _close_then_drop(store):
    def action():
        store.close()
        assert store.closed and store.stats()["layers"] == 5
        with pytest.raises(RuntimeError, match="forked child"):
            store.get(0)
    return action


@pytest.mark.parametrize("parent_store", MODES, indirect=True)
@pytest.mark.parametrize("ending", ["close", "with_block", "gc_and_exit", "os_exit", "raise", "mp_fork"])
def test_nothing_the_child_does_or_its_exit_runs_touches_the_parents_files(parent_store, ending, tmp_path):
    store, layers, before = parent_store
    if ending == "close":
        assert in_child(_close_then_drop(store)) == 0
    elif ending == "with_block":
        def action():
            with store:
                pass  # a `with KVStore(...)` block the child leaves: its close() leaves the parent's files
        assert in_child(action) == 0
    elif ending == "gc_and_exit":  # the child drops its copy and exits normally: finalizers and atexit run
        def action():
            global _dropped
            _dropped = store  # the only reference the child then drops
            del _dropped
            gc.collect()
        assert in_child(action, exit_with=interpreter_exit) == 0
    elif ending == "os_exit":
        assert in_child(lambda: None) == 0
    elif ending == "raise":
        assert in_child(lambda: 1 / 0) == 1
    else:
        child = multiprocessing.get_context("fork").Process(target=store.close)
        child.start()
        child.join(30)
        assert child.exitcode == 0
    assert files_under(tmp_path) == before
    assert_serves(store, layers)
    store.put("later", *layers[1])  # the parent's I/O threads and locks are all still there
    assert_serves(store, {"later": layers[1]})


@pytest.mark.parametrize("parent_store", ["file_async"], indirect=True)
def test_a_childs_close_never_waits_for_a_lock_a_parents_thread_held_at_the_fork(parent_store, tmp_path):
    # A fork copies locks as they are: one held by another thread of the parent (a get in progress) stays held
    # in the child, where that thread does not exist. close() must touch none of them.
    import signal
    import threading

    store, layers, before = parent_store
    held, done = threading.Event(), threading.Event()

    def busy():
        with store._busy:
            held.set()
            done.wait(30)
    worker = threading.Thread(target=busy)
    worker.start()
    held.wait(30)

    def action():
        signal.alarm(5)  # a hang fails the child instead of the whole run
        store.close()
        signal.alarm(0)
    try:
        assert in_child(action) == 0
    finally:
        done.set()
        worker.join()
    assert files_under(tmp_path) == before
    assert_serves(store, layers)


@pytest.mark.parametrize("parent_store", ["file_async"], indirect=True)
def test_a_child_makes_its_own_store_beside_the_parents_and_reclaims_nothing_live(parent_store, tmp_path):
    store, layers, before = parent_store

    def action():
        with KVStore(config("file_async", tmp_path), "cpu") as own:
            put_all(own, layers)
            assert_serves(own, layers)
    assert in_child(action) == 0
    assert files_under(tmp_path) == before  # the child's directory went with its close; the parent's stayed
    assert_serves(store, layers)
    with KVStore(config("file_sync", tmp_path), "cpu") as other:  # a new store in the parent: reclaims nothing
        other.put(0, *layers[0])
        assert set(before) <= set(files_under(tmp_path))
    assert_serves(store, layers)


@pytest.mark.parametrize("parent_store", ["file_sync"], indirect=True)
def test_a_child_that_outlives_its_parent_does_not_keep_the_parents_directory(parent_store, tmp_path):
    # The child closes its copies of the lock descriptors at the fork: were it to keep them, the directory of a
    # parent killed meanwhile would look alive for as long as the child runs, and never be reclaimed.
    from offload_core.tiers.file import fileos, fileowner

    store, _, _ = parent_store
    owned = [d for d in list(fileowner._OPEN) if d.path.startswith(str(tmp_path))]
    assert owned and owned[0]._fd is not None

    def action():
        assert all(d._fd is None for d in owned)  # the child's copies are closed...
        fd = os.open(os.path.join(owned[0].path, fileowner.LOCK_NAME), os.O_RDWR)
        try:
            assert not fileos.current().try_lock(fd)  # ...and the parent still holds its lock
        finally:
            os.close(fd)
    assert in_child(action) == 0
    assert owned[0]._fd is not None


def test_a_child_leaves_the_stores_its_parents_prefix_registry_keeps(tmp_path):
    # The registry's finalizer closes every kept store at interpreter exit: not in a forked child.
    from offload_core.reuse.registry import PrefixRegistry

    from registry_stores import filled_store, key

    registry = PrefixRegistry()
    store, layers = filled_store("file_sync", tmp_path)
    assert registry.admit(key(torch.ones(2)), store)
    before = files_under(tmp_path)
    assert in_child(lambda: None, exit_with=interpreter_exit) == 0
    assert files_under(tmp_path) == before
    entry = registry.lookup(key(torch.ones(2)))
    assert entry is not None and torch.equal(entry.store.get(0)[0], layers[0][0])
    registry.release(entry)
    registry.close()
    assert files_under(tmp_path) == []
