"""File tiers: safetensors-compatible, aligned, atomic, and loud about files changed under them."""

import json
import os
import struct
import time

import pytest
import torch
from safetensors.torch import load_file

from offload_core import KVFileError, KVStore, OffloadConfig

from filestores import file_tier, free_places
from offload_core.tiers.file import iopool
from store_helpers import make_layers, put_all

MiB = 1 << 20


def filled_store(mode, tmp_path, n=3, dtype=torch.bfloat16):
    layers = make_layers(range(n), dtype, seed=11, shape=(1, 2, 33, 16))
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    put_all(store, layers)
    return store, layers


def layer_files(store):
    directory = store.stats()["file_dir"]
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if not f.startswith("."))


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_flush_returns_once_every_layer_is_in_place(mode, tmp_path, monkeypatch):
    from offload_core.tiers.file import filewrite as file_tier

    real = file_tier.pwrite_all
    monkeypatch.setattr(file_tier, "pwrite_all", lambda *a: (time.sleep(0.02), real(*a)))  # a slow disk
    store, layers = filled_store(mode, tmp_path)
    store.flush()
    files = layer_files(store)
    assert [os.path.basename(f) for f in files] == [f"layer-{i:05d}.safetensors" for i in range(3)]  # no .tmp
    assert store.stats()["stored_bytes"]["file"] == sum(os.path.getsize(f) for f in files)  # counted once written
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.flush()


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_files_are_safetensors_with_4k_aligned_data(mode, tmp_path):
    store, layers = filled_store(mode, tmp_path)
    store.flush()  # every write is on disk
    files = layer_files(store)
    assert [os.path.basename(f) for f in files] == [f"layer-{i:05d}.safetensors" for i in range(3)]
    for i, path in enumerate(files):
        loaded = load_file(path)
        assert torch.equal(loaded["k"], layers[i][0]) and torch.equal(loaded["v"], layers[i][1])
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        assert (8 + n) % 4096 == 0
        assert header["k"]["data_offsets"][0] % 4096 == 0 and header["v"]["data_offsets"][0] % 4096 == 0
        assert header["__metadata__"]["format"] == "kv_offload.layer"
        assert os.path.getsize(path) % 4096 == 0
    store.close()
    assert os.listdir(tmp_path) == []


def damage(path, how):
    if how == "missing":
        os.unlink(path)
    elif how == "truncated":
        os.truncate(path, os.path.getsize(path) - 4096)
    else:  # a flipped byte in the header: dtype or shape would be misread
        with open(path, "r+b") as f:
            f.seek(20)
            byte = f.read(1)
            f.seek(20)
            f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("how, match", [("missing", "is missing"), ("truncated", "expected"), ("corrupted", "is corrupted")])
@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_damaged_file_gives_a_clear_error_naming_it(mode, how, match, tmp_path):
    store, layers = filled_store(mode, tmp_path)
    k, _ = store.get(0)
    assert torch.equal(k, layers[0][0])
    store.flush()
    target = layer_files(store)[2]
    damage(target, how)
    with pytest.raises(KVFileError, match=match) as info:
        store.get(1)  # prefetches layer 2 on file_async, reads it on the next get on file_sync
        store.get(2)
    assert os.path.basename(target) in str(info.value)
    store.close()
    assert os.listdir(tmp_path) == []


