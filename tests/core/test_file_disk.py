"""The file tiers on real small filesystems: a RAM-backed one is called out, a full one fails clearly and cleanly."""

import logging
import os
import threading

import pytest
import torch

from filestores import MODES, file_tier, free_places
from offload_core import KVFileError, KVStore, KVWriteError, OffloadConfig
from offload_core.tiers.file import iopool

MiB = 1 << 20


def layer(i, shape=(1, 2, 1024, 64)):  # 512 KiB per tensor: 1 MiB of data per layer
    return torch.full(shape, float(i)), torch.full(shape, -float(i))


def files_in(directory):
    return sorted(f for f in os.listdir(directory) if not f.startswith("."))


@pytest.mark.parametrize("mode", MODES)
def test_a_tmpfs_cache_is_called_out_as_saving_no_ram(mode, mount_tmpfs, caplog, system):
    if system.name != "linux":
        pytest.skip("a RAM disk of macOS or Windows looks like an ordinary volume: nothing to tell it by")
    where = mount_tmpfs("16m")
    with caplog.at_level(logging.WARNING, logger="offload_core.tiers.file.tier"):
        store = KVStore(OffloadConfig(mode=mode, file_dir=where), "cpu")
    store.put(0, *layer(0))
    stats = store.stats()
    assert "tmpfs" in caplog.text and "saves no RAM" in caplog.text
    assert "tmpfs" in stats["reason"] and "saves no RAM" in stats["reason"]
    assert stats["page_cache"] == "tmpfs: in RAM"
    assert torch.equal(store.get(0)[0], layer(0)[0])
    store.close()
    assert os.listdir(where) == []


def test_a_disk_cache_is_not_called_out(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="offload_core.tiers.file.tier"):
        store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
    store.put(0, *layer(0))
    if store.stats()["page_cache"].endswith("in RAM"):
        pytest.skip("the test's temp directory is itself on a RAM-backed filesystem")
    assert "saves no RAM" not in caplog.text and "saves no RAM" not in store.stats()["reason"]
    store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_full_disk_fails_at_put_with_the_directory_and_the_space_needed(mode, mount_tmpfs):
    where = mount_tmpfs("8m")
    store = KVStore(OffloadConfig(mode=mode, file_dir=where), "cpu")
    put = 0
    with pytest.raises(KVWriteError) as info:
        for put in range(20):
            store.put(put, *layer(put))
    message = str(info.value)
    assert store.stats()["file_dir"] in message and "is full" in message and "1.0 MiB" in message
    assert 4 <= put < 8
    for key in range(put):  # every layer accepted before the error is whole and exact
        k, v = store.get(key)
        assert torch.equal(k, layer(key)[0]) and torch.equal(v, layer(key)[1])
    directory = store.stats()["file_dir"]
    names = files_in(directory)
    assert names == [f"layer-{i:05d}.safetensors" for i in range(put)]  # no partial file, no temp file
    sizes = sum(os.path.getsize(os.path.join(directory, n)) for n in names)
    assert store.stats()["bytes"]["file"] == sizes  # never bytes that were not written
    with pytest.raises(KeyError):
        store.get(put)  # the refused layer is not in the store
    store.close()
    assert os.listdir(where) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_background_write_is_reported_and_never_counted(mode, tmp_path, monkeypatch, failing_writes):
    # Stand-in for an I/O error after the space was allocated (a failing disk): pwrite of layer 1 fails. Both
    # tiers write in the background: the put returns, the read of the layer reports it and breaks the store.
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    failing_writes("layer-00001")
    store.put(0, *layer(0))
    store.put(1, *layer(1))
    with pytest.raises(KVFileError, match=r"layer-00001\.safetensors.*never written.*EIO"):
        store.get(0)
        store.get(1)
    with pytest.raises(RuntimeError, match="is broken: an earlier get .KVFileError."):
        store.put(2, *layer(2))
    monkeypatch.undo()
    directory = store.stats()["file_dir"]
    assert files_in(directory) == ["layer-00000.safetensors"]
    assert store.stats()["bytes"]["file"] == os.path.getsize(os.path.join(directory, "layer-00000.safetensors"))
    store.close()
    assert os.listdir(tmp_path) == []


