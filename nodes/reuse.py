"""Prefix reuse for the nodes: Qwen-Image 2.1 prefixes kept across runs, off (and why) for FluxKVCache semantics.

Qwen-Image 2.1's prefix (text + references) is causal and modulated at t = 0, so its K/V depend only on what the
model's own `prefix_cache_key(x, context, refs, slots)` holds (lengths, target size, slots, reference shapes,
prompt embedding, reference latents) and on the model. A run that finds no slot of its own for a key asks
`REUSE`, one process-wide `PrefixRegistry`: a hit serves a store kept by an earlier run, so that run skips its
fill pass. The key adds the model as it affects the K/V: the diffusion model object, the patcher's weight-patch
set (`patches_uuid`: LoRAs), its object patches other than ours, and the weights' own fingerprint. A model
unload (`ModelPatcher.detach`, also what "free model and node cache" does) or the model object going away
evicts its entries. Stores in files are not kept: a run's cache folder goes with the run.

FLUX.2 and Qwen-Image(-Edit) follow ComfyUI's FluxKVCache semantics: on the capture step the reference tokens
attend to the prompt and the noisy target too, so their K/V depend on both. Reusing them would change the image,
so reuse stays off there and the readout says why.

No ComfyUI import.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Optional

import torch

from ..offload_core.reuse import PrefixKey, PrefixRegistry, describe, model_fingerprint

log = logging.getLogger(__name__)

OUR_PATCH = "diffusion_model.select_prefix_cache"
ON_DETACH = "on_detach_after"  # comfy.patcher_extension.CallbacksMP.ON_DETACH
FLUX_KV_REASON = ("off for FLUX.2 / Qwen-Image(-Edit): with FluxKVCache semantics the reference tokens attend to "
                  "the prompt and the noise on the capture step, so their K/V change with both")
EXACT_REASON = "on: Qwen-Image 2.1's prefix is causal and modulated at t = 0, so a new seed or sampler reuses it"


class NodeReuse:
    """The process-wide registry of the nodes and what the last configured node decided about reuse."""

    def __init__(self, budget=None):
        self.registry = PrefixRegistry(budget, name="comfyui")
        self.status = {"on": False, "reason": "no KV Offload Settings node has run yet"}
        self._watched: set = set()
        self._lock = threading.Lock()

    # -- keys ------------------------------------------------------------------------------------------------
    def key(self, dm, key_tensor: torch.Tensor, patcher=None) -> PrefixKey:
        """The model's prefix key plus the model's identity (see the module docstring)."""
        patcher = patcher if patcher is not None else getattr(dm, "current_patcher", None)
        objects = sorted((name, id(obj)) for name, obj in (getattr(patcher, "object_patches", None) or {}).items()
                         if name != OUR_PATCH)
        identity, probe = model_fingerprint(dm)
        header = ("qwen_image21", id(dm), str(getattr(patcher, "patches_uuid", None)), tuple(objects), identity,
                  str(key_tensor.device))
        self._watch(dm)
        return PrefixKey.build(header, [key_tensor, probe])

    def _watch(self, dm) -> None:
        with self._lock:
            if id(dm) in self._watched:
                return
            self._watched.add(id(dm))
        weakref.finalize(dm, self.forget_model, id(dm), "the model was deleted")

    # -- invalidation ----------------------------------------------------------------------------------------
    def forget_model(self, dm_id: int, why: str) -> int:
        with self._lock:
            self._watched.discard(dm_id)
        return self.registry.evict_where(lambda k: k.header[0][1] == dm_id, why)

    def on_detach(self, patcher, unpatch_all=True) -> None:
        """`ModelPatcher.detach` callback: the model was unloaded, its kept prefixes go with it."""
        try:
            dm = patcher.get_model_object("diffusion_model")
        except Exception:
            return
        if self.forget_model(id(dm), "the model was unloaded"):
            log.info("KV Offload: model unloaded; its kept prefixes were dropped")

    def clear(self) -> int:
        return self.registry.clear("cleared")

    def reset(self) -> None:
        """Close everything kept and start the counters anew (a fresh registry with the same budget)."""
        old, self.registry = self.registry, PrefixRegistry(self.registry.budget, name="comfyui")
        old.close()

    # -- reporting -------------------------------------------------------------------------------------------
    def decided(self, family: str, reuse: bool) -> None:
        if family != "qwen_image21":
            self.status = {"on": False, "reason": FLUX_KV_REASON}
        elif not reuse:
            self.status = {"on": False, "reason": "off: the node's reuse input is off"}
        else:
            self.status = {"on": True, "reason": EXACT_REASON}

    def snapshot(self) -> dict:
        """Plain dict for the stats payload: the registry's counters, what it holds, and on/off with the reason."""
        stats = self.registry.stats()
        line = describe(stats) if self.status["on"] else f"reuse {self.status['reason']}"
        return {**stats, "on": self.status["on"], "reason": self.status["reason"], "line": line}


REUSE = NodeReuse()


class ReusableStore:
    """One run's handle on a store that may outlive the run.

    Wraps a fresh store (filled this run, kept under `key` if complete when the run closes it) or a leased
    registry entry (given back on close; evicted if a read failed). Everything else goes to the store.
    """

    def __init__(self, store, registry: PrefixRegistry, *, key: Optional[PrefixKey] = None, entry=None,
                 n_layers: int = 0, label: str = ""):
        self._store, self._registry = store, registry
        self._key, self._entry = key, entry
        self._n_layers, self._label = n_layers, label
        self._damaged = self._done = False

    def __getattr__(self, name):
        return getattr(self._store, name)

    @property
    def closed(self) -> bool:
        return self._done or self._store.closed

    def get(self, layer):
        try:
            return self._store.get(layer)
        except BaseException:
            self._damaged = True  # what the store serves is in doubt now: never keep it
            raise

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if self._entry is not None:
            self._registry.release(self._entry, ok=not self._damaged)
            return
        stats = self._store.stats()
        complete = not self._damaged and self._key is not None and stats["layers"] == self._n_layers \
            and not self._store.closed
        if complete and stats["bytes"].get("file"):
            # The run's cache folder (nodes/host.py) is removed with the run, files and all: keep none of them.
            self._registry.note_rejection("file tiers: the run's cache folder is removed when the run ends")
            complete = False
        if not (complete and self._registry.admit(self._key, self._store, self._label)):
            self._store.close()
