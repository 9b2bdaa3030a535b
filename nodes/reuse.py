"""Prefix reuse for the nodes: Qwen-Image 2.1 prefixes kept across runs, off (and why) for FluxKVCache semantics.

Qwen-Image 2.1's prefix (text + references) is causal and modulated at t = 0, so its K/V depend only on what the
model's own `prefix_cache_key(x, context, refs, slots)` holds (lengths, target size, slots, reference shapes,
prompt embedding, reference latents) and on the model. A run that finds no slot of its own for a key asks
`REUSE`, one process-wide `PrefixRegistry`: a hit serves a store kept by an earlier run, so that run skips its
fill pass. The key adds the model as it affects the K/V: the diffusion model object, the patcher's weight-patch
set (`patches_uuid`: LoRAs), its object patches other than ours, the weights by their full content and the
module tree's state (`offload_core.fingerprint`), the storage the run keeps (ours, after ComfyUI's own cache
`dtype` is mapped) and every `model_options` entry that reaches the forward. What it cannot read (another node's
wrapper or attention override, weights offloaded to the CPU) turns reuse off for that run, and the readout says
why. A model unload (`ModelPatcher.detach`, also what "free model and node cache" does) or the model object
going away evicts its entries. Stores in files are not kept: a run's cache folder goes with the run.

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

from ..offload_core.fingerprint import Unkeyable, model_state, plain
from ..offload_core.places import FILE
from ..offload_core.reuse import PrefixKey, PrefixRegistry, describe
from .keys import (CALLBACKS, MODEL_FUNCTION_WRAPPER, ON_DETACH, OUR_PATCH, PATCHES, PATCHES_REPLACE, PER_STEP_OPTIONS,
                   QWEN21_FAMILY, QWEN21_OPTIONS, RUN_KEY, TRANSFORMER_OPTIONS, WRAPPER_KEY, WRAPPERS)

log = logging.getLogger(__name__)

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
        self.refused: Optional[str] = None  # why the last run's prefix could not be keyed (reuse off for it)
        self.key_s: Optional[float] = None  # what reading the model for the last key cost
        self._last_warned: Optional[str] = None

    # -- keys ------------------------------------------------------------------------------------------------
    def key(self, dm, key_tensor: torch.Tensor, run, state=None) -> tuple:
        """`(key, state)`: the model's prefix key plus everything else that shapes the prefix (see the module
        docstring), None when something that may change it cannot be read (then `refused` says what, and reuse is
        off); `state`: the model's fingerprint, passed back in by the caller so it is read once per run."""
        patcher = run.patcher or getattr(dm, "current_patcher", None)
        objects = sorted((name, id(obj)) for name, obj in (getattr(patcher, "object_patches", None) or {}).items()
                         if name != OUR_PATCH)
        try:
            if state is None:
                state = model_state(dm, key_tensor.device)
            options, tensors = forward_options(run.model_options or {})
        except Unkeyable as exc:
            self._refuse(str(exc))
            return None, state
        self.key_s, self.refused = state.seconds, None
        header = (QWEN21_FAMILY, id(dm), (state.identity, state.digest), str(getattr(patcher, "patches_uuid", None)),
                  tuple(objects), str(key_tensor.device), run.config.storage, options)
        self._watch(dm)
        return PrefixKey.build(header, [key_tensor, *tensors]), state

    def _refuse(self, why: str) -> None:
        self.refused = why
        if why != self._last_warned:
            self._last_warned = why
            log.warning("KV Offload: prefix reuse is off for this run: %s", why)

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
        return self.registry.evict_where(lambda k: k.model_id == dm_id, why)

    def watch_unload(self, patcher) -> "NodeReuse":
        """Drop what is kept for `patcher`'s model when ComfyUI unloads it (`ModelPatcher.detach`); returns self."""
        if callable(getattr(patcher, "add_callback", None)):
            patcher.add_callback(ON_DETACH, self.on_detach)
        return self

    def on_detach(self, patcher, unpatch_all=True) -> None:
        """`ModelPatcher.detach` callback: the model was unloaded, its kept prefixes go with it."""
        try:
            dm = patcher.get_model_object("diffusion_model")
        except AttributeError:  # no diffusion model: nothing was kept for it
            log.debug("KV Offload: an unloaded model has no diffusion model", exc_info=True)
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
        if family != QWEN21_FAMILY:
            self.status = {"on": False, "reason": FLUX_KV_REASON}
        elif not reuse:
            self.status = {"on": False, "reason": "off: the node's reuse input is off"}
        else:
            self.status = {"on": True, "reason": EXACT_REASON}

    def snapshot(self) -> dict:
        """Plain dict for the stats payload: the registry's counters, what it holds, and on/off with the reason."""
        stats = self.registry.stats()
        line = describe(stats) if self.status["on"] else f"reuse {self.status['reason']}"
        if self.status["on"] and self.refused:
            line += f"; off for the last run: {self.refused}"
        return {**stats, "on": self.status["on"], "reason": self.status["reason"], "line": line,
                "refused": self.refused, "key_s": self.key_s}


