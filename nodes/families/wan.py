"""Wan Animate 2: the pose cache (the pose K/V input of each block) served by our stores.

ComfyUI (v0.33, `comfy/ldm/wan/model_animate2.py`) reads `transformer_options["animate2_cache"]` in the
Wan Animate 2 forward and, when the forward carries pose latents, calls `select(pose_latents)`, then
`filled(num_blocks)`; on a filling pass `put(i, x_pose)` with each block's pose input (B, L, dim);
on a cached pass `take(i, device, dtype, batch_size)` -> (batch_size, L, dim) and `prefetch(i + 1, device,
dtype)` before block i's compute. Under context windows a filling pass puts every block first and then
reads them all back in the same forward. ComfyUI's own `PoseBranchCache` (made by the `WanAnimate2Cache`
node) keeps one entry per pose sequence -- one per context window -- keyed on batch row 0 of the pose
latents and stores row 0 only (`x_pose[:1]`), repeated to the batch on read.

`PoseStoreCache` keeps that contract with one engine `KVStore` per window (ComfyUI's entry, which its code calls a slot), alive for one
sampling run, one such cache per device under multi-GPU sampling (`PoseCaches`): the row-0 input is split along its tokens into the store's two tensors and joined again on read, so
every lossless mode returns the very bytes that were put. The node's budgets cover the pose cache as a
whole (all windows together): a window gets what the windows before it left of the RAM and VRAM budgets,
and what overflows the RAM budget goes to files instead of being evicted. Windows are evicted (least
recently used first, counted) only when the place the mode keeps them in has no room for one more.

No ComfyUI import.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from ...offload_core.config import OffloadConfig
from ...offload_core.layout import layout_for
from ...offload_core.places import PAGEABLE, PINNED
from ..run.branch import BranchCache, layer_bytes
from .cache_dtype import storage_for_cache_dtype
from ..keys import ANIMATE2_CACHE
from ..run.branch import repeat_to_batch_size
from .wan_windows import Window, place_room, window_config, window_line

log = logging.getLogger(__name__)

CACHE_KEY = ANIMATE2_CACHE  # transformer_options key the Wan Animate 2 model reads
POSE_CACHE = object()  # the run's extension key of this family's `PoseStoreCache`
LABEL = "WanAnimate2Cache"
MARGIN = 1.5  # ComfyUI's own estimate for the next window: the largest filled one, times 1.5


def has_pose_cache(dm) -> bool:
    """True for a Wan Animate 2 diffusion model (it reads its pose cache from `animate2_cache`)."""
    return callable(getattr(dm, "rope_encode_pose", None)) and hasattr(dm, "blocks")


def is_ours(cache) -> bool:
    return isinstance(cache, (PoseCaches, PoseStoreCache))


def take_over_pose_cache(m, dm, config: OffloadConfig, to: dict, reuse: bool) -> "tuple[OffloadConfig, list]":
    """Remove ComfyUI's own pose cache from `to` (our clone's options); `(config, notes)` after its dtype.

    `m`, `dm` and `reuse` are not used: the model reads its cache from `to` alone, and pose windows are never
    kept across runs.
    """
    theirs = to.pop(CACHE_KEY, None)
    if theirs is None or is_ours(theirs):
        return config, []
    config, note = storage_for_cache_dtype(config, getattr(theirs, "dtype", None), LABEL)
    said = [f"KV Offload: {LABEL} found upstream; its pose cache is replaced by mode {config.mode.value}.",
            *([note] if note else [])]
    for line in said:
        log.warning(line)
    return config, said


def attach_cache(run, to: dict, n_blocks: int) -> "PoseStoreCache":
    """Put this run's cache into the run's options; a ComfyUI cache set after our node is taken over too."""
    theirs = to.get(CACHE_KEY)
    if theirs is not None and not is_ours(theirs):
        run.config, note = storage_for_cache_dtype(run.config, getattr(theirs, "dtype", None), LABEL)
        log.warning("KV Offload: %s is applied after KV Offload Settings; KV Offload serves its pose cache in mode %s "
                    "for this run.%s", LABEL, run.config.mode.value, f" {note}" if note else "")
    cache = to[CACHE_KEY] = run.add_extension(POSE_CACHE, PoseCaches(run, n_blocks))
    return cache


class PoseCaches:
    """The pose cache the model reads from `animate2_cache`: one `PoseStoreCache` per device.

    Under multi-GPU sampling every device's thread runs its own copy of the model, and all of them read the same
    options: each call goes to the cache of its thread's device (`RunState.thread_device`), so a window is
    filled and read on one device by one thread. On one device there is one cache. The RAM budget covers the
    windows of every device together; the VRAM budget, each device's own.
    """

    def __init__(self, run, n_blocks: int):
        self.run, self.n_blocks = run, n_blocks
        self.by_device: dict = {}  # str(device), or None on one device -> its PoseStoreCache
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # the devices' caches open their windows one at a time (`_open_store`)
        self._shown = False

    def here(self) -> "PoseStoreCache":
        """The cache of this thread's device."""
        device = self.run.thread_device
        where = None if device is None else str(device)
        cache = self.by_device.get(where)
        if cache is None:
            with self._lock:
                cache = self.by_device.setdefault(
                    where, PoseStoreCache(self.run, self.n_blocks, where, self.windows, self._opening))
        return cache

    def windows(self) -> list:
        """Every device's windows."""
        return [w for cache in list(self.by_device.values()) for w in list(cache.windows)]

    def select(self, pose_latents: torch.Tensor) -> None:
        if not self._shown:  # the run has started by the first forward: the readout shows it from now on
            self._shown = True
            self.run.telemetry.track_section(CACHE_KEY, self)
        self.here().select(pose_latents)

    def filled(self, num_blocks: int) -> bool:
        return self.here().filled(num_blocks)

    def put(self, i: int, x_pose: torch.Tensor) -> None:
        self.here().put(i, x_pose)

    def prefetch(self, i: int, device=None, dtype=None) -> None:
        return None  # see `PoseStoreCache.prefetch`

    def take(self, i: int, device, dtype, batch_size: int) -> torch.Tensor:
        return self.here().take(i, device, dtype, batch_size)

    def free(self) -> None:
        for cache in list(self.by_device.values()):
            cache.free()

    def summary(self) -> dict:
        """Every device's windows together (their names carry the device)."""
        parts = [cache.summary() for cache in list(self.by_device.values())]
        if len(parts) == 1:
            return parts[0]
        out = {key: sum(p[key] for p in parts) for key in ("windows", "hits", "fills", "evictions")}
        out["per_window"] = {name: line for p in parts for name, line in p["per_window"].items()}
        return out


