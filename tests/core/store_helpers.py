"""Shared by the store suites: the layers they put, how they put them, and the tiers and plans the contract runs on."""

import torch

from offload_core import Mode, OffloadConfig

SHAPE = (1, 2, 37, 16)  # make_layers' default: K and V each 2,368 bytes in bf16 / fp16, 4,736 in fp32
SMALL = 8192  # one bf16 / fp16 layer of SHAPE (K and V, each 4 KiB-aligned); fp32: twice
# Mixed placements: every lossless plan must serve exactly what the single tiers serve.
PLANS = {
    "device+ram": {"mode": "ram_async", "device_budget": 2 * SMALL},
    "device+file": {"mode": "file_async", "device_budget": 2 * SMALL},
    "ram+file": {"mode": "ram_sync", "host_budget": 2 * SMALL},
    "device+ram+file": {"mode": "ram_async", "device_budget": 2 * SMALL, "host_budget": 2 * SMALL},
}
TIERS = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", *PLANS]


def make_layers(keys, dtype=torch.bfloat16, seed=0, shape=SHAPE):
    """{key: (k, v)}, in `keys`' order: random tensors of `shape` cast to `dtype`, K then V of each key drawn from
    one generator seeded `seed`, so the same arguments always give the same layers."""
    gen = torch.Generator().manual_seed(seed)
    return {key: (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
            for key in keys}


def put_all(store, layers):
    """Puts every layer of `layers` ({key: (k, v)}) into `store`, in the dict's order."""
    for key, (k, v) in layers.items():
        store.put(key, k, v)


def config_for(name, tmp_path):
    """The `OffloadConfig` of a single tier or of a mixed plan of PLANS; files (if any) under `tmp_path`."""
    fields = dict(PLANS.get(name, {"mode": name}))
    if Mode(fields["mode"]).is_file or "host_budget" in fields:
        fields["file_dir"] = str(tmp_path)
    return OffloadConfig(**fields)


def tiers(store):
    """The store's open tiers by place: the one place the white-box suites reach into a store for them."""
    return store._tiers
