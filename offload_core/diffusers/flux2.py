"""FLUX.2 Klein KV: move the reference-token cache into a store as the extract step produces it.

Seam: on the extract step the transformer builds its own `Flux2KVCache` and returns it; the pipeline passes it
back as `kv_cache=` on the cached steps and calls `kv_cache.clear()` before decoding. We

1. open a store in a pre-hook on the transformer's extract call;
2. after each block of that call (a forward hook per block), move the layer's fresh K/V into the store and
   clear the upstream layer, so at most one layer of the cache is on the device at a time during extract;
3. replace the returned cache by an `OffloadedFlux2KVCache` over the same store, which the pipeline then feeds
   back into every cached step. The transformer asks it for each layer between blocks (`get_double(i)` /
   `get_single(j)`); that is where the layer comes back, so the blocks only see plain upstream layer caches.

Blocks compiled on their own (`compile_repeated_blocks`) cannot run our per-block hooks inside their graph:
there the hooks are left out and the output hook moves every layer after the extract call, so the extract
step holds the whole reference cache on the device, as upstream does; cached steps still hold one or two
layers. Layer keys are `("double", i)` and `("single", j)`, put and read in block order.

Reuse: on the extract step the reference tokens attend only to themselves (`_flux2_kv_causal_attention`) and are
modulated at the fixed `ref_fixed_timestep`, so their K/V depend on the reference latents and their position
ids (count, order, shapes), the batch, `guidance`, the attention kwargs and the weights — not on the prompt,
the seed or the step. The key is built from exactly those inputs of the extract call. On a hit the extract
call is rewritten into a cached call (reference tokens and their ids dropped, the kept store as `kv_cache`) and
its output is given the `(sample, kv_cache)` shape the pipeline unpacks on step 0.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.transformers.transformer_flux2 import Flux2KVCache, Flux2KVLayerCache

from .. import KVStore, KVWriteError
from .keys import ours
from .session import OffloadSession

logger = logging.getLogger(__name__)


class OffloadedFlux2KVCache(Flux2KVCache):
    """A `Flux2KVCache` whose layers live in one `KVStore`.

    `get_double(i)` / `get_single(j)` return a plain layer cache holding the store's tensors for that layer, on
    the compute device and valid until the next call. `clear()` (the pipeline calls it before decoding) ends
    the request: the session records the store's stats and closes it. Idempotent. No `.to()` on purpose.
    """

    def __init__(self, kv_store: KVStore, num_double: int, num_single: int, num_ref_tokens: int,
                 on_clear=None):
        self.kv_store = kv_store
        self._on_clear = on_clear
        self.num_double, self.num_single = num_double, num_single
        self.double_block_caches, self.single_block_caches = [], []  # nothing is held here
        self.num_ref_tokens = num_ref_tokens

    @torch.compiler.disable
    def get_double(self, layer_idx: int) -> Flux2KVLayerCache:
        return self._serve(("double", layer_idx))

    @torch.compiler.disable
    def get_single(self, layer_idx: int) -> Flux2KVLayerCache:
        return self._serve(("single", layer_idx))

    def _serve(self, key: tuple[str, int]) -> Flux2KVLayerCache:
        layer = Flux2KVLayerCache()
        layer.k_ref, layer.v_ref = self.kv_store.get(key)
        return layer

    @torch.compiler.disable
    def clear(self) -> None:
        if self._on_clear is not None:
            self._on_clear()  # the session closes the store, or keeps it for reuse
        else:
            self.kv_store.close()


class _Extract:
    """State of the extract call in flight: its store (a miss) or the cache serving it (a hit), else None; and
    the store's write error."""

    store: KVStore | None = None
    hit: "OffloadedFlux2KVCache | None" = None
    failed: Exception | None = None  # the store could not write its files: the rest stays on the device


def _put(extract: _Extract, store: KVStore, key, layer: Flux2KVLayerCache) -> bool:
    """Moves `layer` into `store`; False (the layer stays where it is) once a write has failed."""
    if extract.failed is not None:
        return False
    try:
        store.put(key, layer.k_ref, layer.v_ref)
        return True
    except KVWriteError as exc:
        extract.failed = exc
        return False


def _keep_upstream(session: OffloadSession, store: KVStore, upstream, error: Exception) -> None:
    """Falls back to `gpu`: the layers already moved come back into the pipeline's own cache on the device.

    Not recompute: after step 0 this pipeline no longer passes the reference tokens, so they cannot be
    recomputed; upstream's on-device cache is what the pipeline does without us.
    """
    for kind, layers in (("double", upstream.double_block_caches), ("single", upstream.single_block_caches)):
        for index, layer in enumerate(layers):
            if layer.k_ref is None:
                k, v = store.get((kind, index))  # valid until the next get: cloned
                layer.k_ref, layer.v_ref = k.clone(), v.clone()
    session.fall_back(store, "the reference cache stays on the device (mode 'gpu')", error)


def _blocks(transformer) -> list:
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def _blocks_compiled(transformer) -> bool:
    return any(getattr(block, "_compiled_call_impl", None) is not None for block in _blocks(transformer))


