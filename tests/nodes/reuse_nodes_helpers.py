"""Shared set-up of the node reuse tests: a patcher with the parts reuse touches, one queued graph, the reference."""


import torch

from kv_offload_pack.nodes.apply import apply_offload
from kv_offload_pack.nodes.inputs import config_from_inputs
from kv_offload_pack.nodes.run.reuse import ALWAYS
from kv_offload_pack.offload_core import HostServices, KVStore, passive

from nodes_tiny import FakePatcher, sample
from qwen21_tiny import Tiny21


class Patcher(FakePatcher):
    """FakePatcher plus the ModelPatcher parts reuse touches: `patches_uuid` and callbacks."""

    def __init__(self, dm, model_options=None):
        super().__init__(dm, model_options)
        self.callbacks = {}

    def clone(self):
        n = super().clone()
        out = Patcher(n.dm, n.model_options)
        out.wrappers, out.object_patches, out.callbacks = n.wrappers, n.object_patches, dict(self.callbacks)
        return out

    def add_callback(self, kind, fn):
        self.callbacks.setdefault(kind, []).append(fn)

    def detach(self):  # what ModelPatcher.detach does after unloading
        for fn in self.callbacks.get("on_detach_after", []):
            fn(self, True)


class Fills:
    """Counts the prefix rows the tiny 2.1 model computes: a fill pass runs its blocks over the prefix."""

    def __init__(self, dm, prefix_len):
        self.prefix_len, self.count = prefix_len, 0
        real = dm._attend

        def attend(i, x, *a):
            if x.shape[1] == self.prefix_len:
                self.count += 1
            return real(i, x, *a)

        dm._attend = passive(attend)  # it counts: the key must not read its count


# The tests of what reuse serves keep it on whatever the measurement: at the tiny model's size a hit saves about
# 1 ms against a key of about as much or more (35 ms on a model's first run), and reuse would rightly turn itself
# off after two misses.
KEEP_ON = ALWAYS


def inputs(seed=0, prompt=0, cfg=False, n_img=6, n_ref=5):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, n_img, 32, generator=g)
    c = torch.Generator().manual_seed(100 + prompt)  # the prompt / reference part: independent of the seed
    n = 2 if cfg else 1
    refs = [torch.randn(1, n_ref, 32, generator=c) for _ in range(n)]
    return noise, refs, [torch.randn(1, 3, 32, generator=c) for _ in range(n)]


def patched(dm, mode="ram_sync", reuse=KEEP_ON, tmp_path=None):
    host = HostServices(temp_dir=lambda: str(tmp_path)) if tmp_path else None
    m, _ = apply_offload(Patcher(dm), config_from_inputs(mode), host=lambda p: host, store_factory=KVStore,
                         reuse=reuse)
    for name, obj in m.object_patches.items():  # what ModelPatcher does while the model is patched
        setattr(dm, name.split(".", 1)[1], obj)
    return m


def queue(dm, m, **kw):
    """One queued graph: ModelPatcher.pre_run, sampling, cleanup."""
    cfg = kw.pop("cfg", None)
    noise, refs, txts = inputs(cfg=cfg is not None, **kw)
    dm.reset_prefix_cache(True)
    try:
        return sample(dm, m.options(), noise, refs, txts, cfg=cfg, batched=False)
    finally:
        dm.reset_prefix_cache(False)


def own_cache(seed, cfg=None):
    """The model alone, with its own (per-run) prefix cache: the reference."""
    dm = Tiny21()
    noise, refs, txts = inputs(seed, cfg=cfg is not None)
    dm.reset_prefix_cache(True)
    return sample(dm, {"transformer_options": {}}, noise, refs, txts, cfg=cfg, batched=False)


def patched_with(dm, storage="exact", reuse=KEEP_ON):
    m, _ = apply_offload(Patcher(dm), config_from_inputs("ram_sync", storage=storage), host=lambda p: None,
                         store_factory=KVStore, reuse=reuse)
    for name, obj in m.object_patches.items():
        setattr(dm, name.split(".", 1)[1], obj)
    return m
