"""`GrowingKVStore`: a cache whose layers grow by blocks of tokens and are read as a prefix (autoregressive video).

Each layer is a pair (B, S, H, D) of capacity S tokens that the consumer fills block by block: it reads the
committed prefix [0, c), writes its current block after it and attends to both; once a block is final the
consumer commits it (`commit`), and the store keeps those tokens in the layer's place, once. `view(layer)`
hands out the layer's working pair on the device: a resident layer's own buffers (whole layers up to the device
budget, as upstream keeps every layer), or a ring slot (`ring.py`) into which the layer's committed prefix
was loaded (prefetched behind the previous layers' compute in the async modes), with room for the block.

Places come from the same plan as a `KVStore`'s (`plan.py`), sized by the layers' full capacity for the device;
RAM layers are counted by what they hold, so they stay in RAM until the host's budget is reached and the layer
whose next block would pass it moves down to files (`stats()["growing"]["moves"]` says which and why). With
storage fp8 / int8 the streamed layers keep their blocks packed (`packing.py`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, Hashable, List, Optional, Set, Tuple

import torch

from ..store.codec import Compact, codec_for
from ..config import HostServices, Mode, OffloadConfig
from ..host.devices import unified_memory_reason
from ..store.checks import Consumer, Owner, engine_mode, one_consumer
from ..store.hostfacts import free_device_memory, free_host_memory, same_pool_reason
from ..host.hostmem import pin_room
from ..store.layers import Layers
from ..places import DEVICE, FILE, HOST_PLACES, WORDS
from ..store.plan import Figures, Plan, make_plan, resolve
from ..store.resources import StoreResources
from ..store.ring import LayerOrder
from ..store.stats import Snapshot, StoreStats
from ..store.kvstore import KVStore
from .packing import Packing, packed_width
from .ring import PrefixRing
from .shape import GrowingShape, working_pair

log = logging.getLogger(__name__)


class GrowingKVStore:
    """Holds the growing K/V of one run (one video, one batch) where the plan of `config` puts each layer.

    Args:
        config: a validated `OffloadConfig` (mode other than `off`). With storage fp8 / int8 the streamed layers
            keep each block packed (`packing.py`); resident layers stay exact (they are the working pairs).
        device: where the consumer computes; `view` returns tensors there.
        shape: every layer's working pair (`GrowingShape`). layers: how many layers the consumer has.
        host, name: as for `KVStore`.

    One consumer thread, as `KVStore`; `stats()` and `close()` from any thread.
    """

    def __init__(self, config: OffloadConfig, device, *, shape: GrowingShape, layers: int,
                 host: Optional[HostServices] = None, name: str = ""):
        self.device = KVStore.check_config(config, device)
        self.config, self.name, self.shape, self.expected = config, name, shape, max(int(layers), 1)
        self._host = host or HostServices()
        self._paused = self._host.pause_graph or contextlib.nullcontext
        self._consumer, self._busy, self._owner = Consumer(), threading.RLock(), Owner()
        self.requested, self.closed = config.mode, False
        unified = unified_memory_reason(self.device)
        self.mode, self._granted = (Mode.AUTO, "auto") if config.mode is Mode.AUTO else resolve(config.mode, unified)
        if self.mode is not self.requested:
            log.warning("KV offload [%s]: %s", name, self._granted)
        self._stats = StoreStats(name, str(self.device), self.requested.value, config.storage)
        self._order = LayerOrder()
        self._res = StoreResources(self, self._owner, config, self._host, self.device,
                                   self.mode is Mode.AUTO or self.mode.is_async,
                                   Layers(Compact(None, "")), self._order, self._stats)
        self._tiers = self._res.tiers  # owned by the resources: opened there, closed with them
        self.depth = self._res.depth
        self.plan = self._make_plan(unified)
        if self.mode is Mode.AUTO:
            self.mode = self.plan.mode
        self._where: Dict[Hashable, str] = {}
        self._committed: Dict[Hashable, int] = {}
        self._resident: Set[Hashable] = set()
        self._packing = Packing(Compact(codec_for(config.storage), f"KV offload [{name}]"))
        self._ring = PrefixRing(self.depth, self._res.streams, self._order, self._stats, self._load,
                                self.committed, self._new_pair, self._packing)
        self.appended = {"count": 0, "bytes": 0}
        self.moves: List[str] = []
        self._steps = {"mark": 0, "last": 0, "peak": 0, "count": 0}

    def _make_plan(self, unified: Optional[str]) -> Plan:
        auto = self.mode is Mode.AUTO
        layer = self.shape.bytes(self.shape.capacity)
        free = (free_device_memory(self.device, self._host), free_host_memory(self._host)) if auto else (None, None)
        figures = Figures(layers=self.expected, layer_bytes=layer, slots=self.depth + 1, slot_bytes=layer,
                          device_budget=self.config.device_budget, host_budget=self.config.host_budget,
                          pin_budget=pin_room(self.config.pin_budget, host_pins=self._host.pin is not None),
                          free_device=free[0], free_host=free[1], pinnable=self._res.allocator.pin,
                          unified=unified or same_pool_reason(self.device))
        plan = make_plan(self.mode, figures)
        log.info("KV offload [%s]: growing cache of %d layers x %d tokens, mode %s (%s)", self.name, self.expected,
                 self.shape.capacity, plan.mode.value, plan.reason)
        return plan

    # -- the consumer's calls ----------------------------------------------------------------------------------
    @engine_mode
    @one_consumer
    def view(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        """The working pair (B, S, H, D) of layer `key` on the device: tokens [0, committed(key)) are the layer's
        committed prefix; the consumer may write its current block after them. Valid until the next `view` of
        another layer (a slot is then reused); the next layers' prefixes are prefetched meanwhile."""
        self._check_open("view")
        if key not in self._where:
            self._open_layer(key)
        pair = self._ring.serve(key, self._resident)
        return pair if pair is not None else self._tiers[DEVICE].open_growing(key, self._new_pair)

    @engine_mode
    @one_consumer
    def commit(self, key: Hashable, start: int, end: int) -> None:
        """Tokens [start, end) of layer `key`'s working pair are final: kept in the layer's place from now on.

        `start` must be the layer's committed length, and the pair the one the last `view` returned for `key`."""
        self._check_open("commit")
        if key not in self._where or start != self._committed[key] or not start <= end <= self.shape.capacity:
            raise ValueError(f"GrowingKVStore.commit: layer {key!r} holds {self._committed.get(key)} committed tokens "
                             f"of {self.shape.capacity}; tokens [{start}, {end}) do not continue it. Commit each "
                             "block once, in order, from the layer's committed length.")
        if end == start:
            return
        if key in self._resident:
            k, v = self._tiers[DEVICE].open_growing(key, self._new_pair)
        else:
            current = self._ring.current
            if current is None or current.key != key:
                raise RuntimeError(f"GrowingKVStore.commit: layer {key!r} is not the layer last viewed; its block is "
                                   "only in the working pair until another layer is viewed. Commit right after writing.")
            k, v = current.k, current.v
        moving = self._moves(key, end - start)
        at = 0 if moving else start  # a layer that moves down takes its whole prefix to its new place
        k, v = k[:, at:end], v[:, at:end]
        packed = self._packing.active and key not in self._resident
        if packed:
            k, v = self._packing.pack(key, k, v)
        kept = self._keep(key, k, v, at, end, moving)
        if packed:
            self._packing.hold(kept, k, v)
        self._committed[key] = end
        self._ring.grown(key, end, kept)

    def _moves(self, key: Hashable, tokens: int) -> bool:
        """Whether `tokens` more of layer `key` would pass the RAM cap of the plan (the layer then moves to a file)."""
        cap = self.plan.host_cap
        return self._where[key] in HOST_PLACES and cap is not None and self._host_bytes() + self._kept(tokens) > cap

    def _keep(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, at: int, end: int, moving: bool):
        """Hands tokens [at, end) (`k`, `v`, as kept) to the layer's place, or with `moving` the whole prefix to a
        file; the fence after the copy out of `k`, `v`."""
        place = self._where[key]
        if moving:
            kept = self._res.tier(FILE).append(key, k, v, 0)
            self._tiers[place].drop_growing(key)
            self._where[key] = FILE
            self.moves.append(f"layer {key!r} {WORDS[place]} -> {WORDS[FILE]} at {end} tokens: "
                              f"{self.plan.why.get(place, 'host budget')} reached")
            log.info("KV offload [%s]: %s", self.name, self.moves[-1])
        else:
            kept = self._tiers[place].append(key, k, v, at)
        self.appended["count"] += 1
        self.appended["bytes"] += self.shape.bytes(end - self._committed[key])  # the cache's bytes, as committed
        return kept

    def _kept(self, tokens: int) -> int:
        """Bytes a streamed layer keeps for `tokens` tokens (packed with a codec)."""
        s = self.shape
        if not self._packing.active:
            return s.bytes(tokens)
        return 2 * s.batch * tokens * s.heads * packed_width(s.head_dim)

    def committed(self, key: Hashable) -> int:
        """Tokens of layer `key` committed so far (0 for a layer never viewed)."""
        return self._committed.get(key, 0)

    def step(self) -> None:
        """Marks the end of one forward (every layer viewed once): `stats()` reports the bytes it loaded."""
        moved = self._ring.moved - self._steps["mark"]
        self._steps.update(mark=self._ring.moved, last=moved, peak=max(self._steps["peak"], moved),
                           count=self._steps["count"] + 1)

    def _open_layer(self, key: Hashable) -> None:
        index = len(self._where)
        layer = self.shape.bytes(self.shape.capacity)
        place = self.plan.place_of(index, layer, len(self._resident) * layer, 0)
        if place == FILE and self.plan.stream in HOST_PLACES:
            place = self.plan.stream  # RAM is counted as it fills: a layer moves to a file when it no longer fits
        self._res.tier(place)
        if place == DEVICE:
            self._resident.add(key)
            self._stats.add_device(layer, layers=1)
        self._where[key], self._committed[key] = place, 0
        self._order.add(key)

    def _host_bytes(self) -> int:
        return sum(self._kept(self._committed[k]) for k, p in list(self._where.items()) if p in HOST_PLACES)

    def _load(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, release):
        return self._tiers[self._where[key]].load_prefix(key, k, v, release)

    def _new_pair(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return working_pair(self._res.streams, self.shape)

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"GrowingKVStore.{what}: store {self.name!r} is closed; create a new store per run.")

    # -- lifecycle and reporting -------------------------------------------------------------------------------
    @engine_mode
    def flush(self) -> None:
        """Waits until every committed block is in its place; raises the first error keeping one."""
        for tier in list(self._tiers.values()):
            tier.flush()

    @engine_mode
    def close(self) -> None:
        """Cancels queued loads, finishes the running ones, frees every buffer and deletes every file. Idempotent."""
        if not self._owner.here:
            self.closed = True
            return
        with self._busy:
            self.closed = True
            try:
                self._ring.cancel()
            finally:
                self._res.close(f" [{self.name}]")
                self._ring.drop()
                self._packing.clear()
                self._stats.emptied()

    def __enter__(self) -> "GrowingKVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def placement(self) -> Dict[str, int]:
        out = dict.fromkeys((DEVICE, *HOST_PLACES, FILE), 0)
        for place in list(self._where.values()):
            out[place] += 1
        return out

    @property
    def reason(self) -> str:
        said = self.plan.describe(self.placement(), self.shape.bytes(self.shape.capacity) * len(self._where))
        said = self._granted if said == "requested" else said
        return "; ".join([said, *self.moves[-3:], *self._res.notes])

    def stats(self) -> dict:
        """`KVStore.stats()`'s dict, and under "growing" what the cache holds and moves as it grows."""
        res = self._res
        stored, info = res.stored(self.closed)
        out = self._stats.as_dict(Snapshot(
            mode=self.mode.value, reason=self.reason, prefetch_depth=self.depth, closed=self.closed,
            layers=len(self._where), plan=self.placement(), stored=stored, info=info, seconds=res.seconds(),
            pinned_fallback=res.allocator.fallback_reason, kv_error=self._packing.compact.summary(), dedup={}))
        committed = sum(list(self._committed.values()))  # a copy: stats() may run on another thread
        out["growing"] = {
            "capacity_tokens": self.shape.capacity, "layers": self.expected,
            "tokens": max(list(self._committed.values()), default=0), "committed_bytes": self.shape.bytes(committed),
            "capacity_bytes": self.shape.bytes(self.shape.capacity) * self.expected,
            "appended": dict(self.appended), "step_bytes": self._steps["last"], "peak_step_bytes": self._steps["peak"],
            "steps": self._steps["count"], "moves": list(self.moves),
        }
        return out