class PoseStoreCache:
    """ComfyUI's `PoseBranchCache` contract over one run's stores: select / filled / put / prefetch / take / free.

    Windows are kept in LRU order (most recently selected last). `hits` counts selects served by a filled
    window, `fills` windows filled, `evictions` windows dropped to make room. After the run stands down (a
    full disk) nothing is stored: `filled` is False and a window prepass is served from
    the model's own tensors, so the model recomputes as without a cache.
    """

    def __init__(self, run, n_blocks: int, device: Optional[str] = None, every_window=None, opening=None):
        self.run, self.n_blocks = run, n_blocks
        self.device = device  # ComfyUI's device of the thread this cache serves (multi-GPU sampling), else None
        self._every_window = every_window or (lambda: self.windows)  # the RAM budget covers them all
        self._opening = opening or threading.Lock()  # one window opens at a time, across devices
        self.windows: list = []
        self.window: Optional[Window] = None
        self.hits = self.fills = self.evictions = 0
        self._fresh: dict = {}  # block -> tensor, only while stood down
        self._count = 0
        self._final: Optional[dict] = None

    # -- the model's calls ---------------------------------------------------------------------------------
    def select(self, pose_latents: torch.Tensor) -> None:
        self._fresh.clear()
        if self.window is not None:
            self._bytes(self.window)  # the figures of the forward that used it, kept for the end-of-run line
        self.window = None
        if self.run.stood_down or self.run.closed:
            return
        key = pose_latents[:1]  # ComfyUI keys on batch row 0: a cond batch size change mid-run stays valid
        for w in self.windows:
            if w.key.shape == key.shape and torch.equal(w.key, key.to(w.key.device)):
                if self._complete(w):
                    self.windows.remove(w)
                    self.windows.append(w)
                    w.hits += 1
                    self.hits += 1
                    self.window = w
                    return
                self._drop(w)  # a fill that did not finish (interrupt, error): never serve it, start over
                break
        self._make_room()
        self._count += 1
        where = "" if self.device is None else f" on {self.device}"
        w = Window(key.detach().clone(), ("pose", self.device, self._count), f"pose {self._count}{where}")
        self.run.add_branch(w.sid, BranchCache(name=w.name))
        self.windows.append(w)
        self.window = w

    def filled(self, num_blocks: int) -> bool:
        branch = self.run.branches.get(self.window.sid) if self.window is not None else None
        return branch is not None and len(branch.layers) == num_blocks

    def put(self, i: int, x_pose: torch.Tensor) -> None:
        """x_pose: (B, L, dim) input of block i; row 0 is stored (the store takes its own copy)."""
        t = x_pose[:1]
        w = self.window
        if w is None or self.run.stood_down:
            # A context-window prepass reads these back in this forward; a copy of row 0, not a view that would
            # keep every block's whole batch alive until the next select (nor a tensor of this block's).
            with self.run.paused():
                self._fresh[i] = t.clone()
            return
        half = (t.shape[1] + 1) // 2
        k, v = t[:, :half], t[:, half:]
        branch = self.run.branches[w.sid]
        if branch.store is None:
            self._open_store(w, branch, k, v)
        self.run.put(w.sid, i, k, v, label=w.name)
        if self.run.stood_down:  # the store could not take it (disk full): recompute from here on
            with self.run.paused():
                self._fresh[i] = t.clone()
        elif len(branch.layers) == self.n_blocks:
            self.fills += 1

    def prefetch(self, i: int, device=None, dtype=None) -> None:
        """Nothing to do: each store learned the block order while filling and loads block i + 1 ahead
        (on its side stream, behind block i's compute) when block i is taken."""
        return None

    def take(self, i: int, device, dtype, batch_size: int) -> torch.Tensor:
        t = self._fresh.pop(i, None)
        if t is None:
            if self.window is None or self.run.stood_down:
                raise RuntimeError(
                    f"KV Offload: the pose cache of block {i} is gone ({self.run.stood_down or 'no window selected'}) "
                    "in the middle of a context-window pass. Free disk space or pick a RAM mode, and run again.")
            k, v = self.run.get(self.window.sid, i)
            t = torch.cat([k, v], dim=1)  # a copy: the store's buffers are reused by its next get
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return repeat_to_batch_size(t, batch_size)

    def free(self) -> None:
        """Drop every window (their stores close: files deleted, pinned memory returned). Idempotent."""
        if self._final is None:
            self._final = self.summary()
            if self._final["per_window"]:
                log.info("KV Offload: pose cache, %d fills, %d hits, %d evictions: %s", self.fills, self.hits,
                         self.evictions, "; ".join(self._final["per_window"].values()))
        self._fresh.clear()
        for w in list(self.windows):
            self.run.drop_branch(w.sid)
        self.windows, self.window = [], None

    # -- budgets and room ----------------------------------------------------------------------------------
    def _complete(self, w: Window) -> bool:
        branch = self.run.branches.get(w.sid)
        return branch is not None and len(branch.layers) == self.n_blocks

    def _drop(self, w: Window) -> None:
        self.windows.remove(w)
        self.run.drop_branch(w.sid)

    def _open_store(self, w: Window, branch: BranchCache, k: torch.Tensor, v: torch.Tensor) -> None:
        expected = layer_bytes(k, v) * self.n_blocks
        with self._opening:  # another device's window may be opening now: each books its share of the RAM budget
            config = window_config(self.run.config, [self._held(o) for o in self._every_window() if o is not w],
                                   [self._bytes(o) for o in self.windows if o is not w])
            in_ram = layout_for(k, v).data_bytes * self.n_blocks  # as the RAM places lay a layer out
            w.claim = min(config.host_budget, in_ram) if config.host_budget is not None else 0
        w.store = branch.store = self.run.open_store(w.name, self.run.thread_device or k.device, expected, config)

    def _bytes(self, w: Window) -> dict:
        """The window's bytes per place (refreshed while its store is open)."""
        if w.store is not None and not w.store.closed:
            w.bytes = dict(w.store.stats()["bytes"])
        return w.bytes

    def _held(self, w: Window) -> dict:
        """The window's bytes per place; while it fills, at least the RAM it booked when it opened."""
        b = dict(self._bytes(w))
        if w.claim and not self._complete(w):
            b[PAGEABLE] = max(b.get(PAGEABLE) or 0, w.claim - (b.get(PINNED) or 0))
        return b

    def _make_room(self) -> None:
        """Evict least recently used windows while the mode's place has no room for one more."""
        sizes = [sum(v for v in self._bytes(w).values() if v) for w in self.windows]
        need = max(sizes, default=0) * MARGIN
        while self.windows and need > 0:
            room = place_room(self.run.config, self.run.host, self._device())
            if room is None or room >= need:
                return
            w = self.windows[0]
            log.info("KV Offload: pose cache %s evicted (%s bytes free where it is kept, %d needed)",
                     w.name, room, int(need))
            self._drop(w)
            self.evictions += 1

    def _device(self) -> Optional[torch.device]:
        for w in self.windows:
            branch = self.run.branches.get(w.sid)
            if branch is not None and branch.store is not None:
                return branch.store.device
        return None

    def summary(self) -> dict:
        """What the readout shows of the pose cache: totals, and one line per window kept."""
        if self._final is not None:
            return self._final
        return {"windows": len(self.windows), "hits": self.hits, "fills": self.fills, "evictions": self.evictions,
                "per_window": {w.name: window_line(w) for w in self.windows}}
