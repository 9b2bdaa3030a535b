"""Completed stores and keys for the prefix registry suites (`test_prefix_registry.py`, `test_reuse_registry.py`)."""

import os

import torch

from offload_core import KVStore, Mode, OffloadConfig
from offload_core.reuse.prefix import PrefixKey
from store_helpers import make_layers, put_all

TIERS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async"]
LAYERS = 3


def filled_store(mode, tmp_path, seed=0, tokens=16):
    """A CPU store of `mode` with `LAYERS` random layers put and read once; returns (store, {layer: (k, v)})."""
    config = OffloadConfig(mode=mode, file_dir=str(tmp_path) if Mode(mode).is_file else None)
    store = KVStore(config, "cpu")
    layers = make_layers(range(LAYERS), torch.float32, seed=seed, shape=(1, tokens, 2, 8))
    put_all(store, layers)
    for i in range(LAYERS):  # one request's cached steps: the store learns its order and fills its ring
        store.get(i)
    return store, layers


def key(*tensors, header=("model", 1)):
    return PrefixKey.build(header, list(tensors))


def files(path):
    return [f for _, _, fs in os.walk(path) for f in fs]
