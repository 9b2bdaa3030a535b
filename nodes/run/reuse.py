"""Prefix reuse for the nodes: Qwen-Image 2.1 prefixes kept across runs, off (and why) for FluxKVCache semantics.

Qwen-Image 2.1's prefix (text + references) is causal and modulated at t = 0, so its K/V depend only on what the
model's own `prefix_cache_key(x, context, refs, slots)` holds (lengths, target size, slots, reference shapes,
prompt embedding, reference latents) and on the model. A run that finds no prefix entry of its own for a key asks
`REUSE`, one process-wide `PrefixRegistry`: a hit serves a store kept by an earlier run, so that run skips its
fill pass. The key adds the model as it affects the K/V: the diffusion model object, the patcher's weight-patch
set (`patches_uuid`: LoRAs), its object patches other than ours, the weights by their full content and the
module tree's state (`offload_core.fingerprint`), the storage the run keeps (ours, after ComfyUI's own cache
`dtype` is mapped) and every `model_options` entry that reaches the forward. What it cannot read (another node's
wrapper or attention override, weights offloaded to the CPU) turns reuse off for that run, and the readout says
why. A model unload (`ModelPatcher.detach`, also what "free model and node cache" does) or the model object
going away evicts its entries. Stores in files are not kept: a run's cache folder goes with the run.

Every run pays for the key, hit or miss. Each run that captured a prefix measures what a hit would have saved it
(`RunCost`, judged by `offload_core/reuse/cost.py` as the diffusers adapter does); where the key cost more in two
such runs in a row at one model and prefix size, reuse turns off there with one warning, and later runs at that
size read no key and report why. The node's `reuse_always` input (`ALWAYS`) keeps reuse on whatever the measurement.

FLUX.2 and Qwen-Image(-Edit) follow ComfyUI's FluxKVCache semantics: on the capture step the reference tokens
attend to the prompt and the noisy target too, so their K/V depend on both. Reusing them would change the image,
so reuse stays off there and the readout says why.

No ComfyUI import.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Optional

import torch

from ...offload_core.reuse.fingerprint import Unkeyable, model_state, plain
from ...offload_core.places import FILE
from ...offload_core.reuse.registry import PrefixKey, PrefixRegistry, describe
from ...offload_core.reuse.cost import ReuseCost, StepTimes
from .branch import CACHED, CAPTURE
from ..keys import (CALLBACKS, MODEL_FUNCTION_WRAPPER, ON_DETACH, OUR_PATCH, PATCHES, PATCHES_REPLACE, PER_STEP_OPTIONS, QWEN21_FAMILY, QWEN21_OPTIONS, RUN_KEY, TRANSFORMER_OPTIONS, WRAPPER_KEY, WRAPPERS)

log = logging.getLogger(__name__)

FLUX_KV_REASON = ("off for FLUX.2 / Qwen-Image(-Edit): with FluxKVCache semantics the reference tokens attend to "
                  "the prompt and the noise on the capture step, so their K/V change with both")
EXACT_REASON = "on: Qwen-Image 2.1's prefix is causal and modulated at t = 0, so a new seed or sampler reuses it"
ALWAYS = "always"  # reuse kept on whatever the measurement (the node's `reuse_always` input)
KEEP_ON = "the node's reuse_always input"  # how a user of the node keeps reuse on, as a verdict's reason says
REUSE_COST = object()  # the run's extension key of its `RunCost`


class NodeReuse:
    """The process-wide registry of the nodes and what the last configured node decided about reuse."""

    def __init__(self, budget=None):
        self.registry = PrefixRegistry(budget, name="comfyui")
        self.status = {"on": False, "reason": "no KV Offload Settings node has run yet"}
        self._watched: set = set()
        self._lock = threading.Lock()
        self.refused: Optional[str] = None  # why the last run's prefix could not be keyed (reuse off for it)
        self.key_s: Optional[float] = None  # what reading the model for the keys cost the last run
        self.saved_s: Optional[float] = None  # what a hit would have saved the last run that captured a prefix
        self._last_warned: Optional[str] = None
        self.cost = ReuseCost(keep_on=KEEP_ON)  # per model (weakly) and prefix size: whether the key pays
        self._always = ReuseCost(always=True)  # the same for runs with `ALWAYS`: never turned off

    def measure(self, run, always: bool = False) -> "RunCost":
        """Time `run`'s forwards to judge, when it ends, whether its key paid (`always`: keep reuse on anyway)."""
        cost = RunCost(self._always if always else self.cost, self)
        run.watchers.append(cost)
        return run.add_extension(REUSE_COST, cost)

    # -- keys ------------------------------------------------------------------------------------------------
    def key(self, dm, key_tensor: torch.Tensor, run, state=None) -> tuple:
        """`(key, state)`: the model's prefix key plus everything else that shapes the prefix (see the module
        docstring), None when something that may change it cannot be read (then `refused` says what, and reuse is
        off); `state`: the model's fingerprint, passed back in by the caller so it is read once per run.

        Where reuse was judged not to pay at this model and prefix size (`RunCost`), nothing is read: `(None,
        state)`, `refused` says why (the warning was given once, when it was judged)."""
        cost: Optional[RunCost] = run.extension(REUSE_COST)
        off = cost.off(dm, key_tensor) if cost is not None else None
        if off is not None:
            self.refused, self.key_s = off, 0.0
            return None, state
        began = time.perf_counter()
        key, state = self._key(dm, key_tensor, run, state)
        if key is not None:
            seconds = time.perf_counter() - began
            self.key_s = cost.read(dm, key_tensor, seconds) if cost is not None else seconds
        return key, state

    def _key(self, dm, key_tensor: torch.Tensor, run, state) -> tuple:
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
        self.refused = None
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
        """Close everything kept and start the counters and the verdicts anew (a fresh registry, same budget)."""
        old, self.registry = self.registry, PrefixRegistry(self.registry.budget, name="comfyui")
        self.cost, self.refused, self.key_s, self.saved_s = ReuseCost(keep_on=KEEP_ON), None, None, None
        old.close()

    # -- reporting -------------------------------------------------------------------------------------------
    def decided(self, family: str, reuse: bool) -> None:
        if family != QWEN21_FAMILY:
            self.status = {"on": False, "reason": FLUX_KV_REASON}
        elif not reuse:
            self.status = {"on": False, "reason": "off: the node's reuse input is off"}
        else:
            always = " (reuse_always: kept on whatever the measurement)" if reuse == ALWAYS else ""
            self.status = {"on": True, "reason": EXACT_REASON + always}
        return self.status["on"]

    def snapshot(self) -> dict:
        """Plain dict for the stats payload: the registry's counters, what it holds, and on/off with the reason."""
        stats = self.registry.stats()
        line = describe(stats) if self.status["on"] else f"reuse {self.status['reason']}"
        if self.status["on"] and self.refused:
            line += f"; off for the last run: {self.refused}"
        return {**stats, "on": self.status["on"], "reason": self.status["reason"], "line": line,
                "refused": self.refused, "key_s": self.key_s, "saved_s": self.saved_s}


