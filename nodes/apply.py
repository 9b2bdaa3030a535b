"""Patch a clone of a ComfyUI MODEL with an `OffloadConfig`: find the model's family, let it patch the clone.

Works on any object with ComfyUI's `ModelPatcher` methods (`clone`, `get_model_object`, `model_options`,
`set_model_attn1_patch`, `set_model_post_input_patch`, `add_object_patch`, `add_wrapper_with_key`,
`remove_wrappers_with_key`), so it runs in unit tests without ComfyUI.

FluxKVCache interplay (no double caching):
- `FluxKVCache` upstream of this node (its patches are already on the incoming MODEL): they are removed
  from our clone and our cache takes over, in whatever mode was picked (`off` included).
- `FluxKVCache` downstream (it patches our output): found when the run starts; ours stands down for that
  run with a warning and `FluxKVCache` caches on the GPU as it would alone.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..offload_core.config import Mode, OffloadConfig
from ..offload_core.store.kvstore import KVStore
from .families.detect import detect_family
from .keys import PATCHES, TRANSFORMER_OPTIONS
from .families.flux import is_flux_kv_cache_patch, is_ours
from .readout.protocol import safe
from .run.reuse import REUSE
from .run.wrappers import RunSpec, add_cache_wrappers, add_readout_wrappers, remove_wrappers

log = logging.getLogger(__name__)

PATCH_KINDS = ("attn1_patch", "post_input")  # where FluxKVCache and our attention family put their patches


def apply_offload(model, config: OffloadConfig, *, host: Callable, telemetry=None, reuse: "bool | str" = False,
                  store_factory: Optional[Callable] = None):
    """Return `(patched clone, message)`; the input MODEL is never modified.

    host(model_patcher) -> HostServices, evaluated once per run. reuse: keep Qwen-Image 2.1 prefixes across runs
    (see `nodes/run/reuse.py`), turned off where the key costs more than a hit saves, or "always" (`ALWAYS`): on
    whatever the measurement; off for the other families, whatever is asked. store_factory: None, each run's
    stores are `KVStore`s (`RunState.open_store`); tests pass a stand-in.
    """
    m = model.clone()
    dm = m.get_model_object("diffusion_model")
    family = detect_family(dm)
    if family is None:  # before any patch is touched: an upstream FluxKVCache keeps working
        return m, _said(logging.WARNING, f"KV Offload: {type(dm).__name__} has no reference K/V seam this pack "
                        "knows (FLUX.2 Klein KV, Qwen-Image, Qwen-Image-Edit, Qwen-Image 2.1 on ComfyUI versions "
                        "that have it, Wan Animate 2, Causal-WAN AR video); model unchanged.")
    device = getattr(m, "load_device", None)  # ComfyUI's ModelPatcher: where sampling computes
    if device is not None and config.mode is not Mode.OFF:
        KVStore.check_config(config, device)  # a pair no store can serve fails here, before any patch
    keeps = REUSE.decided(family.name, reuse if config.mode is not Mode.OFF else False)
    _strip_patches(m, config.mode)
    to = m.model_options.setdefault(TRANSFORMER_OPTIONS, {})
    config, notes = family.patch(m, dm, config, to, reuse)
    if config.mode is Mode.OFF:
        add_readout_wrappers(m, telemetry)
        return m, _said(logging.INFO, " ".join([f"KV Offload: mode off on {family.name}: {family.off}.", *notes]))
    add_cache_wrappers(m, RunSpec(config=config, host=host, n_layers=family.layers(dm), family=family,
                                  telemetry=safe(telemetry), store_factory=store_factory,
                                  reuse=reuse if keeps else False))
    return m, _said(logging.INFO, " ".join([f"KV Offload: mode {config.mode.value} on {family.name}.", *notes]))


def _strip_patches(m, mode: Mode) -> None:
    """Remove FluxKVCache's and earlier KV Offload patches, wrappers and run spec from the clone."""
    patches = m.model_options.get(TRANSFORMER_OPTIONS, {}).get(PATCHES, {})
    removed = []
    for name in PATCH_KINDS:
        kept = []
        for p in patches.get(name, []):
            (removed if is_flux_kv_cache_patch(p) or is_ours(p) else kept).append(p)
        if kept:
            patches[name] = kept
        else:
            patches.pop(name, None)
    remove_wrappers(m)
    if any(is_flux_kv_cache_patch(p) for p in removed):
        log.info("KV Offload: FluxKVCache found upstream; its GPU cache is replaced by mode %s.", mode)


def _said(level: int, msg: str) -> str:
    log.log(level, msg)
    return msg
