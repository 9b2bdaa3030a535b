"""Each branch `fileos` takes, on the system it is for (Linux, or the macOS / Windows stand-in of
`simplatform.py`): the page-cache mode a store reports, how its files are reserved and read, what Windows
refuses, and the clear error of a system with none of it."""

import threading

import pytest
import torch

import simplatform
from filestores import MODES, file_store, layers
from offload_core import KVFileError, KVWriteError, OffloadConfig
from offload_core.tiers.file import fileio, fileos

pytestmark = pytest.mark.skipif(simplatform.SYSTEMS == ["linux"], reason=simplatform.NO_STAND_INS)

PAGE_CACHE = {"linux": ("o_direct", "fadvise"), "macos": ("f_nocache",), "windows": ("no_buffering",)}


def round_trip(mode, directory, n=3, **fields):
    data = layers(n)
    store = file_store(mode, directory, data, put=range(n), **fields)
    for key in range(n):
        k, v = store.get(key)
        assert torch.equal(k, data[key][0]) and torch.equal(v, data[key][1])
    return store


@pytest.mark.parametrize("system", simplatform.SYSTEMS, indirect=True)
@pytest.mark.parametrize("mode", MODES)
def test_each_system_reports_how_it_keeps_the_page_cache_out(mode, tmp_path, system):
    store = round_trip(mode, tmp_path)
    assert store.stats()["page_cache"] in PAGE_CACHE[system.name]
    store.close()
    off = round_trip(mode, tmp_path, bypass_page_cache=False)
    assert off.stats()["page_cache"] == "off"
    off.close()
    assert list(tmp_path.iterdir()) == []


def test_macos_sets_f_nocache_and_preallocates_every_file(tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "macos")
    seen = []
    real = fs.fcntl.fcntl
    monkeypatch.setattr(fs.fcntl, "fcntl", lambda fd, cmd, arg=0: (seen.append(cmd), real(fd, cmd, arg))[1])
    store = round_trip("file_async", tmp_path)
    store.close()
    assert seen.count(fileos.F_PREALLOCATE) == 3  # one reservation per layer file
    assert seen.count(fileos.F_NOCACHE) >= 6  # every write and every read descriptor


@pytest.mark.parametrize("mode", MODES)
def test_macos_before_11_reads_without_preadv(mode, tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "macos", without={"preadv"})
    assert not hasattr(fs.os, "preadv")
    round_trip(mode, tmp_path).close()
    assert list(tmp_path.iterdir()) == []


def test_windows_reads_a_layer_on_several_descriptors_at_once(tmp_path, monkeypatch):
    simplatform.install(monkeypatch, "windows")
    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)  # eight chunks a layer: every I/O thread gets some
    threads, entered, lock = set(), threading.Barrier(2, timeout=10), threading.Lock()
    real = fileos.Handle.preadv

    def preadv(handle, views, offset):  # two requests of one file in flight at the same moment
        if ".probe-" in handle.path:  # the page-cache probe's one read, before any layer
            return real(handle, views, offset)
        key = (threading.get_ident(), handle._fd())
        with lock:
            first = key not in threads and len(threads) < 2
            threads.add(key)
        if first:  # the first two threads to read wait for each other: both requests are in flight at once
            entered.wait()
        return real(handle, views, offset)

    monkeypatch.setattr(fileos.Handle, "preadv", preadv)
    data = layers(1, shape=(1, 2, 1024, 128))
    store = file_store("file_sync", tmp_path, data, put=[0])
    assert torch.equal(store.get(0)[0], data[0][0])
    assert len({fd for _, fd in threads}) >= 2  # a descriptor per thread, not one shared seek position
    store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("unbuffered", [True, False])
def test_windows_without_o_binary_would_corrupt_the_files(tmp_path, monkeypatch, unbuffered):
    # The guard the Windows branch keeps: drop O_BINARY from its opens and the stand-in's text mode turns each
    # newline byte into two; the store must then fail (buffered: the read-back's checksum; unbuffered: the
    # longer write is no longer aligned), never return other K/V.
    fs = simplatform.install(monkeypatch, "windows")
    fs.win32.refuse_unbuffered = not unbuffered
    monkeypatch.setattr(fs, "open_flags", fs.open_flags & ~fs.os.O_BINARY)
    newlines = torch.full((64, 64), 0x0A0A0A0A, dtype=torch.int32).view(torch.float32)  # every byte is b"\n"
    data = {0: (newlines, torch.zeros(64, 64))}
    with pytest.raises((KVFileError, KVWriteError)):
        store = file_store("file_sync", tmp_path, data, put=[0])
        try:
            store.get(0)
        finally:
            store.close()
    assert fs.os.text_writes > 0
    fs.os.text_writes = 0


