"""The ring and the learned order under arbitrary access patterns: always the right bytes, never more resident.

Seeded random schedules mix full passes, skipped layers, repeated gets and jumps, as branches, CFG changes and
block-skipping patches produce them.
"""

import random

import pytest
import torch

from offload_core import KVStore, OffloadConfig


def schedule(rng, keys, length):
    out = []
    while len(out) < length:
        pattern = rng.random()
        if pattern < 0.5:  # a denoising step, maybe skipping some blocks
            out += [k for k in keys if rng.random() > 0.15]
        elif pattern < 0.7:  # the same layer asked for again
            k = rng.choice(keys)
            out += [k, k]
        else:  # a jump anywhere
            out += rng.sample(keys, rng.randint(1, 4))
    return out[:length]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode, depth", [("ram_sync", None), ("ram_async", 1), ("ram_async", 3),
                                         ("file_sync", None), ("file_async", 1), ("file_async", 2)])
def test_random_access_is_exact_and_bounded(mode, depth, seed, tmp_path):
    rng = random.Random(seed)
    keys = [("double", i) for i in range(4)] + [("single", i) for i in range(8)]
    gen = torch.Generator().manual_seed(seed)
    layers = {k: (torch.randn(1, 2, 5 + i, 8, generator=gen), torch.randn(1, 2, 5 + i, 8, generator=gen))
              for i, k in enumerate(keys)}  # layers of different sizes: slots must grow
    config = OffloadConfig(mode=mode, prefetch_depth=depth, file_dir=str(tmp_path) if "file" in mode else None)
    with KVStore(config, "cpu") as store:
        for k in keys:
            store.put(k, *layers[k])
        bound = store.depth + 1
        for k in schedule(rng, keys, 300):
            got_k, got_v = store.get(k)
            assert torch.equal(got_k, layers[k][0]) and torch.equal(got_v, layers[k][1]), k
            assert store.stats()["layers_on_device"] <= bound
        assert store.stats()["peak_layers_on_device"] <= bound
