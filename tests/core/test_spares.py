"""Idle staging kept for reuse (`hostmem.Spares`): exact sizes, lazily freed, never kept while pinned or while
anything may still use it, reused by the next store, and visible in `memory_snapshot()`."""

import os

import pytest
import torch

from offload_core import KVStore, OffloadConfig, memory_snapshot
from offload_core.host import hostmem
from offload_core.host.hostmem import HostAllocator

from test_hostmem import RecordingPinner, _mapping_of

needs_spares = pytest.mark.skipif(hostmem._MADV_FREE is None or not hostmem.HUGE_PAGES,
                                  reason="no lazy freeing (MADV_FREE) or huge pages here: nothing is kept")


@needs_spares
def test_spares_give_back_a_kept_buffer_of_the_same_size_with_no_page_lazily_freed():
    """A kept buffer is lazily freed (the OS may take its pages); taken again, every page has been written so
    the OS can no longer drop one that a device copy or an O_DIRECT read fills next."""
    spares = hostmem.Spares(limit=16 << 20)
    buf = hostmem.HostBuffer(4 << 20)
    buf.tensor.fill_(3)
    huge = _mapping_of(buf.tensor.data_ptr())["AnonHugePages"]
    assert spares.keep(buf) and spares.nbytes == 4 << 20
    assert _mapping_of(buf.tensor.data_ptr())["LazyFree"] > 0  # the OS may reclaim it now
    assert spares.take(8 << 20) is None and spares.take((4 << 20) + 4096) is None  # exact size only
    again = spares.take(4 << 20)
    assert again is buf and spares.nbytes == 0
    mapping = _mapping_of(again.tensor.data_ptr())
    assert mapping["LazyFree"] == 0 and mapping["AnonHugePages"] == huge  # and its huge pages were not split
    again.release()


@needs_spares
def test_spares_keep_at_most_their_limit_dropping_the_oldest():
    spares = hostmem.Spares(limit=8 << 20)
    first, second, third = (hostmem.HostBuffer(4 << 20) for _ in range(3))
    assert spares.keep(first) and spares.keep(second) and spares.keep(third)
    assert first.tensor is None  # released: the OS has it back
    assert spares.nbytes == 8 << 20
    assert spares.take(4 << 20) is third  # the newest first
    too_big = hostmem.HostBuffer(16 << 20)
    assert not spares.keep(too_big)
    spares.clear()
    assert second.tensor is None and spares.nbytes == 0
    for buf in (third, too_big):
        buf.release()


@needs_spares
def test_spares_refuse_pinned_and_small_buffers():
    spares = hostmem.Spares()
    small = hostmem.HostBuffer(hostmem.HUGE_PAGE - 4096)
    pinner = RecordingPinner()
    alloc = HostAllocator(pin=True, budget=1 << 30, pin_fn=pinner.pin, unpin_fn=pinner.unpin)
    pinned = alloc.alloc(4 << 20)
    assert pinned.pinned
    assert not spares.keep(small) and not spares.keep(pinned) and spares.nbytes == 0
    small.release()
    alloc.free(pinned)


@needs_spares
def test_a_pinned_staging_buffer_is_unpinned_before_it_is_kept(monkeypatch):
    spares = hostmem.Spares()
    monkeypatch.setattr(hostmem, "SPARES", spares)
    pinner = RecordingPinner()
    alloc = HostAllocator(pin=True, budget=1 << 30, pin_fn=pinner.pin, unpin_fn=pinner.unpin)
    buf = alloc.alloc(4 << 20, spare=True)
    alloc.free(buf, spare=True)
    assert not pinner.pinned and spares.nbytes == 4 << 20 and alloc.pinned_bytes == 0
    again = alloc.alloc(4 << 20, spare=True)
    assert again is buf and again.pinned and pinner.pinned  # pinned afresh, within the budget
    alloc.free(again)
    assert spares.nbytes == 0 and again.tensor is None  # a plain free releases


@needs_spares
def test_a_second_store_stages_in_the_first_ones_buffers(monkeypatch, tmp_path):
    """A fresh buffer costs a page fault per page at its first write; the next store's write staging comes
    from the buffers the last one let go of."""
    spares = hostmem.Spares()
    monkeypatch.setattr(hostmem, "SPARES", spares)
    made = []
    real_init = hostmem.HostBuffer.__init__

    def counting_init(self, nbytes, *args, **kwargs):
        made.append(nbytes)
        real_init(self, nbytes, *args, **kwargs)

    monkeypatch.setattr(hostmem.HostBuffer, "__init__", counting_init)
    k = torch.arange(3 << 20, dtype=torch.int32)  # a 24 MiB layer: staged in chunks of 2 MiB and up
    for store_no in range(2):
        store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
        made.clear()
        store.put(0, k, -k)
        store.flush()
        staged = [n for n in made if n >= hostmem.HUGE_PAGE]
        assert torch.equal(store.get(0)[0], k)
        store.close()
        if store_no == 0:  # kept, and said: part of the RSS until the OS takes it
            assert staged and memory_snapshot("cpu")["process"]["spare_staging"] == spares.nbytes > 0
    assert staged == [], staged  # the second store made no new staging buffer


@needs_spares
def test_ctrl_c_as_a_staging_place_grows_never_leaves_its_old_buffer_in_two_places(monkeypatch):
    """The place lets go of its old buffer before the buffer is kept for reuse: a Ctrl-C right after the keep
    (a signal lands at any call) leaves the place empty, never holding a buffer another store may take."""
    from offload_core.tiers.file.staging import StagingPool

    spares = hostmem.Spares()
    monkeypatch.setattr(hostmem, "SPARES", spares)
    real_keep = hostmem.Spares.keep

    def interrupted_keep(self, buf):
        real_keep(self, buf)
        raise KeyboardInterrupt
    alloc = HostAllocator(pin=False, budget=0)
    pool = StagingPool(alloc, 1, "read")
    pool.release(pool.acquire(4 << 20))
    monkeypatch.setattr(hostmem.Spares, "keep", interrupted_keep)
    with pytest.raises(KeyboardInterrupt):
        pool.acquire(8 << 20)  # grows: the 4 MiB buffer goes
    monkeypatch.setattr(hostmem.Spares, "keep", real_keep)
    kept = spares.take(4 << 20)
    assert kept is not None and all(b is not kept for b in pool.buffers())
    assert alloc.pageable_bytes == 0
    item = pool.acquire(4 << 20)  # the place comes back, and gets a buffer of its own
    assert item[0] is not kept
    pool.release(item)
    pool.close(abandoned_io=False)
    kept.release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this system has no fork (Windows)")
def test_a_child_never_waits_for_the_spares_lock_a_parents_thread_held_at_the_fork():
    """A fork copies a held lock as held; the child (multiprocessing's default start on Linux) gets a new one,
    so its first staging buffer or memory snapshot does not wait for ever."""
    import signal
    import threading

    held, done = threading.Event(), threading.Event()

    def busy():
        with hostmem.SPARES._lock:
            held.set()
            done.wait(30)
    worker = threading.Thread(target=busy)
    worker.start()
    held.wait(30)
    try:
        pid = os.fork()
        if pid == 0:
            signal.alarm(5)  # a hang fails the child instead of the whole run
            memory_snapshot("cpu")
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        worker.join()
    assert os.waitstatus_to_exitcode(status) == 0