@pytest.mark.parametrize("mode", MODES)
def test_windows_bypasses_the_page_cache_with_no_buffering_where_the_volume_allows_it(mode, tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "windows")
    store = round_trip(mode, tmp_path)
    assert store.stats()["page_cache"] == "no_buffering"
    reads = [unbuffered for name, unbuffered, reading in fs.os.opens if name.startswith("layer-") and reading]
    writes = [unbuffered for name, unbuffered in fs.os.writes if name.startswith("layer-")]
    assert len(reads) >= 3 and all(reads)  # every read descriptor of every thread
    assert len(writes) >= 6 and all(writes)  # every chunk and header (the allocation alone is buffered)
    store.close()
    fs.win32.refuse_unbuffered = True  # a volume that refuses it: buffered, and the stats say so
    store = round_trip(mode, tmp_path)
    assert store.stats()["page_cache"] == "buffered"
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_an_unbuffered_handle_the_crt_does_not_take_is_closed(tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "windows")

    def refuse(handle, flags):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(fs.msvcrt, "open_osfhandle", refuse)
    with pytest.raises(OSError):
        fs.open(str(tmp_path / "x"), fileos.os.O_WRONLY | fileos.os.O_CREAT, cache_mode="no_buffering")
    assert fs.os.open_count() == 0  # the handle CreateFileW made is not left open


def test_an_unbuffered_windows_handle_refuses_an_unaligned_request(tmp_path, monkeypatch):
    # What NTFS refuses with FILE_FLAG_NO_BUFFERING, and the tiers never ask: an offset or length off a sector.
    import errno

    from offload_core.host.hostmem import HostBuffer

    fs = simplatform.install(monkeypatch, "windows")
    f = fs.open(str(tmp_path / "x"), fileos.os.O_WRONLY | fileos.os.O_CREAT | fileos.os.O_EXCL,
                cache_mode="no_buffering")
    buf = HostBuffer(8192)
    try:
        assert f.pwrite(buf.memory()[:4096], 0) == 4096
        with pytest.raises(OSError) as refused:
            f.pwrite(buf.memory()[:100], 4096)
        assert refused.value.errno == errno.EINVAL
    finally:
        f.close()
        buf.release()


@pytest.mark.parametrize("mode", MODES)
def test_windows_waits_for_a_scanner_holding_a_new_file(mode, tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "windows")
    fs.os.scanner("layer-00001", times=3)  # the rename of layer 1 is refused three times, then allowed
    store = round_trip(mode, tmp_path)
    assert len(fs.os.refusals) == 3 and all("layer-00001" in r and r.endswith("scanner") for r in fs.os.refusals)
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_windows_gives_up_on_a_file_held_for_good_with_a_clear_error(tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "windows")
    monkeypatch.setattr(fileos, "BUSY_RETRY_S", 0.05)
    fs.os.scanner("layer-00000", times=10 ** 6)
    data = layers(1)
    store = file_store("file_sync", tmp_path, data, put=[0])
    with pytest.raises(KVFileError, match="layer-00000.*never written.*being used by another process"):
        store.get(0)
    fs.os.scanner("layer-00000", times=0)
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_windows_never_deletes_or_renames_what_it_holds_open(tmp_path, monkeypatch):
    fs = simplatform.install(monkeypatch, "windows")
    for mode in MODES:
        round_trip(mode, tmp_path).close()
    assert fs.os.refusals == [] and fs.os.open_count() == 0
    assert list(tmp_path.iterdir()) == []


def test_a_system_without_positional_io_or_locks_is_refused_at_config_time(monkeypatch):
    fs = simplatform.install(monkeypatch, "macos")
    monkeypatch.setattr(fs, "problem", fileos.FileOS(fs.os, "darwin", None, None).problem)
    for mode in MODES:
        with pytest.raises(ValueError, match=rf"mode '{mode}'.*fcntl.flock or msvcrt.locking.*'ram_sync'"):
            OffloadConfig(mode=mode)
    OffloadConfig(mode="ram_sync")


def test_a_write_error_on_windows_names_the_file_and_keeps_nothing(tmp_path, monkeypatch, failing_writes):
    simplatform.install(monkeypatch, "windows")
    store = file_store("file_async", tmp_path)
    failing_writes("layer-00000")
    store.put(0, torch.ones(8, 8), torch.ones(8, 8))
    with pytest.raises(KVWriteError, match="layer-00000"):
        store.flush()
    store.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name, call", [("linux", "fdatasync"), ("macos", "fsync"), ("windows", "fsync")])
def test_a_flush_uses_fdatasync_where_it_exists_else_fsync(name, call, tmp_path, monkeypatch):
    import os

    fs = simplatform.install(monkeypatch, name)
    calls = []
    for what in ("fdatasync", "fsync"):
        monkeypatch.setattr(os, what, lambda fd, what=what: calls.append(what))
    f = fs.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT)
    fs.sync(f.fd)
    f.close()
    assert calls == [call]
