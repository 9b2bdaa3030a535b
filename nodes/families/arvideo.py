"""Autoregressive video (Causal-WAN): the KV cache of ComfyUI's AR video sampler served by a growing store.

ComfyUI (v0.33, `comfy/k_diffusion/sampling.py:sample_ar_video`, `comfy/ldm/wan/ar_model.py`) gets the cache from
`diffusion_model.init_kv_caches(batch, lat_t * frame_seq_len, device, dtype)`: per layer a dict
`{"k": (B, S, heads, head_dim), "v": ..., "end": 0}`. Each self-attention reads `end`, writes its block at
`k[:, end:new_end]`, sets `end = new_end` and attends to `k[:, :new_end]`; the sampler rewinds `end` after every
denoising step and then runs a clean pass at sigma 0, whose K/V of the block are final (committed) from then on.

Our object patch of `init_kv_caches` returns per layer an `ARLayer` (a dict) whose "k"/"v" are the layer's
working pair from a `GrowingKVStore`: its committed prefix on the device (resident, or loaded into a ring slot
and prefetched), with room for the block. A forward at sigma 0 (seen by the APPLY_MODEL wrapper: in AR mode the
DIFFUSION_MODEL wrapper never runs) commits each layer's block when the attention sets `end`, and the store keeps
it in the layer's place, once. A forward that finds `end` anywhere but at the committed length (a sampler that
commits differently) raises instead of attending to tokens the store does not hold.

No ComfyUI import.
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Optional

import torch

from ...offload_core.config import Mode, OffloadConfig
from ...offload_core.growing import GrowingKVStore, GrowingShape
from ..run.branch import BranchCache
from ..keys import WRAPPER_KEY
from ..run.state import live_run
from ..run.wrappers import APPLY_MODEL, run_then, transformer_options_of

log = logging.getLogger(__name__)

AR_CACHE = object()  # the run's extension key of this family's `ARCache`
INIT = "diffusion_model.init_kv_caches"
_HERE = threading.local()  # the AR cache of the run sampling on this thread (`attach` sets it, `free` clears it)


def has_ar_cache(dm) -> bool:
    """True for a causal (autoregressive) Wan model: it makes its KV caches with `init_kv_caches`."""
    return callable(getattr(dm, "init_kv_caches", None)) and callable(getattr(dm, "forward_block", None))


def patch_ar(m, dm, config: OffloadConfig, to: dict, reuse) -> "tuple[OffloadConfig, list]":
    """Object-patch `init_kv_caches` on the clone and bracket every model call; `(config, notes)`."""
    notes = []
    if config.storage != "exact":
        notes.append(f"KV Offload: the AR video cache's streamed layers keep each block as {config.storage} (lossy, "
                     "the error in the readout); resident layers stay exact.")
    if config.mode is Mode.OFF:  # ComfyUI's own cache serves the run (`Family.off` says so)
        return config, notes
    m.add_object_patch(INIT, ARInit(dm))
    m.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, ar_apply_model_wrapper)
    return config, notes


def attach(run, to: dict, n_layers: int) -> "ARCache":
    cache = _HERE.cache = run.add_extension(AR_CACHE, ARCache(run))
    return cache


class ARInit:
    """The object patch of `init_kv_caches`: our layers while a run of ours samples on this thread, else the
    model's own caches."""

    def __init__(self, dm):
        self.original = types.MethodType(type(dm).init_kv_caches, dm)
        self.heads, self.head_dim, self.layers = dm.num_heads, dm.head_dim, dm.num_layers

    def __call__(self, batch_size, max_seq_len, device, dtype):
        cache: Optional[ARCache] = getattr(_HERE, "cache", None)
        if cache is None or cache.run.closed or cache.run.stood_down:
            return self.original(batch_size, max_seq_len, device, dtype)
        shape = GrowingShape(int(batch_size), int(max_seq_len), self.heads, self.head_dim, dtype)
        return cache.open(shape, torch.device(device), self.layers)