def test_no_temp_files_left_by_writes(tmp_path):
    store, _ = filled_store("file_async", tmp_path, n=6)
    for key in range(6):
        store.get(key)
    assert not [f for f in layer_files(store) if f.endswith(".tmp")]
    store.close()


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_write_staging_is_freed_once_the_reads_begin(mode, tmp_path, wait_until):
    # During the cached steps only read staging is needed; the write buffers would hold host RAM for nothing.
    # They are freed in the background (on the write lane), so the first read does not wait for it.
    store, layers = filled_store(mode, tmp_path, n=4)
    writer = file_tier(store)._writer
    assert writer.staging.buffers()
    store.flush()
    assert writer.staging.buffers()  # a flush only waits; a caller may go on putting
    k, _ = store.get(0)
    assert torch.equal(k, layers[0][0])
    wait_until(lambda: writer.staging.buffers() == [])
    held = store.stats()["bytes"]
    staging = held["host_pageable"] + held["host_pinned"]  # pinned where copies are asynchronous (CUDA or its model)
    assert 0 < staging <= (store.depth + 1) * os.path.getsize(layer_files(store)[0])
    store.close()


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_a_put_holds_a_few_chunks_of_staging_whatever_the_layer_size(mode, tmp_path, monkeypatch):
    # Each chunk goes out through one buffer of a small ring: a layer four times the ring's size is written
    # exactly through it, and the staging held never exceeds the ring.
    from offload_core.tiers.file import fileio

    monkeypatch.setattr(fileio, "CHUNK", 64 << 10)
    gen = torch.Generator().manual_seed(3)
    layers = [(torch.randn(1, 4, 1024, 64, generator=gen), torch.randn(1, 4, 1024, 64, generator=gen))
              for _ in range(3)]  # 2 MiB a layer: 32 chunks
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    for i, (k, v) in enumerate(layers):
        store.put(i, k, v)
        writer = file_tier(store)._writer
        ring = iopool.IO_DEPTH + 2
        held = writer.staging.buffers()
        assert 0 < len(held) <= ring and all(b.nbytes == 64 << 10 for b in held)
    store.flush()
    # Every buffer is back once the writes are: a request gives its buffer back before its future completes, so
    # what waited for the writes (flush, park, the registry's accounting) never sees one still held.
    assert free_places(writer.staging) == (ring, ring)
    for i, (k, v) in enumerate(layers):
        got_k, got_v = store.get(i)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    store.close()


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_a_slot_the_tier_did_not_make_gets_the_layer_through_staging(mode, tmp_path):
    # A host slot made elsewhere (a RAM tier's, before the store spilled to files) is no page-aligned buffer the
    # I/O threads may fill: the layer is read into staging, then copied into it once, and nothing past it changes.
    from offload_core.host.devices import DONE

    store, _ = filled_store(mode, tmp_path)
    store.flush()
    tier = file_tier(store)
    entry = tier._files[1]
    slot = torch.full((entry.layout.data_bytes + 100,), 7, dtype=torch.uint8)
    pending = tier.load(1, slot, DONE)
    pending.wait(None)  # raises what the read raised
    pending.settle()  # the copy has run, on the side stream too (the CUDA model)
    with open(entry.path, "rb") as f:
        data = f.read()[len(entry.header):]
    assert bytes(slot[:len(data)].numpy()) == data and bool((slot[len(data):] == 7).all())
    store.close()


@pytest.mark.parametrize("mode", ["file_sync", "file_async"])
def test_a_put_returns_before_its_file_is_finished(mode, tmp_path):
    # The write lane finishes each file (header, rename) once its chunks are on disk; the put does not wait for
    # it, so the next layer's chunks queue behind this one's and the disk never idles between layers. A get of
    # the layer waits for its file.
    import threading

    store = KVStore(OffloadConfig(mode=mode, file_dir=str(tmp_path)), "cpu")
    k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    store.put(0, k, v)
    tier, gate = file_tier(store), threading.Event()
    tier._lanes["write"].submit(lambda: gate.wait(10), "a held write lane")
    store.put(1, k * 2, v * 2)
    assert not tier._files[1].written and not tier._files[1].write.done()
    gate.set()
    got_k, got_v = store.get(1)
    assert tier._files[1].written and torch.equal(got_k, k * 2) and torch.equal(got_v, v * 2)
    store.close()


def test_a_layer_files_data_is_allocated_apart_from_its_header_in_pieces(tmp_path, monkeypatch, system):
    """The header gets its own allocation and the data `reserve_pieces`, each by itself: a filesystem starts each
    power-of-two allocation of 2 to 32 MiB on a 2 MiB boundary (ext4), so no request of the data straddles
    the disk's 2 MiB grain (a 50 MiB allocation started 8 KiB past one)."""
    from offload_core.tiers.file import fileos

    if system.name != "linux":
        pytest.skip("posix_fallocate is Linux's: macOS preallocates a file whole, Windows extends it")
    monkeypatch.setattr(fileos, "RESERVE_GRAIN", 16 << 10)
    monkeypatch.setattr(fileos, "RESERVE_PIECE", 64 << 10)
    calls = []
    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: (calls.append((off, n)), real(fd, off, n))[1])
    layers = make_layers(range(1), torch.float32, seed=3, shape=(1, 2, 300, 64))  # 150 KiB per tensor
    store = KVStore(OffloadConfig(mode="file_sync", file_dir=str(tmp_path)), "cpu")
    put_all(store, layers)
    store.flush()
    path, = layer_files(store)
    with open(path, "rb") as f:
        head = 8 + struct.unpack("<Q", f.read(8))[0]
    assert calls[0] == (0, head)
    sizes = [64, 64, 64, 64, 32, 16]  # KiB: the layer's 304 KiB of data
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    assert calls[1:] == [(head + (o << 10), n << 10) for o, n in zip(offsets, sizes)]
    assert os.path.getsize(path) - head == sum(sizes) << 10
    assert torch.equal(store.get(0)[0], layers[0][0])
    store.close()


def test_reserve_pieces_are_powers_of_two_largest_first():
    from offload_core.tiers.file.fileos import reserve_pieces

    def sizes(mib):
        pieces = reserve_pieces(4096, int(mib * MiB))
        assert [off for off, _ in pieces] == [4096 + sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
        return [n / MiB for _, n in pieces]

    assert sizes(50) == [32, 16, 2]
    assert sizes(3) == [2, 1]
    assert sizes(70) == [32, 32, 4, 2]
    assert sizes(5.5) == [4, 1.5]
    assert sizes(64) == [32, 32]
    assert sizes(0.75) == [0.75]
    assert sizes(0) == []
