"""Layers and file stores for the file-tier suites that attack the tiers (stuck I/O, interrupts)."""

import os

import torch

from offload_core import KVStore, OffloadConfig

from store_helpers import make_layers, tiers

MODES = ["file_sync", "file_async"]


def layers(n, shape=(1, 2, 256, 64)):
    return make_layers(range(n), torch.float32, seed=3, shape=shape)


def file_store(mode, directory, data=None, put=(), **fields):
    """A store of `mode` in `directory` on the CPU, with the layers `put` (keys of `data`) already put."""
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(directory), **fields), "cpu")
    for key in put:
        store.put(key, *data[key])
    return store


def open_files(name):
    """This process's descriptors open on a file whose path contains `name` (Linux's /proc)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if name in os.readlink(f"/proc/self/fd/{fd}"):
                found.append(fd)
        except OSError:
            pass  # closed meanwhile
    return found


def file_tier(store):
    """The store's file tier: the one place the white-box file suites reach into a store for it."""
    return tiers(store)["file"]


def free_places(pool):
    """(distinct places free now, places in all) of a staging pool: equal when every place is back, none twice."""
    free = list(pool._free.queue)
    return len({id(item) for item in free}), len(pool._all)
