"""The file tiers never hang: no staging starvation, bounded waits, close() past I/O stuck in the kernel, a
checksum pool that cannot hold a request back. (Ctrl-C at every step: test_file_interrupts.py.)"""

import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
import torch

from filestores import MODES, file_store, file_tier, free_places, layers, open_files
from offload_core.tiers.file import iopool


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
        store = file_store("file_async", tmp_path, data, put=range(10), prefetch_depth=depth)
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
        self.name, self.real = name, os.preadv
        self.release, self.entered, self.left = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, fd, buffers, offset, *args):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.endswith(self.name):
            self.entered.set()
            self.release.wait(60)
            return self.answer(fd, buffers, offset, *args)
        return self.real(fd, buffers, offset, *args)

    def answer(self, fd, buffers, offset, *args):
        raise OSError(5, "Input/output error")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a read is for")
@pytest.mark.parametrize("mode", MODES)
def test_read_stuck_in_the_kernel_fails_get_and_close_within_the_bound(mode, tmp_path, monkeypatch, caplog):
    data = layers(4)
    store = file_store(mode, tmp_path)
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
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 0.5)  # only now: a loaded machine may take longer for the first get
    stuck = StuckReads("layer-00002.safetensors")
    monkeypatch.setattr(os, "preadv", stuck)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"the read of .*layer-00002\.safetensors did not finish within 0\.5 s"):
            bounded(lambda: (store.get(1), store.get(2)), 10)
        assert stuck.entered.is_set()
        with caplog.at_level(logging.ERROR, logger="offload_core.tiers.file.tier"):
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

    store = file_store(mode, tmp_path, data, put=[0])
    store.flush()
    monkeypatch.setattr(os, "pwrite", pwrite)
    try:
        store.put(1, *data[1])
        assert entered.wait(10)
        writer = file_tier(store)._writer
        with pytest.raises(TimeoutError, match=r"the write of .*layer-00001\.safetensors'? did not finish within 0\.5 s"):
            store.flush()  # its own bound, or the layer's finish giving up: both name the layer
        wait_until(lambda: writer.failed is not None)  # the finish gave up on the request
        with pytest.raises(RuntimeError, match="is broken: an earlier flush"):
            store.put(2, *data[2])
        free, places = free_places(writer.staging)
        assert free < places  # the stuck request keeps its buffer
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="offload_core.tiers.file.tier"):
            store.close()
        assert time.monotonic() - start < 8
        assert "stuck in the kernel" in caplog.text and "layer-00001" in caplog.text
        assert os.listdir(tmp_path) == []
        release.set()  # the request returns after all: its descriptor goes then
        wait_until(lambda: not open_files(str(tmp_path)))  # and the directory's lock
    finally:
        release.set()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc")
@pytest.mark.parametrize("mode", MODES)
def test_close_with_io_in_flight_leaks_no_descriptor(mode, tmp_path):
    # Writes and prefetches still queued or running when close() cancels them: each one's file descriptor is
    # closed once its last request has stopped, never while one could still use the number.
    data = layers(8, shape=(1, 2, 2048, 128))
    for _ in range(3):
        store = file_store(mode, tmp_path, data, put=range(8))
        store.get(0)  # and a prefetch in flight
        store.close()
        assert not open_files(str(tmp_path))
    assert os.listdir(tmp_path) == []

class LateReads(StuckReads):
    """Stand-in for a slow disk that answers after the timeout: preadv of one file waits until released, then
    reads for real, into whatever memory the request was given."""

    def answer(self, fd, buffers, offset, *args):
        try:
            return self.real(fd, buffers, offset, *args)
        finally:
            self.left.set()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to tell which file a read is for")
@pytest.mark.parametrize("mode", MODES)
def test_a_read_that_timed_out_never_lands_in_the_slot_the_next_read_serves(mode, tmp_path, monkeypatch, wait_until):
    """A read of layer 2 into a host slot times out while its requests are still in the disk; they come back
    later and write where they were told to. The next read into that slot (layer 1) must start only once they
    have ended, else they land over the layer it serves. Their descriptor closes once they end."""
    from offload_core.host.devices import DONE

    data = layers(3)
    store = file_store(mode, tmp_path, data, put=range(3))
    store.flush()
    tier = file_tier(store)
    entries, nbytes = tier._files, tier._files[1].layout.data_bytes
    slot = tier.new_slot(nbytes, tier._ctx.streams)
    tier._reader.load(entries[1], slot, DONE).wait(None)
    layer1 = slot[:nbytes].clone()
    tier._reader.load(entries[0], slot, DONE).wait(None)
    monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 0.5)
    late = LateReads("layer-00002.safetensors")
    monkeypatch.setattr(os, "preadv", late)
    try:
        with pytest.raises(iopool.IOStuckError):
            tier._reader.load(entries[2], slot, DONE).wait(None)
        assert late.entered.is_set() and not late.left.is_set()
        monkeypatch.setattr(iopool, "IO_TIMEOUT_S", 30.0)  # the next read waits for the late requests this long
        waiter = threading.get_ident() if mode == "file_sync" else None
        served = threading.Event()

        def answer_once_waited_for():  # the disk answers once the next read waits for it (or went on without)
            wait_until(lambda: served.is_set() or (_waiting_in(waiter, "_start_read") if waiter else
                                                   any(_waiting_in(t.ident, "_start_read") for t in threading.enumerate())))
            late.release.set()

        helper = threading.Thread(target=answer_once_waited_for)
        helper.start()
        try:
            tier._reader.load(entries[1], slot, DONE).wait(None)
            served.set()
        finally:
            helper.join()
        wait_until(late.left.is_set)
        wait_until(lambda: not open_files("layer-00002"))  # the late read's descriptor, once it ended
        assert torch.equal(slot[:nbytes], layer1)
    finally:
        late.release.set()
    store.close()
    assert os.listdir(tmp_path) == []


def _waiting_in(thread_id, function):
    """True while thread `thread_id` blocks in a `threading` wait called (at any depth) from `function`."""
    frame = sys._current_frames().get(thread_id)
    if frame is None or frame.f_code.co_name != "wait" or not frame.f_code.co_filename.endswith("threading.py"):
        return False
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None
