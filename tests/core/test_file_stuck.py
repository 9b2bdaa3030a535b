"""The file tiers never hang: no staging starvation, bounded waits, close() past a read stuck in the kernel,
and close() finishing its cleanup when Ctrl-C arrives inside it."""

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import torch

from offload_core import KVStore, KVWriteError, OffloadConfig
from offload_core.tiers import fileowner, iopool

MODES = ["file_sync", "file_async"]


def layers(n, shape=(1, 2, 256, 64)):
    gen = torch.Generator().manual_seed(3)
    return {i: (torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)) for i in range(n)}


def run_bounded(fn, seconds):
    """Runs `fn` in a thread; fails the test (instead of hanging it) if it has not finished in `seconds`."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not finish within {seconds} s: deadlock"
    if "error" in box:
        raise box["error"]
    return box.get("result")


@pytest.mark.parametrize("depth", range(1, 9))
def test_put_after_get_finishes_at_every_depth(depth, tmp_path):
    data = layers(12)

    def scenario():
        store = KVStore(OffloadConfig(mode="file_async", prefetch_depth=depth, file_dir=str(tmp_path)), "cpu")
        for key in range(10):
            store.put(key, *data[key])
        for key in range(3):  # reads queued ahead of the consumer hold read staging
            store.get(key)
        store.put(10, *data[10])  # used to wait for staging held by reads queued behind its own write
        store.put(11, *data[11])
        for key in [*range(12), *range(12)]:
            k, v = store.get(key)
            assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])
        store.close()

    run_bounded(scenario, 60)
    assert os.listdir(tmp_path) == []


class StuckReads:
    """Stand-in for a read stuck in the kernel (a dead NFS server): preadv of one file blocks until released."""

    def __init__(self, name):
        self.name = name
        self.release = threading.Event()
        self.entered = threading.Event()
        self.real = os.preadv

    def __call__(self, fd, buffers, offset, *args):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith(self.name):
            self.entered.set()
            self.release.wait(60)
            raise OSError(5, "Input/output error")
        return self.real(fd, buffers, offset, *args)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a read is for")
@pytest.mark.parametrize("mode", MODES)
def test_read_stuck_in_the_kernel_fails_get_and_close_within_the_bound(mode, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 0.5)
    data = layers(4)
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    consumer = ThreadPoolExecutor(1, thread_name_prefix="consumer")  # a store serves one consumer thread

    def bounded(fn, seconds):
        future = consumer.submit(fn)
        try:
            return future.result(timeout=seconds)
        except FutureTimeout:
            if future.done():
                raise  # the call's own timeout error
            pytest.fail(f"did not finish within {seconds} s: deadlock")

    bounded(lambda: [store.put(key, *data[key]) for key in range(4)] and store.get(0), 30)
    stuck = StuckReads("layer-00002.safetensors")
    monkeypatch.setattr(os, "preadv", stuck)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"the read of .*layer-00002\.safetensors did not finish within 0\.5 s"):
            bounded(lambda: (store.get(1), store.get(2)), 10)
        assert stuck.entered.is_set()
        with caplog.at_level(logging.ERROR, logger="offload_core.tiers.file"):
            bounded(store.close, 10)
        assert time.monotonic() - start < 8
        assert "stuck in the kernel" in caplog.text and "layer-00002" in caplog.text
        assert os.listdir(tmp_path) == []
    finally:
        stuck.release.set()
        consumer.shutdown(wait=False)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a write is for")
@pytest.mark.parametrize("mode", MODES)
def test_write_stuck_in_the_kernel_fails_flush_and_close_within_the_bound(mode, tmp_path, monkeypatch, caplog,
                                                                           wait_until):
    # A chunk's pwrite never returns (a dead network disk). The layer's finish gives up after the bound, the
    # store takes no more layers, and close() walks away from the request: its buffer is never handed to
    # another chunk (the kernel may still read it) and its descriptor never closed.
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 0.5)
    data = layers(3)
    real, entered, release = os.pwrite, threading.Event(), threading.Event()

    def pwrite(fd, buffer, offset):
        if "layer-00001" in os.readlink(f"/proc/self/fd/{fd}"):
            entered.set()
            release.wait(60)
        return real(fd, buffer, offset)

    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    store.put(0, *data[0])
    store.flush()
    descriptors = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "pwrite", pwrite)
    try:
        store.put(1, *data[1])
        assert entered.wait(10)
        writer = store._tiers["file"]._writer
        with pytest.raises(TimeoutError, match=r"the write of .*layer-00001\.safetensors'? did not finish within 0\.5 s"):
            store.flush()  # its own bound, or the layer's finish giving up: both name the layer
        wait_until(lambda: writer.failed is not None)  # the finish gave up on the request
        with pytest.raises(KVWriteError, match="could not be written"):
            store.put(2, *data[2])
        assert writer.staging._free.qsize() < len(writer.staging._all)  # the stuck request keeps its buffer
        k, v = store.get(0)
        assert torch.equal(k, data[0][0]) and torch.equal(v, data[0][1])
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="offload_core.tiers.file"):
            store.close()
        assert time.monotonic() - start < 8
        assert "stuck in the kernel" in caplog.text and "layer-00001" in caplog.text
        assert os.listdir(tmp_path) == []
        release.set()  # the request returns after all: its descriptor goes then
        wait_until(lambda: len(os.listdir("/proc/self/fd")) <= descriptors - 1)  # the directory lock is gone too
    finally:
        release.set()


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_inside_close_still_deletes_everything_then_raises(mode, tmp_path, monkeypatch):
    data = layers(3)
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    for key in range(3):
        store.put(key, *data[key])
    store.get(0)
    real_shutdown = iopool.IOPool.shutdown
    real_rmtree = fileowner.shutil.rmtree
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
    monkeypatch.setattr(fileowner.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        store.close()
    assert hits["shutdown"] >= 2 and hits["rmtree"] >= 2
    assert os.listdir(tmp_path) == []
    assert store.closed
    store.close()  # idempotent after an interrupted close


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
@pytest.mark.parametrize("mode", MODES)
def test_close_with_io_in_flight_leaks_no_descriptor(mode, tmp_path):
    # Writes and prefetches still queued or running when close() cancels them: each one's file descriptor is
    # closed once its last request has stopped, never while one could still use the number.
    data = layers(8, shape=(1, 2, 2048, 128))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
        for key in range(8):
            store.put(key, *data[key])
        store.get(0)  # and a prefetch in flight
        store.close()
    assert len(os.listdir("/proc/self/fd")) == before
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
@pytest.mark.parametrize("where", ["waiting for a staging buffer", "just after taking a staging buffer",
                                   "copying a chunk", "just after queueing a chunk"])
@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_at_every_chunk_of_a_put_loses_nothing(mode, where, tmp_path, monkeypatch, wait_until):
    # A put copies a layer chunk by chunk through a ring of staging buffers, queueing each chunk's write as soon
    # as it is copied. Ctrl-C between any two of those steps: the requests already queued are waited for, then
    # the descriptor and the temp file go, every buffer comes back; the store serves its other layers exactly
    # and takes the next put.
    from offload_core.tiers import filewrite as file_tier, fileio

    monkeypatch.setattr(fileio, "CHUNK", 512 << 10)
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 5.0)  # a staging buffer never given back fails fast
    data = layers(3, shape=(1, 2, 2048, 128))  # 4 MiB a layer: eight chunks, more than the ring's buffers
    before = len(os.listdir("/proc/self/fd"))
    for at in range(8):
        store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
        store.put(0, *data[0])
        tier = store._tiers["file"]
        calls = []
        if where == "waiting for a staging buffer":  # the ring is smaller than a layer: a put waits for buffers
            real_acquire = tier._writer.staging.acquire

            def acquire(*args, **kwargs):
                calls.append(1)
                if len(calls) == at + 1:
                    raise KeyboardInterrupt
                return real_acquire(*args, **kwargs)
            monkeypatch.setattr(tier._writer.staging, "acquire", acquire)
        elif where == "just after taking a staging buffer":  # the interrupt lands as the call returns
            real_acquire = tier._writer.staging.acquire

            def acquire(*args, **kwargs):
                item = real_acquire(*args, **kwargs)
                calls.append(1)
                if len(calls) == at + 1:
                    raise KeyboardInterrupt
                return item
            monkeypatch.setattr(tier._writer.staging, "acquire", acquire)
        elif where == "copying a chunk":
            real_copy = file_tier.copy_range

            def copy(*args, **kwargs):
                calls.append(1)
                if len(calls) == at + 1:
                    raise KeyboardInterrupt
                real_copy(*args, **kwargs)
            monkeypatch.setattr(file_tier, "copy_range", copy)
        else:
            real_submit = tier._chunks.submit

            def submit(*args, **kwargs):
                future = real_submit(*args, **kwargs)
                calls.append(1)
                if len(calls) == at + 1:
                    raise KeyboardInterrupt
                return future
            monkeypatch.setattr(tier._chunks, "submit", submit)
        with pytest.raises(KeyboardInterrupt):
            store.put(1, *data[1])
        monkeypatch.undo()
        monkeypatch.setattr(fileio, "CHUNK", 512 << 10)
        monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 5.0)
        directory = store.stats()["file_dir"]
        wait_until(lambda: not [n for n in os.listdir(directory) if n.endswith(".tmp")])
        wait_until(lambda: tier._writer.staging._free.qsize() == len(tier._writer.staging._all))  # every staging buffer is back
        store.put(2, *data[2])
        for key in (0, 2):
            k, v = store.get(key)
            assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])
        with pytest.raises(KeyError):
            store.get(1)
        store.close()
    assert len(os.listdir("/proc/self/fd")) == before
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_while_the_write_staging_is_freed_loses_no_buffer_place(mode, tmp_path, monkeypatch):
    # park() frees the write ring on the consumer's thread, where Ctrl-C lands: every place comes back (empty
    # or not), else every later put would wait for a buffer that never comes.
    from offload_core import hostmem

    data = layers(3)
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    for key in range(2):
        store.put(key, *data[key])
    writer = store._tiers["file"]._writer
    real_free = hostmem.HostAllocator.free

    def free(self, buffer):
        monkeypatch.setattr(hostmem.HostAllocator, "free", real_free)
        raise KeyboardInterrupt
    monkeypatch.setattr(hostmem.HostAllocator, "free", free)
    with pytest.raises(KeyboardInterrupt):
        store.park()
    assert writer.staging._free.qsize() == len(writer.staging._all)
    assert len({id(item) for item in list(writer.staging._free.queue)}) == len(writer.staging._all)
    assert not store.sealed  # the park did not happen: the store is as it was
    store.put(2, *data[2])  # would wait for a buffer for ever (the bound) if a place were lost
    store.park()
    for key in range(3):
        assert torch.equal(store.get(key)[0], data[key][0])
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
def test_ctrl_c_while_a_layer_file_is_allocated_leaves_no_descriptor_or_temp_file(tmp_path, monkeypatch):
    data = layers(2)
    store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
    store.put(0, *data[0])
    store.flush()
    before = len(os.listdir("/proc/self/fd"))

    def fallocate(fd, offset, length):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(KeyboardInterrupt):
        store.put(1, *data[1])
    monkeypatch.undo()
    assert len(os.listdir("/proc/self/fd")) == before
    assert [n for n in os.listdir(store.stats()["file_dir"]) if not n.startswith(".")] == ["layer-00000.safetensors"]
    store.put(1, *data[1])
    assert torch.equal(store.get(1)[0], data[1][0])
    store.close()


def test_a_chunk_checksum_runs_beside_the_io_and_never_hangs_a_shut_pool(wait_until):
    # The I/O thread hands the rest of a job (a chunk's checksum) to another pool and takes the next request;
    # the job's future completes with the rest's result, or with an error if that pool shuts down first.
    io, hashes = iopool.IOPool(1, "test_io"), iopool.IOPool(1, "test_hash")
    gate = threading.Event()
    try:
        first = io.submit(lambda: iopool.Then(lambda: (gate.wait(5), "checked")[1], hashes), "the first read")
        second = io.submit(lambda: "read", "the second read")
        assert second.result(timeout=5) == "read"  # the one I/O thread was free while the checksum waited
        assert not first.done()
        gate.set()
        assert first.result(timeout=5) == "checked"
        blocker, running = threading.Event(), threading.Event()
        hashes.submit(lambda: (running.set(), blocker.wait(5)), "a long checksum")
        assert running.wait(5)
        third = io.submit(lambda: iopool.Then(lambda: "never", hashes), "the third read")
        wait_until(lambda: hashes._jobs.qsize() == 1)  # its checksum is queued behind the long one
        hashes.shutdown(0.0)
        with pytest.raises(RuntimeError, match="shut down before the third read finished"):
            third.result(timeout=5)
        blocker.set()
        fourth = io.submit(lambda: iopool.Then(lambda: "never", hashes), "the fourth read")
        with pytest.raises(RuntimeError, match="shut down"):
            fourth.result(timeout=5)
    finally:
        gate.set()
        io.shutdown(5)
        hashes.shutdown(5)


@pytest.mark.parametrize("at", [1, 3, 5, 9, 19])  # whole chunks (1, 3), parts of the last wave (5, 9, 19)
def test_ctrl_c_between_the_requests_of_a_read_loses_nothing(at, tmp_path, monkeypatch, wait_until):
    """Ctrl-C as a read queues its requests (8 chunks of 64 KiB: 4 whole, then 4 x 4 parts): the requests
    already queued finish, then their descriptor and buffer go; the next get reads the layer whole and right."""
    from offload_core.tiers import fileio

    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)
    data = layers(2, shape=(1, 4, 256, 64))  # 512 KiB a layer: 8 chunks
    store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
    for key, (k, v) in data.items():
        store.put(key, k, v)
    store.get(0)
    store.flush()
    tier = store._tiers["file"]
    fds = len(os.listdir("/proc/self/fd"))
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
    wait_until(lambda: len(os.listdir("/proc/self/fd")) == fds)  # the read's descriptor, once its requests ran
    staging = tier._reader.staging
    wait_until(lambda: staging._free.qsize() == len(staging._all))  # every read staging place back
    k, v = store.get(1)
    assert torch.equal(k, data[1][0]) and torch.equal(v, data[1][1])
    store.close()
    assert os.listdir(tmp_path) == []
