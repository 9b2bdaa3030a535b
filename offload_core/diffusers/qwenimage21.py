"""Qwen-Image 2.1: serve the pipeline's prefix caches from offloaded stores.

Seam: the pipeline (classic and modular) creates one `QwenImage21KVCache` per CFG branch and hands it to the
transformer as `kv_cache=`. A forward pre-hook on the transformer swaps it, for this call, for an
`OffloadedQwenKVCache` bound to a store of its own — one store per upstream cache object, so each branch is
isolated. All K/V traffic goes through `_qwenimage21_prepare_qkv`, which calls `layer_cache.store(k, v)` on the
extract step and `layer_cache.get()` on the cached steps; our layer cache forwards both to the store.
The upstream cache objects are never written to, so nothing of the prefix stays on the device through them.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache, QwenImage21KVLayerCache

from .. import KVStore, Mode
from .session import OffloadSession

_IMG_TOKENS_PER_SLOT = 4  # one vision-language image slot stands for 2x2 latent tokens


class OffloadedQwenLayerCache(QwenImage21KVLayerCache):
    """One layer of an offloaded prefix cache. Holds no tensors itself (`k`/`v` stay None).

    `store(k, v)`: `(B, P, H, D)` post-RoPE keys/values in model dtype; the store takes a private copy.
    `get()`: the same tensors on the compute device, valid until the next `get()` of this cache's store.
    No `.to()` method on purpose: accelerate's `send_to_device` would call it on every block.
    """

    def __init__(self, kv_store: KVStore, index: int):
        super().__init__()
        self._kv_store = kv_store
        self._index = index

    @torch.compiler.disable
    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self._kv_store.put(self._index, k, v)

    @torch.compiler.disable
    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv_store.get(self._index)


class OffloadedQwenKVCache(QwenImage21KVCache):
    """A `QwenImage21KVCache` whose layers live in one `KVStore` (one CFG branch of one request)."""

    def __init__(self, kv_store: KVStore, num_layers: int):
        self.kv_store = kv_store
        self.layer_caches = [OffloadedQwenLayerCache(kv_store, i) for i in range(num_layers)]


def install(session: OffloadSession, transformer) -> None:
    """Register the cache-swapping pre-hook on `transformer` (removed by `session.detach()`)."""

    @torch.compiler.disable
    def swap_cache(module, args, kwargs):
        upstream = kwargs.get("kv_cache")
        if upstream is None or isinstance(upstream, OffloadedQwenKVCache):
            return None
        mode = kwargs.get("kv_cache_mode")
        if session.config.mode is Mode.OFF:
            # No cache at all: every step recomputes the prefix (the pipeline always passes the full input).
            return args, {**kwargs, "kv_cache": None, "kv_cache_mode": None}
        if mode == "extract":
            ours = _open_cache(session, module, kwargs)
            session.bind(upstream, ours)
        else:
            ours = session.bound(upstream)
            if ours is None:
                return None  # filled before offload was enabled: leave the upstream cache in charge
        return args, {**kwargs, "kv_cache": ours}

    session.add_hook(transformer.register_forward_pre_hook(swap_cache, with_kwargs=True))


def _open_cache(session: OffloadSession, transformer, kwargs) -> OffloadedQwenKVCache:
    hidden = kwargs["hidden_states"]
    layers = len(transformer.transformer_blocks)
    store = session.open_store(hidden.device, _expected_bytes(transformer, kwargs, layers))
    return OffloadedQwenKVCache(store, layers)


def _expected_bytes(transformer, kwargs, layers: int) -> int | None:
    """`2 x layers x batch x prefix_tokens x inner_dim x itemsize`, from the call's own layout."""
    try:
        img_mask, img_shapes, hidden = kwargs["img_mask"], kwargs["img_shapes"], kwargs["hidden_states"]
        joint = int(torch.where(img_mask[0], _IMG_TOKENS_PER_SLOT, 1).sum())
        prefix = joint - math.prod(img_shapes[0][-1])
        inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        return 2 * layers * hidden.shape[0] * prefix * inner * transformer.dtype.itemsize
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