REUSE = NodeReuse()

# transformer_options entries that the prefix does not depend on: ours, and what ComfyUI sets per step or per
# sampler (the prefix is modulated at t = 0, so sigmas and step counts do not reach it).
OWN_OPTIONS = {RUN_KEY}


def forward_options(model_options: dict) -> tuple:
    """`(description, tensors)` of what in a run's `model_options` reaches the diffusion model's forward: every
    `transformer_options` entry (attention overrides, patches, wrappers and callbacks of other nodes, ComfyUI's
    own cache `dtype`) and a `model_function_wrapper`. Raises `Unkeyable` for what cannot be read as plain
    values (a function, an object): reuse is then off for the run."""
    to = dict(model_options.get(TRANSFORMER_OPTIONS) or {})
    for name in OWN_OPTIONS | PER_STEP_OPTIONS:
        to.pop(name, None)
    cache = dict(to.pop(QWEN21_OPTIONS, None) or {})
    cache.pop(RUN_KEY, None)
    to[WRAPPERS] = _without_ours(to.get(WRAPPERS) or {})
    to[CALLBACKS] = _without_ours(to.get(CALLBACKS) or {})
    for name in (PATCHES, PATCHES_REPLACE, WRAPPERS, CALLBACKS):
        to[name] = {k: v for k, v in (to.get(name) or {}).items() if v}  # empty groups change nothing
    wrapper = model_options.get(MODEL_FUNCTION_WRAPPER)
    return plain({TRANSFORMER_OPTIONS: to, QWEN21_OPTIONS: cache, MODEL_FUNCTION_WRAPPER: wrapper},
                 "the model options")


def _without_ours(groups: dict) -> dict:
    """A wrappers / callbacks dict ({type: {key: [fn]}}) without this pack's entries (and our reuse callback)."""
    out = {}
    for kind, by_key in groups.items():
        kept = {key: [fn for fn in fns if getattr(fn, "__self__", None) is not REUSE]
                for key, fns in (by_key or {}).items() if key != WRAPPER_KEY}
        kept = {key: fns for key, fns in kept.items() if fns}
        if kept:
            out[kind] = kept
    return out


def _of_store(attribute: str) -> property:
    """A read-only attribute of `ReusableStore` served by the store it wraps, named one by one (no forwarding of
    whatever is asked)."""
    return property(lambda self: getattr(self._store, attribute), doc=f"The wrapped store's `{attribute}`.")


class ReusableStore:
    """One run's handle on a store that may outlive the run.

    Wraps a fresh store (filled this run, kept under `key` if complete when the run closes it) or a leased
    registry entry (given back on close; evicted if a read failed). It serves what its callers use of a store
    (get, put, flush, stats, close, closed, mode, reason, device, name); nothing else of the store is reachable.
    """

    def __init__(self, store, registry: PrefixRegistry, *, key: Optional[PrefixKey] = None, entry=None,
                 n_layers: int = 0, label: str = ""):
        self._store, self._registry = store, registry
        self._key, self._entry = key, entry
        self._n_layers, self._label = n_layers, label
        self._damaged = self._done = False

    mode = _of_store("mode")
    reason = _of_store("reason")
    device = _of_store("device")
    name = _of_store("name")

    def put(self, layer, k, v) -> None:
        self._store.put(layer, k, v)

    def flush(self) -> None:
        self._store.flush()

    def stats(self) -> dict:
        return self._store.stats()

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
        if complete and stats["bytes"].get(FILE):
            # The run's cache folder (nodes/host.py) is removed with the run, files and all: keep none of them.
            self._registry.note_rejection("file tiers: the run's cache folder is removed when the run ends")
            complete = False
        if not (complete and self._registry.admit(self._key, self._store, self._label)):
            self._store.close()
