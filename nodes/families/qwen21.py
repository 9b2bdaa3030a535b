"""Qwen-Image 2.1: our stores behind the model's own prefix-cache interface.

Newer ComfyUI (not v0.33.0) gives `QwenImage21Transformer2DModel` its own prefix K/V cache: per forward it
calls `self.select_prefix_cache(key, cache_bytes, device, options)` -> `(cache, filled)` and then, per
block, `cache.put(i, kv)` (kv: (B, 2, P, H, D), K after RoPE) on the capture, `cache.take(i, device,
dtype, B)` -> (B, 2, P, H, D) on every pass and `cache.prefetch(i + 1, device, dtype)` on cached passes;
`options` is `transformer_options["qwen_image21_cache"]`. The model turns its cache off whenever an
`attn1_patch`, `post_input`, `single_block` patch or `dit` replacement is present, so for 2.1 we hook no
attention: an object patch of `select_prefix_cache` hands the model a `PrefixStoreCache` backed by this
run's `KVStore`s, one per prefix key (one per cond), and the model's cache logic stays in charge.

No ComfyUI import.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Optional

import torch

from ...offload_core.config import Mode
from ...offload_core.layout import stacked
from ..run.branch import BranchCache
from .cache_dtype import storage_for_qwen21
from ..keys import OUR_PATCH, QWEN21_OFF, QWEN21_OPTIONS, RUN_KEY
from ..run.branch import repeat_to_batch_size
from ..run.reuse import REUSE, ReusableStore

log = logging.getLogger(__name__)

OPTIONS_KEY = QWEN21_OPTIONS
PREFIX_ENTRIES = object()  # the run's extension key of this family's `PrefixStoreCache`


def qwen21_support() -> str:
    """One sentence on whether this ComfyUI has Qwen-Image 2.1 (its prefix-cache seam), for the node's help."""
    import importlib.util

    try:
        found = importlib.util.find_spec("comfy.ldm.qwen_image21.model") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return "Qwen-Image 2.1: supported through the model's own prefix cache."
    return ("Qwen-Image 2.1: not in this ComfyUI version (it arrived after v0.33.0); update ComfyUI to use it. "
            "The other models work as usual.")


def has_prefix_cache(diffusion_model) -> bool:
    """True when the model exposes the Qwen-Image 2.1 prefix-cache seam."""
    return callable(getattr(diffusion_model, "select_prefix_cache", None)) and hasattr(diffusion_model, "transformer_blocks")


class PrefixStoreCache:
    """`PoseBranchCache`-shaped view of one run's stores: select / filled / put / take / prefetch / free.

    The prefix entry selected by `select(key)` is one engine store. The store learns the layer order on the
    capture and prefetches on its own, so `prefetch` has nothing left to do.
    """

    def __init__(self, run, n_blocks: int, reuse=None, dm=None, device=None):
        self.run = run
        self.n_blocks = n_blocks
        self.device = device  # ComfyUI's device of the thread this cache serves (multi-GPU sampling), else None
        self.label = "cond" if device is None else f"cond on {device}"
        self.entries: list = []  # [(key tensor, branch id)]: the prefix entries
        self.entry = None
        self._fresh: dict = {}
        self._ids = itertools.count()
        self.reuse, self.dm = reuse, dm  # reuse: a `NodeReuse` (prefixes kept across runs), else None
        self._reuse_keys: dict = {}  # branch id -> the key its capture is kept under
        self.model_state = None  # the model's fingerprint, read once per run: its conds share the model

    def select(self, key: torch.Tensor, create: bool = True) -> bool:
        self._fresh.clear()
        self.entry = None
        for k, sid in self.entries:
            if k.shape == key.shape and torch.equal(k, key.to(k.device)):
                if self.filled(self.n_blocks, sid):
                    self.entry = sid
                    return True
                # a capture that did not finish (interrupt, error): never serve it, start over
                self._remove(sid)
                break
        if not create:
            return False
        sid = ("qwen21", self.device, next(self._ids))
        self.run.add_branch(sid, BranchCache())
        self.entries.append((key.detach().clone(), sid))
        self.entry = sid
        return True

    def _remove(self, sid) -> None:
        self.entries = [(k, s) for k, s in self.entries if s != sid]
        self.run.drop_branch(sid)

    def filled(self, num_blocks: int, sid=None) -> bool:
        branch = self.run.branches.get(self.entry if sid is None else sid)
        return branch is not None and len(branch.layers) == num_blocks

    def adopt(self, key: torch.Tensor) -> bool:
        """Select a prefix kept by an earlier run for `key` (a hit: no capture), else remember its reuse key."""
        reuse_key, self.model_state = self.reuse.key(self.dm, key, self.run, self.model_state)
        entry = self.reuse.registry.lookup(reuse_key) if reuse_key is not None else None
        if entry is None:
            self.select(key)
            if reuse_key is not None:
                self._reuse_keys[self.entry] = reuse_key
            return False
        sid = ("qwen21", self.device, next(self._ids))
        name = self.run.unique_name(self.label)
        self.run.add_branch(sid, BranchCache(store=ReusableStore(entry.store, self.reuse.registry, entry=entry),
                                             layers=set(range(self.n_blocks)), complete=True, name=name))
        self.run.track_store(name, entry.store)
        self.entries.append((key.detach().clone(), sid))
        self.entry = sid
        return True

    def put(self, i: int, t: torch.Tensor) -> None:
        """t: (B, 2, P, H, D) stacked K/V of block i; the store takes its own copy."""
        self.run.put(self.entry, i, t[:, 0], t[:, 1], label=self.label)
        if self.entry in self._reuse_keys:  # kept when the run closes it, if the capture completed
            branch = self.run.branches[self.entry]
            branch.store = ReusableStore(branch.store, self.reuse.registry, key=self._reuse_keys.pop(self.entry),
                                         n_layers=self.n_blocks, label=branch.name)
        self._fresh[i] = t  # the capture reads it back at once: serve the model's own tensor

    def take(self, i: int, device, dtype, batch_size: int) -> torch.Tensor:
        """Block i's stacked K/V, read-only, valid until the next `take`: the model holds it into block i + 1,
        so it is the store's own memory (a view of the pair it serves), never a tensor made in block i."""
        t = self._fresh.pop(i, None)
        if t is None or self.run.config.storage != "exact":
            # Lossy storage: the capture attends to the decoded prefix too, as every later pass and a reuse
            # hit do, so the image does not depend on whether the prefix was just made or kept.
            k, v = self.run.get(self.entry, i)
            t = stacked(k, v)
            if t is None:  # a store that serves K and V apart: a copy, made outside the block's allocations
                with self.run.paused():
                    t = torch.stack([k, v], dim=1)
        if (dtype is not None and t.dtype != dtype) or t.shape[0] != batch_size:
            with self.run.paused():  # a model asking for another dtype or batch than it put: a copy per take
                t = repeat_to_batch_size(t.to(dtype or t.dtype), batch_size)
        return t

    def prefetch(self, i: int, device=None, dtype=None) -> None:
        return None

    def free(self) -> None:
        self._fresh.clear()
        for _, sid in list(self.entries):
            self.run.drop_branch(sid)
        self.entries = []
        self.entry = None


