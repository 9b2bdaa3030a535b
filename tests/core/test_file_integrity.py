"""Every way a layer file can be damaged under a live store is a KVFileError naming the file, never wrong K/V.

Each case damages layer 2 after layer 0 was read back, then reads on: `file_async` meets the damage in the
prefetch queued by `get(1)`, `file_sync` in `get(2)`.
"""

import os
import time

import pytest
import torch

from offload_core import KVFileError, KVStore, OffloadConfig
from offload_core.tiers.file import fileio, fileos

from store_helpers import make_layers, put_all

MODES = ["file_sync", "file_async"]


def filled_store(mode, directory, n=3, shape=(1, 2, 300, 64)):
    layers = make_layers(range(n), torch.float32, seed=5, shape=shape)
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(directory)), "cpu")
    put_all(store, layers)
    k, v = store.get(0)
    assert torch.equal(k, layers[0][0]) and torch.equal(v, layers[0][1])
    store.flush()  # every file is on disk before a test damages one
    return store, layers


def layer_path(store, index):
    return os.path.join(store.stats()["file_dir"], f"layer-{index:05d}.safetensors")


def rewrite(path, offset, fn):
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(16)
        f.seek(offset)
        f.write(fn(data))


def damage(path, how):
    size = os.path.getsize(path)
    if how == "missing":
        os.unlink(path)
    elif how == "truncated":
        os.truncate(path, size - 4096)
    elif how == "directory":
        os.unlink(path)
        os.mkdir(path)
    elif how == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif how == "dev_zero_symlink":
        os.unlink(path)
        os.symlink("/dev/zero", path)
    elif how == "header_changed":
        rewrite(path, 20, lambda b: bytes([b[0] ^ 0xFF]) + b[1:])
    elif how == "bit_flip":  # one bit deep in the data section
        rewrite(path, size - 5000, lambda b: bytes([b[0] ^ 0x01]) + b[1:])
    elif how == "same_size_overwrite":  # another program's bytes, same length, new inode
        with open(path, "rb") as f:
            header_len = 8 + int.from_bytes(f.read(8), "little")
        with open(path, "rb") as f:
            original = f.read()
        os.unlink(path)
        with open(path, "wb") as f:
            f.write(original[:header_len] + os.urandom(size - header_len))
    else:
        raise AssertionError(how)


CASES = [
    ("missing", "is missing"),
    ("truncated", "expected"),
    ("directory", "is a directory"),
    ("fifo", "is a FIFO"),
    ("dev_zero_symlink", "symbolic link"),
    ("header_changed", "header differs"),
    ("bit_flip", "checksum"),
    ("same_size_overwrite", "checksum"),
]


@pytest.mark.parametrize("how, match", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_damaged_layer_is_a_kvfileerror_naming_the_file(mode, how, match, tmp_path, monkeypatch, system):
    if how == "fifo" and system.name == "windows":
        pytest.skip("Windows has no FIFOs")
    monkeypatch.setattr("offload_core.tiers.file.iopool.IO_TIMEOUT_S", 5.0)
    store, _ = filled_store(mode, tmp_path)
    if how == "dev_zero_symlink" and system.name == "windows" and store.stats()["page_cache"] == "buffered":
        match = "is a device"  # no O_NOFOLLOW there: the link is followed and what it points at refused
    target = layer_path(store, 2)
    damage(target, how)
    start = time.monotonic()
    with pytest.raises(KVFileError, match=match) as info:
        store.get(1)
        store.get(2)
    assert target in str(info.value)
    store.close()
    assert time.monotonic() - start < 5.0  # a FIFO must neither block the read nor close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", MODES)
def test_unreadable_file_is_a_kvfileerror_or_the_exact_data(mode, tmp_path, monkeypatch):
    # As root, chmod 000 does not stop reading, so the bytes must come back exact; as anyone else, EACCES must
    # arrive as a KVFileError naming the file.
    store, layers = filled_store(mode, tmp_path)
    target = layer_path(store, 2)
    os.chmod(target, 0)
    try:
        store.get(1)
        k, v = store.get(2)
        assert os.geteuid() == 0 and torch.equal(k, layers[2][0]) and torch.equal(v, layers[2][1])
    except KVFileError as exc:
        assert target in str(exc) and "EACCES" in str(exc)
    store.close()
    assert os.listdir(tmp_path) == []


def test_permission_error_on_open_becomes_kvfileerror(tmp_path, monkeypatch):
    # The non-root half of the chmod case, where this machine runs as root: the OS error os.open raises.
    store, _ = filled_store("file_sync", tmp_path)
    target = layer_path(store, 1)
    real_open = os.open

    def refusing(path, flags, *args):
        if path == target:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", refusing)
    with pytest.raises(KVFileError, match="EACCES") as info:
        store.get(1)
    assert target in str(info.value)
    monkeypatch.undo()
    store.close()


@pytest.mark.parametrize("mode", MODES)
def test_header_holds_the_checksum_of_every_chunk(mode, tmp_path, monkeypatch):
    import json
    import struct

    import xxhash

    monkeypatch.setattr("offload_core.tiers.file.fileio.CHUNK", 1 << 20)
    store, _ = filled_store(mode, tmp_path, n=2, shape=(1, 4, 1024, 128))  # 2 MiB per tensor: several chunks
    store.get(1)
    with open(layer_path(store, 1), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))["__metadata__"]
        data = f.read()
    assert meta["checksum"] == "xxh3_64" and int(meta["chunk_bytes"]) == 1 << 20
    digests = meta["digests"].split(",")
    assert len(digests) == (len(data) + (1 << 20) - 1) // (1 << 20) >= 4
    for i, d in enumerate(digests):
        assert int(d, 16) == xxhash.xxh3_64_intdigest(data[i << 20:(i + 1) << 20])
    store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_small_layer_is_read_as_four_requests(mode, tmp_path, monkeypatch):
    """A layer of less than four requests goes as four chunks (a power of two, at least 2 MiB), so the disk
    has more than one request of it at once; each chunk has its digest, and the layer reads back exact."""
    import json
    import struct

    from offload_core.tiers.file import fileread

    sizes = []
    real = fileread.pread_exact
    # Layer 1's reads only, whenever they run: file_async reads it ahead during get(0), and layer 0 again after.
    monkeypatch.setattr(fileread, "pread_exact", lambda fd, view, off, path, head=None: (
        os.path.basename(path) == "layer-00001.safetensors" and sizes.append(len(view)),
        real(fd, view, off, path, head=head))[1])
    store, layers = filled_store(mode, tmp_path, n=2, shape=(1, 4, 2048, 128))  # 4 MiB per tensor: 8 MiB a layer
    with open(layer_path(store, 1), "rb") as f:
        meta = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))["__metadata__"]
    assert int(meta["chunk_bytes"]) == 2 << 20 and len(meta["digests"].split(",")) == 4
    k, v = store.get(1)
    assert torch.equal(k, layers[1][0]) and torch.equal(v, layers[1][1])
    store.close()
    assert sum(sizes) == 8 << 20 and len(sizes) >= 4 and max(sizes) <= 2 << 20


