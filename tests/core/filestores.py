"""Layers and file stores for the file-tier suites that attack the tiers (stuck I/O, interrupts)."""

import torch

from offload_core import KVStore, OffloadConfig

MODES = ["file_sync", "file_async"]


def layers(n, shape=(1, 2, 256, 64)):
    gen = torch.Generator().manual_seed(3)
    return {i: (torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)) for i in range(n)}


def file_store(mode, directory, data=None, put=(), **fields):
    """A store of `mode` in `directory` on the CPU, with the layers `put` (keys of `data`) already put."""
    store = KVStore(OffloadConfig(mode=mode, file_dir=str(directory), **fields), "cpu")
    for key in put:
        store.put(key, *data[key])
    return store
