"""Ctrl-C at every await point of the file tiers: inside close(), at every step of a put's chunk ring, while
the write staging is freed, while a layer file is allocated, between the requests of a read and at every line of
one, while a read waits for the earlier one into its slot. Each leaves no descriptor, temp file, staging place or
directory behind, and the store works (or closes) as before. (Park and close line by line:
`test_file_park_close_interrupts.py`; put line by line: `test_file_put_interrupts.py`.)"""

import os
import signal
import threading
import time

import pytest
import torch

from filestores import MODES, file_store, file_tier, free_places, layers, open_files
from offload_core import KVStore, OffloadConfig
from offload_core.tiers.file import fileowner, iopool
from store_helpers import make_layers


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_inside_close_still_deletes_everything_then_raises(mode, tmp_path, monkeypatch):
    data = layers(3)
    store = file_store(mode, tmp_path, data, put=range(3))
    store.get(0)
    real_shutdown = iopool.IOPool.shutdown
    real_rmtree = fileowner.remove_tree
    hits = {"shutdown": 0, "rmtree": 0}

    def interrupted_shutdown(self, timeout):
        hits["shutdown"] += 1
        if hits["shutdown"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, delivered while close() waits for the I/O
            time.sleep(1)  # the handler raises KeyboardInterrupt here
        return real_shutdown(self, timeout)

    def interrupted_rmtree(path, *args, **kwargs):
        hits["rmtree"] += 1
        if hits["rmtree"] == 1:
            raise KeyboardInterrupt  # and a second one in the middle of deleting
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(iopool.IOPool, "shutdown", interrupted_shutdown)
    monkeypatch.setattr(fileowner, "remove_tree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        store.close()
    assert hits["shutdown"] >= 2 and hits["rmtree"] >= 2
    assert os.listdir(tmp_path) == []
    assert store.closed
    store.close()  # idempotent after an interrupted close


def interrupting(real, n, after):
    """`real`, with Ctrl-C at its `n`-th call: before it runs, or (`after`) once it has returned."""
    calls = []

    def call(*args, **kwargs):
        result = real(*args, **kwargs) if after else None
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return result if after else real(*args, **kwargs)

    return call


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="looks for open descriptors in /proc")
@pytest.mark.parametrize("where", ["waiting for a staging buffer", "just after taking a staging buffer",
                                   "copying a chunk", "just after queueing a chunk", "just after queueing the finish"])
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_at_every_chunk_of_a_put_loses_nothing(mode, where, tmp_path, monkeypatch, wait_until):
    # A put copies a layer chunk by chunk through a ring of staging buffers, queueing each chunk's write as soon
    # as it is copied. Ctrl-C between any two of those steps breaks the store; close() waits for the requests
    # already queued, then the descriptor and the temp file go and every buffer comes back.
    from offload_core.tiers.file import filewrite, fileio

    monkeypatch.setattr(fileio, "CHUNK", 512 << 10)
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 5.0)  # a staging buffer never given back fails fast
    data = layers(3, shape=(1, 2, 2048, 128))  # 4 MiB a layer: eight chunks, more than the ring's buffers
    for at in range(1 if where.endswith("the finish") else 8):  # a put queues one finish, after its eight chunks
        store = file_store(mode, tmp_path, data, put=[0])
        tier = file_tier(store)
        # The call to interrupt, and whether the interrupt comes as it returns. The ring is smaller than a
        # layer, so a put also waits for buffers.
        owner, name, after = {
            "waiting for a staging buffer": (tier._writer.staging, "acquire", False),
            "just after taking a staging buffer": (tier._writer.staging, "acquire", True),
            "copying a chunk": (filewrite, "copy_range", False),
            "just after queueing a chunk": (tier._chunks, "submit", True),
            "just after queueing the finish": (tier._lanes["write"], "submit", True),
        }[where]
        monkeypatch.setattr(owner, name, interrupting(getattr(owner, name), at + 1, after))
        with pytest.raises(KeyboardInterrupt):
            store.put(1, *data[1])
        monkeypatch.undo()
        monkeypatch.setattr(fileio, "CHUNK", 512 << 10)
        monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 5.0)
        for call in (lambda: store.put(2, *data[2]), lambda: store.get(0)):  # nothing more: it is broken
            with pytest.raises(RuntimeError, match="is broken: an earlier put .KeyboardInterrupt."):
                call()
        store.close()  # waits for the requests already queued, then frees every buffer, descriptor and file
    assert not open_files(str(tmp_path))  # not one descriptor of the stores' files, deleted or not
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="looks for open descriptors in /proc")
def test_ctrl_c_while_a_layer_file_is_allocated_leaves_no_descriptor_or_temp_file(tmp_path, monkeypatch):
    data = layers(2)
    store = file_store("file_sync", tmp_path, data, put=[0])
    store.flush()

    def fallocate(fd, offset, length):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(KeyboardInterrupt):
        store.put(1, *data[1])
    monkeypatch.undo()
    assert not open_files("layer-00001")  # the temp file's descriptor
    assert [n for n in os.listdir(store.stats()["file_dir"]) if not n.startswith(".")] == ["layer-00000.safetensors"]
    with pytest.raises(RuntimeError, match="is broken"):
        store.put(1, *data[1])
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="looks for open descriptors in /proc")
@pytest.mark.parametrize("at", [1, 3, 8])  # the first, a middle and the last of the layer's 8 requests
def test_ctrl_c_between_the_requests_of_a_read_loses_nothing(at, tmp_path, monkeypatch, wait_until):
    """Ctrl-C as a read queues its requests (8 chunks of 64 KiB): the requests
    already queued finish, then their descriptor and buffer go; the store is broken until closed."""
    from offload_core.tiers.file import fileio

    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)
    data = layers(2, shape=(1, 4, 256, 64))  # 512 KiB a layer: 8 chunks
    store = file_store("file_sync", tmp_path, data, put=data)
    store.get(0)
    store.flush()
    tier = file_tier(store)
    real, calls = iopool.IOPool.submit, []

    def submit(pool, fn, what, into=None, done=None):
        if pool is tier._chunks and what.startswith("the read of"):
            calls.append(what)
            if len(calls) == at:
                raise KeyboardInterrupt
        return real(pool, fn, what, into=into, done=done)

    monkeypatch.setattr(iopool.IOPool, "submit", submit)
    with pytest.raises(KeyboardInterrupt):
        store.get(1)
    monkeypatch.setattr(iopool.IOPool, "submit", real)
    wait_until(lambda: not open_files("layer-00001"))  # the read's descriptor, once its requests ran
    staging = tier._reader.staging
    wait_until(lambda: len(set(free_places(staging))) == 1)  # every read staging place back
    with pytest.raises(RuntimeError, match="is broken"):
        store.get(1)
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_close_interrupted_before_its_io_stopped_frees_no_buffer_a_read_may_fill(tmp_path, monkeypatch):
    """Three Ctrl-Cs while close() waits for its I/O threads (a slow disk: a read is inside the kernel): close goes
    on, but frees no staging buffer, since the read may still fill it."""
    from offload_core.host.devices import DONE
    from offload_core.tiers.file import fileread

    data = layers(1, shape=(1, 4, 1024, 256))  # 4 MiB a layer: its read staging is kept where it may be
    store = file_store("file_async", tmp_path, data, put=[0])
    store.flush()
    tier = file_tier(store)
    inside, disk = threading.Event(), threading.Event()
    real_pread, real_shutdown = fileread.pread_exact, iopool.IOPool.shutdown

    def slow_pread(fd, view, off, path, head=None):
        inside.set()
        assert disk.wait(30), "the test never let the disk answer"
        return real_pread(fd, view, off, path, head=head)

    def interrupted_shutdown(pool, timeout):
        real_shutdown(pool, 0)
        raise KeyboardInterrupt  # in the wait for the threads

    monkeypatch.setattr(fileread, "pread_exact", slow_pread)
    slot = torch.empty(tier._files[0].layout.data_bytes, dtype=torch.uint8)  # not the tier's: read via staging
    tier._reader.load(tier._files[0], slot, DONE)
    assert inside.wait(10)
    held = tier._reader.staging.buffers()
    monkeypatch.setattr(iopool.IOPool, "shutdown", interrupted_shutdown)
    try:
        with pytest.raises(KeyboardInterrupt):
            tier.close()
        assert held and all(b.tensor is not None for b in held)
    finally:
        monkeypatch.setattr(iopool.IOPool, "shutdown", real_shutdown)
        disk.set()
    store.close()