def test_flush_reports_a_failed_write_and_lets_the_others_finish(tmp_path, failing_writes):
    accepted, waiting = threading.Event(), threading.Event()
    store = KVStore(OffloadConfig(mode="file_async", file_dir=str(tmp_path)), "cpu")
    heal = failing_writes("layer-00000", before=lambda: accepted.wait(5))  # fails once layer 1 is put
    store.put(0, *layer(0))
    tier = file_tier(store)
    # Hold the write lane until flush waits for layer 1: its finish is then still queued behind the failed
    # layer 0, where a flush that cancels on the first error would drop it. (Bounded: a flush that never
    # asks for layer 1 lets the lane go after 5 s and fails the test below.)
    tier._lanes["write"].submit(lambda: waiting.wait(5), "a held lane")
    store.put(1, *layer(1))
    second = tier._files[1].write
    result = second.result
    second.result = lambda timeout=None: (waiting.set(), result(timeout))[1]
    accepted.set()
    with pytest.raises(KVWriteError, match=r"layer-00000.*EIO"):
        store.flush()
    heal()
    k, v = store.get(1)  # its write finished
    assert torch.equal(k, layer(1)[0]) and torch.equal(v, layer(1)[1])
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_write_is_cleaned_up_once(mode, tmp_path, monkeypatch, failing_writes):
    # Every chunk's request gives its staging buffer back exactly once, also when the write fails and the
    # requests after it are cancelled; the finish closes the descriptor and removes the temp file once (a
    # second release would hand one buffer to two writers, a second close could hit another file's descriptor).
    from offload_core.tiers.file import fileio

    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)  # 16 chunks a layer: more than the ring holds
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    store.put(0, *layer(0))
    heal = failing_writes("layer-00001")
    store.put(1, *layer(1))
    with pytest.raises(KVWriteError, match=r"layer-00001.*EIO"):
        store.flush()
    heal()
    writer = file_tier(store)._writer
    assert writer._writing == 0
    # Back already when the error is raised: each request gives its buffer back before its future completes.
    assert free_places(writer.staging) == (iopool.IO_DEPTH + 2,) * 2  # every place back, none twice
    assert files_in(store.stats()["file_dir"]) == ["layer-00000.safetensors"]  # no temp file left
    k, v = store.get(0)
    assert torch.equal(k, layer(0)[0]) and torch.equal(v, layer(0)[1])
    store.close()
    assert os.listdir(tmp_path) == []


def _fill(where, leave=0):
    """Fills the filesystem at `where` (as root: the reserved blocks too), then frees `leave` bytes of it again;
    returns the filler's path. By allocation, to the last block: `statvfs` counts clusters ext4 keeps back."""
    filler, end = os.path.join(where, "filler"), 0
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for piece in (1 << 20, 64 << 10, 4 << 10, 1 << 10):
            while True:
                try:
                    os.posix_fallocate(fd, end, piece)
                except OSError:  # ENOSPC: a smaller piece, if any
                    break
                end += piece
        os.ftruncate(fd, max(0, end - leave))
    finally:
        os.close(fd)
    return filler


def test_a_disk_full_at_the_first_put_says_so_and_keeps_direct_io_once_space_is_free(mount_ext4, monkeypatch, system):
    # The page-cache probe writes a 4 KiB file: on a full disk that fails as the disk being full, never as the
    # directory refusing direct I/O (the store would then go through the page cache for the rest of its life).
    if system.name == "macos":
        pytest.skip("macOS has no direct I/O to probe (F_NOCACHE is set per file)")
    where = mount_ext4("24m")
    filler = _fill(where)
    with pytest.raises(KVWriteError, match="is full.*the cache's directory"):  # not a bare OSError
        KVStore(OffloadConfig(mode="file_sync", file_dir=where), "cpu").put(0, *layer(0))
    os.remove(filler)
    filler = _fill(where, leave=3 << 10)  # room for the directory and its lock (blocks of 1 KiB here), no more
    store = KVStore(OffloadConfig(mode="file_sync", file_dir=where), "cpu")
    with pytest.raises(KVWriteError, match="is full.*4 KiB test file"):
        store.put(0, *layer(0))
    os.remove(filler)
    store.put(0, *layer(0))
    assert store.stats()["page_cache"] == {"linux": "o_direct", "windows": "no_buffering"}[system.name]
    assert torch.equal(store.get(0)[0], layer(0)[0])
    store.close()
    assert sorted(os.listdir(where)) == ["lost+found"]


@pytest.mark.parametrize("mode", MODES)
def test_a_disk_that_fills_mid_write_names_the_layer_files_size(mode, mount_ext4, monkeypatch, system):
    # Without preallocation (NFSv3, some FUSE filesystems refuse it) the disk fills during a chunk's write: the
    # error gives the layer file's size, not the chunk's.
    import errno

    if system.name == "windows":
        pytest.skip("Windows allocates by extending the file, before any write")
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    where = mount_ext4("24m")
    _fill(where, leave=6 * MiB)
    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    store = KVStore(OffloadConfig(mode=mode, file_dir=where), "cpu")
    big = layer(1, shape=(1, 2, 12 * 1024, 64))  # 12 MiB of data
    with pytest.raises(KVWriteError, match=r"is full.*needs 12\.0 MiB"):
        store.put(1, *big)
        store.flush()
    store.close()