class RunCost:
    """Whether reuse paid in one run, judged by `NodeReuse.cost` when the run ends (`free`).

    A watcher of the run's forwards (`RunState.watchers`): they are timed (`StepTimes`, on a GPU to the device's
    completion) from the first until each capture has a later forward to compare with, on one thread (multi-GPU
    sampling: one device's forwards). A first forward that read no key or captured nothing (a hit) ends the timing:
    such a run is not judged. `read` adds each key's time and scope (model, prefix size).
    """

    def __init__(self, cost: ReuseCost, owner: NodeReuse):
        self.cost, self.owner = cost, owner
        self.times = StepTimes()
        self.key_s = 0.0
        self.scopes: list = []  # (model, prefix size) of each key read this run
        self._device = None  # where the forward being timed computes
        self._thread: Optional[int] = None
        self._done = self._judged = False

    @staticmethod
    def scope(dm, key_tensor: torch.Tensor) -> tuple:
        """(model, prefix size): the model's key holds the prompt and references flattened, so its shape grows
        with the prefix. The model is held weakly: a new model at a dead one's address is another."""
        return weakref.ref(dm), tuple(key_tensor.shape)

    def off(self, dm, key_tensor: torch.Tensor) -> Optional[str]:
        return self.cost.off(self.scope(dm, key_tensor))

    def read(self, dm, key_tensor: torch.Tensor, seconds: float) -> float:
        """A key was read in `seconds`; returns the run's key time so far. Only the timed thread's keys count:
        its forwards are what they are weighed against."""
        if self._mine():
            self.scopes.append(self.scope(dm, key_tensor))
            self.key_s += seconds
        return self.key_s

    def _mine(self) -> bool:
        if self._thread is None:
            self._thread = threading.get_ident()
        return self._thread == threading.get_ident()

    def begin(self, device) -> None:
        if not self._done and device is not None and self._mine():
            self._device = device
            self.times.begin(device)  # what the forward does is told at its end

    def end(self, phase: str) -> None:
        if self._device is None or not self._mine():
            return
        device, self._device = self._device, None
        self.times.end(device, {CAPTURE: True, CACHED: False}.get(phase))
        # Nothing to compare past a first forward that read no key or captured nothing (a hit); once each capture
        # has its later forward, `StepTimes` itself times no more.
        self._done = not self.scopes or not self.times.extract

    def free(self) -> None:
        """The run ended: what its captures cost beyond as many cached forwards, against its keys' time."""
        if self._judged:
            return
        self._judged = True
        saved = self.times.saved()
        if saved is None or not self.scopes:
            return
        saved -= self.key_s  # the keys are read inside the capturing forwards: a hit reads them too
        self.owner.saved_s = saved
        for scope in dict.fromkeys(self.scopes):
            off = self.cost.judge(scope, self.key_s, saved)
            if off is not None:
                log.warning("KV Offload: prefix reuse is off for this model: %s", off)


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
            # The run's cache folder (nodes/run/host.py) is removed with the run, files and all: keep none of them.
            self._registry.note_rejection("file tiers: the run's cache folder is removed when the run ends")
            complete = False
        if not (complete and self._registry.admit(self._key, self._store, self._label)):
            self._store.close()