def test_a_read_whose_descriptor_fails_to_close_still_frees_its_place_and_its_slot(tmp_path, monkeypatch):
    """The cleanup after a read closes its descriptor, gives its staging place back and lets the next load into
    the slot go on; a close that fails (EIO on a network filesystem) must not stop the other two."""
    from offload_core.tiers.file import fileos

    data = layers(2)
    store = file_store("file_sync", tmp_path, data, put=data)
    store.flush()
    tier = file_tier(store)
    real_close, failed = fileos.Handle.close, []

    def failing_close(handle):
        real_close(handle)
        if not failed:
            failed.append(handle)
            raise OSError(5, "Input/output error")
    monkeypatch.setattr(fileos.Handle, "close", failing_close)
    with pytest.raises(OSError):
        store.get(0)
    staging = tier._reader.staging
    assert len(set(free_places(staging))) == 1
    assert not any(tier._reader.writing(address) for address in tier._reader.filling)
    with pytest.raises(RuntimeError, match="is broken"):
        store.get(1)
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("at", [1, 2, 4])  # the I/O pool, then the lanes (file_async has three)
def test_ctrl_c_while_a_file_tier_is_made_leaves_no_directory_or_thread(at, tmp_path, monkeypatch):
    from offload_core.tiers.file import tier as file_module

    made, real = [], file_module.IOPool

    def pool(*args, **kwargs):
        if len(made) + 1 == at:
            raise KeyboardInterrupt
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(file_module, "IOPool", pool)
    before = {t.ident for t in threading.enumerate()}
    store = KVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cpu")
    with pytest.raises(KeyboardInterrupt):
        store.put(0, *make_layers([0], torch.float32)[0])
    store.close()
    assert os.listdir(tmp_path) == []
    assert all(p._closed for p in made)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