def make_select_prefix_cache(original: Callable, n_blocks: int, reuse=None) -> Callable:
    """The object patch for `diffusion_model.select_prefix_cache`.

    With a run of ours in `options` it returns our cache; without one (our run stood down) it defers to the
    model's own method, so the model behaves exactly as without the node. `reuse` (a `NodeReuse`): a key this
    run has no prefix entry for is looked up among the prefixes kept by earlier runs first.
    """

    def select_prefix_cache(key, cache_bytes, device, options):
        options = options if isinstance(options, dict) else {}
        run = options.get(RUN_KEY)
        if run is None or run.closed:
            return original(key, cache_bytes, device, options)
        if run.stood_down:  # the run stepped aside (a full disk, say): recompute, as its other families do
            return None, False
        if options.get(QWEN21_OFF[0]) == QWEN21_OFF[1]:
            return None, False
        # One cache per device under multi-GPU sampling: each device's thread runs its own copy of the model and
        # reads only its own stores (a store serves one thread).
        device = run.thread_device
        where = PREFIX_ENTRIES if device is None else (PREFIX_ENTRIES, str(device))
        cache: Optional[PrefixStoreCache] = run.extension(where)
        if cache is None:
            # the model of this thread's forward; else the one patched (a bound method; None for a function)
            dm = run.thread_model if has_prefix_cache(run.thread_model) else getattr(original, "__self__", None)
            cache = run.add_extension(where, PrefixStoreCache(run, n_blocks, reuse, dm,
                                                              None if device is None else str(device)))
        if cache.select(key, create=False):
            return cache, True
        if reuse is not None and cache.dm is not None:
            return cache, cache.adopt(key)
        cache.select(key)
        return cache, False

    select_prefix_cache.kv_offload = True
    return select_prefix_cache


# --- the family's three steps: patch the clone, configure a run, attach it -------------------------------------

def patch_qwen21(m, dm, config, to: dict, reuse: bool) -> "tuple[object, list]":
    """Put our cache behind the clone's `select_prefix_cache`; `(config, notes)` after ComfyUI's own cache dtype.

    ComfyUI's own prefix-cache options upstream of our node are kept and their dtype honoured; mode off turns
    the model's cache off.
    """
    opts = dict(to.get(OPTIONS_KEY) or {})
    config, note = storage_for_qwen21(config, opts)
    if note:
        log.warning(note)
    if config.mode is Mode.OFF:
        opts[QWEN21_OFF[0]] = QWEN21_OFF[1]
    else:
        if opts.get(QWEN21_OFF[0]) == QWEN21_OFF[1]:  # an upstream "off" would stop the model asking for our cache
            del opts[QWEN21_OFF[0]]
        original = type(dm).select_prefix_cache.__get__(dm)  # the class's, not an earlier object patch
        m.add_object_patch(OUR_PATCH,
                           make_select_prefix_cache(original, len(dm.transformer_blocks),
                                                    REUSE.watch_unload(m) if reuse else None))
    to[OPTIONS_KEY] = opts
    return config, [note] if note else []


def qwen21_run_config(config, to: dict):
    """The run's config after ComfyUI's cache options set downstream of our node (their dtype, said once)."""
    mapped, note = storage_for_qwen21(config, to.get(OPTIONS_KEY))
    if note and mapped is not config:
        log.warning(note)
    return mapped


def attach_qwen21(run, to: dict, n_layers: int) -> None:
    """Hand the run to our `select_prefix_cache` patch, through the options the model passes it."""
    to[OPTIONS_KEY] = {**(to.get(OPTIONS_KEY) or {}), RUN_KEY: run}
