"""`KVStore`: one cached prefix, put once per layer, got many times, then closed.

The store holds the schedule; its tier knows how to move bytes. Layers not kept on the device come back
through a ring of `depth + 1` device slots: when the consumer asks for layer i, the slot of the layer it
used before is released (an event on the consumer's stream marks when the kernels that read it are done),
layer i is waited for, and the next `depth` layers in the learned order are loaded into free slots. So at
most `depth + 1` layers are ever resident on the device, and a slot is overwritten only after the work that
read it has finished. Without CUDA the same code runs with every fence already complete.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from .config import HostServices, Mode, OffloadConfig
from .devices import DONE, Streams, unified_memory_reason
from .hostmem import HostAllocator
from .layout import LayerLayout, layout_for, views
from .policy import ASSUMED_LAYERS, LayerOrder, choose_tier, resolve
from .stats import StoreStats, default_pin_budget, free_device_memory, free_host_memory
from .tiers import DeviceTier, FileTier, Pending, RamTier, Tier, TierContext

log = logging.getLogger(__name__)


def _engine_mode(method):
    """Runs a public method outside inference mode and autograd.

    Hosts such as ComfyUI call us under `torch.inference_mode()`: buffers allocated there would be inference
    tensors, which the file tier's I/O thread (not in inference mode) may not write in place. Ordinary tensors
    made here are read fine by inference-mode code.
    """
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)
    return wrapper


class _Slot:
    __slots__ = ("buffer", "key", "pending", "release")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None
        self.key: Optional[Hashable] = None
        self.pending = Pending()
        self.release = DONE


class KVStore:
    """Holds the K/V of one prefix (one request, one CFG branch) on the tier chosen by `config`.

    Args:
        config: a validated `OffloadConfig`; mode `off` is refused (no cache means no store).
        device: the consuming device; `put` takes tensors on it and `get` returns tensors on it.
        host: the host application's services (pinning, streams, free memory, temp dir).
        expected_bytes: the size of the whole cache, for `auto`; default: first layer x 60 layers.
        name: shown in logs and stats (e.g. "cond", "uncond").
    """

    def __init__(self, config: OffloadConfig, device, *, host: Optional[HostServices] = None,
                 expected_bytes: Optional[int] = None, name: str = ""):
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"KVStore: `config` must be an OffloadConfig; got {type(config).__name__}.")
        if config.mode is Mode.OFF:
            raise ValueError("KVStore: mode 'off' means no KV cache, so there is nothing to store; "
                             "recompute the prefix instead of creating a store.")
        if expected_bytes is not None and (isinstance(expected_bytes, bool) or not isinstance(expected_bytes, int)
                                           or expected_bytes < 0):
            raise ValueError(f"KVStore: `expected_bytes` must be a byte count >= 0; got {expected_bytes!r}.")
        self.device = _check_device(device)
        self.config, self.name = config, name
        self._host = host or HostServices()
        self._expected = expected_bytes
        self._unified = unified_memory_reason(self.device)
        self.requested = config.mode
        self.mode: Optional[Mode] = None
        self.reason = "auto: decided at the first put"
        self._tier: Optional[Tier] = None
        self._slots: List[_Slot] = []
        self._layouts: Dict[Hashable, LayerLayout] = {}
        self._order = LayerOrder()
        self._current: Optional[_Slot] = None
        self.closed = False
        self.sealed = False  # set by park(): complete and read-only
        self._stats = StoreStats()
        if config.mode is not Mode.AUTO:
            self._open(*resolve(config.mode, self._unified))

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _open(self, mode: Mode, reason: str) -> None:
        self.mode, self.reason = mode, reason
        if mode is not self.requested and self.requested is not Mode.AUTO:
            log.warning("KV offload%s: %s", f" [{self.name}]" if self.name else "", reason)
        depth = self.config.depth if mode.is_async else 0
        cuda = self.device.type == "cuda"
        budget = self.config.pin_budget if self.config.pin_budget is not None else default_pin_budget(self._host)
        allocator = HostAllocator(mode.is_async and cuda, budget, self._host.pin, self._host.unpin)
        self._streams = Streams(self.device, mode.is_async, self._host.stream)
        ctx = TierContext(self.device, self._streams, allocator, depth)
        self._allocator, self.depth = allocator, depth
        if mode is Mode.GPU:
            self._tier = DeviceTier(ctx)
        elif mode.is_ram:
            self._tier = RamTier(ctx)
        else:
            parent = self.config.file_dir or (self._host.temp_dir() if self._host.temp_dir else None)
            self._tier = FileTier(ctx, parent, self.config.bypass, mode is Mode.FILE_ASYNC)
        self._slots = [] if self._tier.on_device else [_Slot() for _ in range(depth + 1)]
        # A safety net for stores that are dropped without close(): files and pinned pages still go away.
        self._finalizer = weakref.finalize(self, _close_tier, self._tier, self._streams)
        log.info("KV offload%s: tier %s (%s), prefetch depth %d", f" [{self.name}]" if self.name else "",
                 mode.value, reason, depth)

    @_engine_mode
    def close(self) -> None:
        """Finishes or cancels outstanding transfers, then frees every buffer and deletes every file.

        Idempotent; runs the same on normal completion, interruption and exceptions.
        """
        if self.closed:
            return
        self.closed = True
        try:
            for slot in self._slots:
                slot.pending.cancel()
        finally:
            self._current = None
            if self._tier is not None:
                self._finalizer()  # background work finished, then buffers freed and files deleted
                self._streams.resolve(block=True)
                log.info("KV offload%s: closed; %s", f" [{self.name}]" if self.name else "", self._stats.summary(self._streams))
            # Device slots go last: no copy into them can be in flight any more.
            self._slots = []
            self._stats.device_bytes = 0
            self._stats.resident_layers = 0

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- put / get -------------------------------------------------------------------------------------------
    @_engine_mode
    def put(self, key: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores layer `key` once. The store takes a private copy; `k` and `v` stay the caller's."""
        self._check_open("put")
        if self.sealed:
            raise RuntimeError(f"KVStore.put: store {self.name!r} is sealed (kept for reuse, read-only); put into a "
                               "new store.")
        _check_pair(key, k, v, self.device)
        if key in self._layouts:
            raise ValueError(f"KVStore.put: layer {key!r} was already put; a store holds one prefix, put once. "
                             "Use a new store (or close this one) for a new request.")
        layout = layout_for(k, v)
        if self._tier is None:
            need = self._expected if self._expected is not None else layout.data_bytes * ASSUMED_LAYERS
            self._open(*self._choose(need))
        self._tier.store(key, k, v, layout)
        self._layouts[key] = layout
        self._order.add(key)
        if self._tier.on_device:
            self._stats.add_device(layout.k.nbytes + layout.v.nbytes, layers=1)
        else:
            self._stats.count_transfer(layout.data_bytes)

    def _choose(self, need: int) -> Tuple[Mode, str]:
        # On a CPU device the "device" memory is host RAM: keeping the cache there or in a RAM tier is the same.
        unified = self._unified or ("the device is the CPU" if self.device.type == "cpu" else None)
        budget = self.config.pin_budget if self.config.pin_budget is not None else default_pin_budget(self._host)
        mode, why = choose_tier(need, free_device_memory(self.device, self._host), free_host_memory(self._host),
                                unified, budget)
        return mode, f"auto: {why}"

    @_engine_mode
    def get(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer `key` on the device, bit-identical to what was put.

        Valid until the next `get` on this store or `close()`; the next layers are prefetched meanwhile.
        """
        self._check_open("get")
        layout = self._layouts.get(key)
        if layout is None:
            raise KeyError(f"KVStore.get: layer {key!r} was never put into store {self.name!r}.")
        self._stats.gets += 1
        if self._tier.on_device:
            return self._tier.view(key)
        if self._current is not None and self._current.key == key:
            return views(self._current.buffer, layout)  # the same layer again: not a new pass, nothing moves
        self._order.observe(key)
        self._release_current()
        # Timed on the consumer's stream: a copy made there (sync tiers) or a wait for a late prefetch is time
        # the consumer is stalled; copies queued on the side stream are not.
        with self._streams.timed("wait"):
            slot = self._slot_of(key)
            if slot is None:  # not prefetched: the consumer waits for the whole load
                self._stats.misses += 1
                slot = self._load(key, self._spare_slot(keep=()))
            self._prefetch_after(key)
            try:
                slot.pending.wait(self._streams.consumer())
            except BaseException:
                slot.key = None  # what the slot holds is unknown now: never serve it
                raise
        self._current = slot
        return views(slot.buffer, layout)

    def _prefetch_after(self, key: Hashable) -> None:
        ahead = self._order.ahead(key, self.depth)
        for nxt in ahead:
            if self._slot_of(nxt) is None:
                spare = self._spare_slot(keep={key, *ahead})
                if spare is None:
                    return
                self._load(nxt, spare)

    def _release_current(self) -> None:
        if self._current is not None:
            # Kernels reading this slot are queued on the consumer's stream up to here; a copy into the slot
            # waits for this event, so it can never overwrite data still being read.
            self._current.release = self._streams.record()
            self._current.key = None
            self._current = None

    def _slot_of(self, key: Hashable) -> Optional[_Slot]:
        return next((s for s in self._slots if s.key == key), None)

    def _spare_slot(self, keep) -> Optional[_Slot]:
        """An empty slot, else one holding a prefetch no longer expected (skipped block, changed order).

        Reusing a slot with a load still in flight is safe: copies into it are queued first-in-first-out on
        one stream (and one I/O thread), and each waits for the slot's release fence.
        """
        empty = next((s for s in self._slots if s.key is None), None)
        return empty or next((s for s in self._slots if s.key not in keep), None)

    def _load(self, key: Hashable, slot: _Slot) -> _Slot:
        layout = self._layouts[key]
        if slot.buffer is None or slot.buffer.numel() < layout.data_bytes:
            slot.pending.settle()  # the old buffer may still be the target of a copy
            old = slot.buffer.numel() if slot.buffer is not None else 0
            slot.buffer = torch.empty(layout.data_bytes, dtype=torch.uint8, device=self.device)
            # The caching allocator may hand out memory freed by kernels still queued on the consumer's stream;
            # a copy on the side stream must not start before they have run.
            slot.release = self._streams.record()
            self._stats.add_device(layout.data_bytes - old, layers=0)
        slot.key = None  # set only once the load is queued: a failed load must never be served
        slot.pending = self._tier.load(key, slot.buffer, slot.release)
        slot.key = key
        self._stats.count_transfer(layout.data_bytes)
        self._stats.set_resident(sum(1 for s in self._slots if s.key is not None))
        return slot

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"KVStore.{what}: store {self.name!r} is closed; create a new store per request.")

    @_engine_mode
    def park(self) -> None:
        """Between requests (prefix reuse): seal the store and free its device slots; the data stays.

        Outstanding loads finish first and the consumer's stream is synchronized, so no kernel still reads a
        slot when it is dropped. Afterwards `put` is refused and `get` works as before (slots are made again on
        demand). Idempotent; a no-op on a closed store.
        """
        if self.closed or self._tier is None:
            return
        self.sealed = True
        self._release_current()
        for slot in self._slots:
            slot.pending.settle()
        self._streams.synchronize()
        if self._streams.asynchronous:
            torch.cuda.current_stream(self.device).synchronize()
        self._slots = [_Slot() for _ in self._slots]
        if not self._tier.on_device:
            self._stats.device_bytes = 0
            self._stats.resident_layers = 0

    # -- reporting -------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """A plain dict of what the store holds where, what it moved and how long the consumer waited."""
        tier_bytes = self._tier.nbytes() if self._tier is not None and not self.closed else {}
        info = self._tier.info() if self._tier is not None else {}
        if self._tier is not None:
            self._streams.resolve(block=False)
        return self._stats.as_dict(
            self, len(self._layouts), tier_bytes, info, self._streams if self._tier is not None else None,
            self._allocator.fallback_reason if self._tier is not None else None,
        )


def _close_tier(tier: Tier, streams: Streams) -> None:
    # Order matters: background jobs and side-stream copies touch host buffers and files, so they finish
    # before the tier frees or deletes anything.
    try:
        streams.synchronize()
        if streams.asynchronous:
            torch.cuda.current_stream(streams.device).synchronize()
    finally:
        tier.close()
        streams.synchronize()


def _check_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"KVStore: `device` {device!r} is not a torch device ({exc}). Pass e.g. 'cuda:0'.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"KVStore: `device` is {device}, but CUDA is not available here. Pass device='cpu'.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_pair(key: Hashable, k, v, device: torch.device) -> None:
    if key is None:
        raise TypeError("KVStore.put: layer key None is reserved; use e.g. the layer index or ('double', i).")
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"KVStore.put: layer key {key!r} is not hashable; use e.g. an int or a tuple.") from None
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"KVStore.put: `{name}` must be a torch.Tensor; got {type(t).__name__}.")
        same = t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
        if not same:
            raise ValueError(f"KVStore.put: `{name}` is on {t.device}, but this store serves {device}. "
                             f"Create the store with device={str(t.device)!r}, or move the tensor first.")
