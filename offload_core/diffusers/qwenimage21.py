"""Qwen-Image 2.1: serve the pipeline's prefix caches from offloaded stores.

Seam: the pipeline (classic and modular) creates one `QwenImage21KVCache` per CFG branch and hands it to the
transformer as `kv_cache=`. A forward pre-hook on the transformer swaps it, for this call, for an
`OffloadedQwenKVCache` bound to a store of its own — one store per upstream cache object, so each branch is
isolated. The transformer asks the container for layer i (`get_layer(i)`) between blocks; that is where every
transfer happens, so the blocks themselves only ever see plain upstream layer caches and trace unchanged under
`torch.compile` (also `compile_repeated_blocks(fullgraph=True)`). The upstream cache objects are never written
to, so nothing of the prefix stays on the device through them.

Reuse: the prefix (text + condition images) is causal and modulated at t = 0 (`causal_condition=True`), so its
K/V depend on the prompt embedding and its mask, the condition latents, the image-slot layout and the output
size (`img_shapes`: the rope ids of the references are laid out against the target), plus the weights — not on
the seed, the timestep or the step count. The key is built from exactly those inputs of the extract call. On a
hit the extract call is turned into a cached call (the transformer takes the same inputs in both modes and
drops the prefix rows itself), served from the kept store.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache, QwenImage21KVLayerCache

from .. import KVStore, KVWriteError, Mode
from .keys import ours
from .session import OffloadSession

_IMG_TOKENS_PER_SLOT = 4  # one vision-language image slot stands for 2x2 latent tokens


class OffloadedQwenKVCache(QwenImage21KVCache):
    """A `QwenImage21KVCache` whose layers live in one `KVStore` (one CFG branch of one request).

    - extract (`extracting` True): `get_layer(i)` first moves the layer the previous block filled into the
      store (which takes a private copy), then hands block i an empty plain layer cache; `flush()` moves the
      last one after the forward. At most one layer of the prefix is on the device through us at a time.
    - cached: `get_layer(i)` hands block i a plain layer cache holding `store.get(i)`: `(B, P, H, D)` post-RoPE
      K/V on the compute device, valid until the next `get_layer` of this cache.
    No `.to()` method on purpose: accelerate's `send_to_device` would call it on every block.
    """

    def __init__(self, kv_store: KVStore, num_layers: int, on_write_error=None):
        self.kv_store = kv_store
        self.num_layers = num_layers
        self.extracting = True
        self.failed = False  # the store could not write its files: the request recomputes instead
        self._on_write_error = on_write_error
        self.layer_caches = [QwenImage21KVLayerCache()]  # the one layer in flight, for code that walks the list
        self._filled: int | None = None

    @torch.compiler.disable
    def get_layer(self, layer_idx: int) -> QwenImage21KVLayerCache:
        self.flush()
        layer = QwenImage21KVLayerCache()
        if self.extracting:
            self._filled = layer_idx  # the block stores this layer's prefix K/V into `layer`
        else:
            layer.k, layer.v = self.kv_store.get(layer_idx)
        self.layer_caches[0] = layer
        return layer

    def write_failed(self, exc: KVWriteError) -> None:
        """This extract forward computes every block from the full input anyway; later steps run without a
        cache (as mode 'off'), which needs no memory that a file mode was picked to save."""
        self.failed = True
        if self._on_write_error is None:
            raise exc
        self._on_write_error(exc)

    @torch.compiler.disable
    def flush(self) -> None:
        """Moves the layer filled by the last extract block into the store and drops the device tensors."""
        layer = self.layer_caches[0]
        if self._filled is not None and layer.k is not None and not self.failed:
            try:
                self.kv_store.put(self._filled, layer.k, layer.v)
            except KVWriteError as exc:
                self.write_failed(exc)
        self._filled = None
        layer.k = layer.v = None


def install(session: OffloadSession, transformer) -> None:
    """Register the cache-swapping hooks on `transformer` (removed by `session.detach()`)."""

    @torch.compiler.disable
    def swap_cache(module, args, kwargs):
        upstream = kwargs.get("kv_cache")
        if upstream is None or isinstance(upstream, OffloadedQwenKVCache) or not session.active():
            return None
        mode = kwargs.get("kv_cache_mode")
        if session.config.mode is Mode.OFF:
            # No cache at all: every step recomputes the prefix (the pipeline always passes the full input).
            return args, {**kwargs, "kv_cache": None, "kv_cache_mode": None}
        if mode == "extract":
            key = _reuse_key(session, module, kwargs)
            kept = session.lookup(key)
            if kept is not None:  # a hit: no capture, this step already reads the kept prefix
                ours = OffloadedQwenKVCache(kept, len(module.transformer_blocks))
                ours.extracting = False
                session.bind(upstream, ours)
                return args, {**kwargs, "kv_cache": ours, "kv_cache_mode": "cached"}
            ours = _open_cache(session, module, kwargs, key)
            session.bind(upstream, ours)
        else:
            ours = session.bound(upstream)
            if ours is None:
                return None  # filled before offload was enabled: leave the upstream cache in charge
            if ours.failed:  # its files could not be written: recompute the prefix, as mode 'off' does
                return args, {**kwargs, "kv_cache": None, "kv_cache_mode": None}
            ours.extracting = False
        return args, {**kwargs, "kv_cache": ours}

    @torch.compiler.disable
    def flush_last_layer(module, args, kwargs, output):
        ours = kwargs.get("kv_cache")
        if isinstance(ours, OffloadedQwenKVCache) and ours.extracting:
            ours.flush()
            if not ours.failed and ours.kv_store.stats()["layers"] == ours.num_layers:
                try:
                    ours.kv_store.flush()  # the file modes write in the background: their I/O errors surface here
                except KVWriteError as exc:
                    ours.write_failed(exc)  # the later steps recompute the prefix
                    return None
                session.mark_complete(ours.kv_store)
                if ours.kv_store.config.storage != "exact":
                    # Lossy storage: this step attends to the decoded prefix, as every later step and a reuse
                    # hit do, so the image does not depend on whether the prefix was just made or kept.
                    ours.extracting = False
                    return module(*args, **{**kwargs, "kv_cache": ours, "kv_cache_mode": "cached"})
        return None

    session.add_hook(transformer.register_forward_pre_hook(ours(swap_cache), with_kwargs=True))
    session.add_hook(transformer.register_forward_hook(ours(flush_last_layer), with_kwargs=True))


def _open_cache(session: OffloadSession, transformer, kwargs, key=None) -> OffloadedQwenKVCache:
    hidden = kwargs["hidden_states"]
    layers = len(transformer.transformer_blocks)
    store = session.open_store(hidden.device, _expected_bytes(transformer, kwargs, layers), key)
    return OffloadedQwenKVCache(store, layers, lambda exc: session.fall_back(
        store, "recomputing the prefix every step (as mode 'off')", exc))


def _reuse_key(session: OffloadSession, transformer, kwargs):
    """What the prefix K/V of this extract call are computed from (None: reuse off or an unknown layout)."""
    if session.reuse is None:
        return None
    try:
        hidden, img_shapes = kwargs["hidden_states"], kwargs["img_shapes"]
        condition = hidden[:, : hidden.shape[1] - math.prod(img_shapes[0][-1])]  # packed latents: target last
        tensors = [condition, kwargs["encoder_hidden_states"], kwargs["img_mask"]]
    except (KeyError, IndexError, TypeError):
        return None
    mask = kwargs.get("encoder_hidden_states_mask")
    if mask is not None:
        tensors.append(mask)
    header = ("qwenimage21", repr(img_shapes), str(hidden.dtype), mask is not None,
              repr(transformer.config.get("causal_condition")))
    return session.reuse_key("qwenimage21", transformer, hidden.device, header, tensors, kwargs.get("attention_kwargs"))


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
