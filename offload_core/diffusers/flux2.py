"""FLUX.2 Klein KV: move the reference-token cache into a store as the extract step produces it.

Seam: on the extract step the transformer builds its own `Flux2KVCache` and returns it; the pipeline passes it
back as `kv_cache=` on the cached steps and calls `kv_cache.clear()` before decoding. We

1. open a store in a pre-hook on the transformer's extract call;
2. after each block of that call (a forward hook per block), move the layer's fresh K/V into the store and
   clear the upstream layer, so at most one layer of the cache is on the device at a time during extract;
3. replace the returned cache by an `OffloadedFlux2KVCache` over the same store, which the pipeline then feeds
   back into every cached step.

Layer keys are `("double", i)` and `("single", j)`, put and read in block order (double blocks first).
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2KVCache, Flux2KVLayerCache

from .. import KVStore
from .session import OffloadSession


class OffloadedFlux2LayerCache(Flux2KVLayerCache):
    """One layer of an offloaded reference cache; `k_ref`/`v_ref` stay None. No `.to()` on purpose."""

    def __init__(self, kv_store: KVStore, key: tuple[str, int]):
        super().__init__()
        self._kv_store = kv_store
        self._key = key

    @torch.compiler.disable
    def store(self, k_ref: torch.Tensor, v_ref: torch.Tensor) -> None:
        self._kv_store.put(self._key, k_ref, v_ref)

    @torch.compiler.disable
    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv_store.get(self._key)

    def clear(self) -> None:
        pass  # the store owns the data; the container's clear() closes it


class OffloadedFlux2KVCache(Flux2KVCache):
    """A `Flux2KVCache` whose layers live in one `KVStore`.

    `clear()` (the pipeline calls it before decoding) ends the request: the session records the store's stats and
    closes it. Idempotent.
    """

    def __init__(self, kv_store: KVStore, num_double: int, num_single: int, num_ref_tokens: int,
                 on_clear=None):
        self.kv_store = kv_store
        self._on_clear = on_clear
        self.double_block_caches = [OffloadedFlux2LayerCache(kv_store, ("double", i)) for i in range(num_double)]
        self.single_block_caches = [OffloadedFlux2LayerCache(kv_store, ("single", i)) for i in range(num_single)]
        self.num_ref_tokens = num_ref_tokens

    @torch.compiler.disable
    def clear(self) -> None:
        if self._on_clear is not None:
            self._on_clear()
        self.kv_store.close()


class _Extract:
    """State of the extract call in flight: its store, or None outside an extract call."""

    store: KVStore | None = None


def install(session: OffloadSession, transformer) -> None:
    """Register the pre-hook, the per-block hooks and the output hook (removed by `session.detach()`)."""
    extract = _Extract()

    @torch.compiler.disable
    def open_store(module, args, kwargs):
        extract.store = None
        if kwargs.get("kv_cache_mode") == "extract" and kwargs.get("num_ref_tokens", 0) > 0:
            hidden = kwargs["hidden_states"]
            extract.store = session.open_store(hidden.device, _expected_bytes(module, kwargs))
        return None

    @torch.compiler.disable
    def swap_output(module, args, kwargs, output):
        store, extract.store = extract.store, None
        if store is None:
            return None
        upstream = output[1] if isinstance(output, tuple) else output.kv_cache
        # Normally the block hooks moved every layer already; a block run without keyword arguments (e.g. under
        # gradient checkpointing) is caught here, so no layer is ever dropped.
        for kind, layers in (("double", upstream.double_block_caches), ("single", upstream.single_block_caches)):
            for index, layer in enumerate(layers):
                if layer.k_ref is not None:
                    store.put((kind, index), layer.k_ref, layer.v_ref)
        ours = OffloadedFlux2KVCache(store, len(upstream.double_block_caches), len(upstream.single_block_caches),
                                     upstream.num_ref_tokens, on_clear=session.end_request)
        upstream.clear()
        if isinstance(output, tuple):
            return (output[0], ours, *output[2:])
        output.kv_cache = ours
        return output

    session.add_hook(transformer.register_forward_pre_hook(open_store, with_kwargs=True))
    for kind, blocks in (("double", transformer.transformer_blocks), ("single", transformer.single_transformer_blocks)):
        for index, block in enumerate(blocks):
            hook = _block_hook(extract, (kind, index))
            session.add_hook(block.register_forward_hook(hook, with_kwargs=True))
    session.add_hook(transformer.register_forward_hook(swap_output, with_kwargs=True))


def _block_hook(extract: _Extract, key: tuple[str, int]):
    @torch.compiler.disable
    def move_layer(module, args, kwargs, output):
        store = extract.store
        if store is None:
            return None
        layer = (kwargs.get("joint_attention_kwargs") or {}).get("kv_cache")
        if isinstance(layer, Flux2KVLayerCache) and layer.k_ref is not None:
            # The processor stored clones of this block's reference K/V; the store takes its own copy, and
            # clearing drops the device tensors before the next block allocates.
            store.put(key, layer.k_ref, layer.v_ref)
            layer.clear()
        return None

    return move_layer


def _expected_bytes(transformer, kwargs) -> int | None:
    try:
        layers = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
        inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        batch = kwargs["hidden_states"].shape[0]
        return 2 * layers * batch * int(kwargs["num_ref_tokens"]) * inner * transformer.dtype.itemsize
    except (KeyError, TypeError, AttributeError):
        return None