class ARLayer(dict):
    """One layer's cache dict: "end" as upstream keeps it, "k"/"v" the store's working pair of the layer."""

    def __init__(self, cache: "ARCache", index: int):
        super().__init__(end=0)
        self._cache, self._index = cache, index

    def __getitem__(self, name):
        if name in ("k", "v"):
            return self._cache.pair(self._index)[0 if name == "k" else 1]
        return dict.__getitem__(self, name)

    def __setitem__(self, name, value):
        if name == "end":
            self._cache.moved(self._index, dict.__getitem__(self, "end"), value)
        dict.__setitem__(self, name, value)


class ARCache:
    """The growing store of one run's video, and what the forward in progress does with it."""

    def __init__(self, run):
        self.run = run
        self.store: Optional[GrowingKVStore] = None
        self.committing = False  # the forward in progress is a clean pass (sigma 0): its blocks are final
        self.in_forward = False
        self._count = 0
        self._final: dict = {}

    def open(self, shape: GrowingShape, device: torch.device, layers: int) -> list:
        if self.store is not None:  # a second video in the same run: the first one's cache goes
            self.run.drop_branch(self._key)
        self._count += 1
        self._key = ("ar_video", self._count)
        name = self.run.unique_name("video")
        self.store = GrowingKVStore(self.run.config, device, shape=shape, layers=layers, host=self.run.host, name=name)
        self.run.add_branch(self._key, BranchCache(store=self.store, name=name))
        self.run.track_store(name, self.store)
        self.run.telemetry.track_section("ar_video", self)
        return [ARLayer(self, i) for i in range(layers)]

    def pair(self, i: int):
        return self.store.view(i)

    def moved(self, i: int, old: int, new: int) -> None:
        """The attention (inside a forward) or the sampler (a rewind, between forwards) sets layer i's `end`."""
        if not self.in_forward or self.store is None:
            return
        committed = self.store.committed(i)
        if old != committed:
            raise RuntimeError(
                f"KV Offload: AR video layer {i} starts a block at token {old}, but {committed} tokens are committed: "
                "the sampler kept or rewound tokens in a way the pack does not follow (it commits the clean pass at "
                "sigma 0). Its cache would differ from ComfyUI's; use mode 'off' for this sampler.")
        if self.committing and new > old:
            self.store.commit(i, old, new)
            self.run.telemetry.progress()

    def begin(self, sigma) -> None:
        self.in_forward = True
        self.committing = bool(torch.is_tensor(sigma) and sigma.numel() and bool((sigma == 0).all()))

    def end(self, ok: bool) -> None:
        self.in_forward = self.committing = False
        if self.store is not None and not self.store.closed:
            self.store.step()

    def summary(self) -> dict:
        """What the readout shows of the video cache (`stats()["growing"]`); after the run, its last figures."""
        if self.store is None:
            return self._final
        stats = self.store.stats()
        return {**stats["growing"], "bytes": stats["bytes"], "device_bytes": stats["device_bytes"],
                "exposed_wait_s": stats["exposed_wait_s"]}

    def free(self) -> None:
        if getattr(_HERE, "cache", None) is self:
            _HERE.cache = None
        if self.store is not None:
            self._final = self.summary()
        self.store = None


def ar_apply_model_wrapper(executor, x, t, *args, **kwargs):
    """APPLY_MODEL wrapper: brackets one model call of an AR run, and says whether it is the clean pass."""
    run = live_run(transformer_options_of(args, kwargs))
    cache = run.extension(AR_CACHE) if run is not None else None
    if cache is None or cache.store is None:
        return executor(x, t, *args, **kwargs)
    cache.begin(t)
    run.step(getattr(x, "device", None))

    def done(ok: bool) -> None:
        cache.end(ok)
        run.end_forward(ok)

    return run_then(executor, (x, t, *args), kwargs, done)