def test_layer_chunk_is_the_request_or_a_quarter_of_a_small_layer():
    from offload_core.tiers.file.filewrite import layer_chunk

    MiB = 1 << 20
    assert layer_chunk(64 * MiB, 8 * MiB) == 8 * MiB
    assert layer_chunk(32 * MiB, 8 * MiB) == 8 * MiB
    assert layer_chunk(20 * MiB, 8 * MiB) == 8 * MiB  # a quarter (5 MiB) rounds up to 8
    assert layer_chunk(8 * MiB, 8 * MiB) == 2 * MiB
    assert layer_chunk(8 * MiB + 4096, 8 * MiB) == 4 * MiB
    assert layer_chunk(3 * MiB, 8 * MiB) == layer_chunk(8192, 8 * MiB) == layer_chunk(0, 8 * MiB) == 2 * MiB
    assert layer_chunk(8 * MiB, 1 * MiB) == 1 * MiB  # never more than the request


@pytest.mark.parametrize("mode", MODES)
def test_every_layer_is_verified_on_every_read(mode, tmp_path):
    # Damage after several clean passes still fails: the check is not a one-off at the first read.
    store, layers = filled_store(mode, tmp_path, n=4)
    for _ in range(3):
        for key in range(4):
            k, _ = store.get(key)
            assert torch.equal(k, layers[key][0])
    damage(layer_path(store, 1), "bit_flip")
    with pytest.raises(KVFileError, match="checksum"):
        for key in range(4):
            store.get(key)
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_an_empty_layer_still_has_its_header_checked(mode, tmp_path):
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    store.put(0, torch.empty(0), torch.empty(0, 3))
    store.put(1, torch.ones(3), torch.ones(3))
    store.flush()
    k, v = store.get(0)
    assert k.shape == (0,) and v.shape == (0, 3)
    path = os.path.join(store.stats()["file_dir"], "layer-00000.safetensors")
    with open(path, "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x01]))
    store.get(1)  # layer 0 leaves the slot: the next get reads its file again (file_async: prefetches it now)
    with pytest.raises(KVFileError, match="header differs"):
        store.get(0)
    store.close()


def _split_store(mode, directory, monkeypatch):
    """Layers of 8 chunks of 64 KiB."""
    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)
    return filled_store(mode, directory, n=3, shape=(1, 4, 256, 64))  # 256 KiB per tensor


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("part", ["first", "last"])
def test_a_flip_anywhere_in_a_chunk_is_caught_by_its_checksum(mode, part, tmp_path, monkeypatch):
    store, layers = _split_store(mode, tmp_path, monkeypatch)
    path = layer_path(store, 2)
    header = os.path.getsize(path) - (512 << 10)
    offset = header + (7 << 16) + (5 if part == "first" else (3 << 14) + 9)  # chunk 7: its first or last part
    rewrite(path, offset, lambda b: bytes([b[0] ^ 0x01]) + b[1:])
    with pytest.raises(KVFileError, match="checksum"):
        for key in (0, 1, 2):
            store.get(key)
    store.close()
    assert os.listdir(tmp_path) == []


def test_a_failed_request_fails_the_read_and_close_returns(tmp_path, monkeypatch):
    import errno

    store, layers = _split_store("file_sync", tmp_path, monkeypatch)
    real = fileos.Handle.preadv
    target = layer_path(store, 2)
    fds = set()

    def failing(handle, buffers, offset):  # one positional read, on every system
        if handle.path == target and offset > 0:
            fds.add(handle.fd)
            raise OSError(errno.EIO, "Input/output error")
        return real(handle, buffers, offset)

    monkeypatch.setattr(fileos.Handle, "preadv", failing)
    with pytest.raises(KVFileError, match=r"layer-00002.*EIO"):
        for key in (1, 2):
            store.get(key)
    assert fds, "a request of layer 2 was made"
    monkeypatch.setattr(fileos.Handle, "preadv", real)
    with pytest.raises(RuntimeError, match="is broken"):
        store.get(2)
    store.close()
    assert os.listdir(tmp_path) == []