def install(session: OffloadSession, transformer) -> None:
    """Register the pre-hook, the per-block hooks and the output hook (removed by `session.detach()`)."""
    extract = _Extract()
    block_hooks: list = []

    @torch.compiler.disable
    def open_store(module, args, kwargs):
        extract.store = extract.hit = extract.failed = None
        if (kwargs.get("kv_cache_mode") == "extract" and kwargs.get("num_ref_tokens", 0) > 0
                and session.active()):
            if block_hooks and _blocks_compiled(module):
                _drop_block_hooks(block_hooks)
            hidden = kwargs["hidden_states"]
            key = _reuse_key(session, module, kwargs)
            kept = session.lookup(key)
            if kept is not None:
                return _as_cached_call(session, module, args, kwargs, kept, extract)
            extract.store = session.open_store(hidden.device, _expected_bytes(module, kwargs), key)
        return None

    @torch.compiler.disable
    def swap_output(module, args, kwargs, output):
        store, extract.store = extract.store, None
        hit, extract.hit = extract.hit, None
        if hit is not None:  # the pipeline unpacks (noise_pred, kv_cache) on step 0
            if isinstance(output, tuple):
                return (output[0], hit, *output[1:])
            output.kv_cache = hit
            return output
        if store is None:
            return None
        upstream = output[1] if isinstance(output, tuple) else output.kv_cache
        if isinstance(upstream, OffloadedFlux2KVCache):
            store.close()  # another session on this shared transformer already took the cache
            return None
        # Layers the block hooks did not move (compiled blocks, gradient checkpointing) are moved here, so
        # no layer is ever dropped.
        for kind, layers in (("double", upstream.double_block_caches), ("single", upstream.single_block_caches)):
            for index, layer in enumerate(layers):
                if layer.k_ref is not None and _put(extract, store, (kind, index), layer):
                    layer.clear()
        if extract.failed is not None:
            _keep_upstream(session, store, upstream, extract.failed)
            return None
        ours = OffloadedFlux2KVCache(store, len(upstream.double_block_caches), len(upstream.single_block_caches),
                                     upstream.num_ref_tokens, on_clear=session.end_request)
        upstream.clear()
        session.mark_complete(store)
        if store.config.storage != "exact":  # attend to the decoded references, as every later step and a reuse hit do
            cached_args, cached_kwargs = _as_cached_call(session, module, args, kwargs, store, _Extract(), cache=ours)
            output = module(*cached_args, **cached_kwargs)
        if isinstance(output, tuple):
            return (output[0], ours, *output[2:])
        output.kv_cache = ours
        return output

    session.add_hook(transformer.register_forward_pre_hook(ours(open_store), with_kwargs=True))
    if not _blocks_compiled(transformer):
        for kind, blocks in (("double", transformer.transformer_blocks), ("single", transformer.single_transformer_blocks)):
            for index, block in enumerate(blocks):
                handle = block.register_forward_hook(ours(_block_hook(extract, (kind, index))), with_kwargs=True)
                block_hooks.append(handle)
                session.add_hook(handle)
    else:
        _drop_block_hooks(block_hooks)
    session.add_hook(transformer.register_forward_hook(ours(swap_output), with_kwargs=True))


def _drop_block_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
    logger.info("KV offload: the FLUX.2 blocks are compiled on their own, so the reference cache is moved after "
                "the extract step rather than block by block; that step holds it on the device as upstream does.")


def _block_hook(extract: _Extract, key: tuple[str, int]):
    @torch.compiler.disable
    def move_layer(module, args, kwargs, output):
        store = extract.store
        if store is None:
            return None
        layer = (kwargs.get("joint_attention_kwargs") or {}).get("kv_cache")
        if isinstance(layer, Flux2KVLayerCache) and layer.k_ref is not None and _put(extract, store, key, layer):
            # The processor stored clones of this block's reference K/V; the store takes its own copy, and
            # clearing drops the device tensors before the next block allocates.
            layer.clear()
        return None

    return move_layer


def _reuse_key(session: OffloadSession, transformer, kwargs):
    """What the reference K/V of this extract call are computed from (None: reuse off)."""
    if session.reuse is None:
        return None
    n, hidden = int(kwargs["num_ref_tokens"]), kwargs["hidden_states"]
    tensors = [hidden[:, :n], _ref_ids(kwargs["img_ids"], n, ref=True)]
    guidance = kwargs.get("guidance")
    if guidance is not None:
        tensors.append(guidance)
    header = ("flux2", str(hidden.dtype), n, repr(float(kwargs.get("ref_fixed_timestep", 0.0))), guidance is not None)
    return session.reuse_key("flux2", transformer, hidden.device, header, tensors,
                             kwargs.get("joint_attention_kwargs"))


def _ref_ids(img_ids: torch.Tensor, n: int, *, ref: bool) -> torch.Tensor:
    """The position ids of the reference tokens (`ref`) or of the target tokens; (B, L, 4) or (L, 4)."""
    if img_ids.ndim == 3:
        return img_ids[:, :n] if ref else img_ids[:, n:]
    return img_ids[:n] if ref else img_ids[n:]


def _as_cached_call(session: OffloadSession, transformer, args, kwargs, store: KVStore, extract: _Extract,
                    cache: OffloadedFlux2KVCache | None = None):
    """Turn an extract call into the cached call of a later step, served by `store` (kept, or just filled)."""
    n = int(kwargs["num_ref_tokens"])
    ours = cache or OffloadedFlux2KVCache(store, len(transformer.transformer_blocks),
                                          len(transformer.single_transformer_blocks), n, on_clear=session.end_request)
    extract.hit = ours
    cached = {**kwargs, "hidden_states": kwargs["hidden_states"][:, n:],
              "img_ids": _ref_ids(kwargs["img_ids"], n, ref=False),
              "kv_cache": ours, "kv_cache_mode": "cached", "num_ref_tokens": 0}
    return args, cached


def _expected_bytes(transformer, kwargs) -> int | None:
    try:
        layers = len(transformer.transformer_blocks) + len(transformer.single_transformer_blocks)
        inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
        batch = kwargs["hidden_states"].shape[0]
        return 2 * layers * batch * int(kwargs["num_ref_tokens"]) * inner * transformer.dtype.itemsize
    except (KeyError, TypeError, AttributeError):
        return None
