"""The ring of `depth + 1` device slots that every streamed layer comes back through.

A slot holds one layer (its `key`) once a load into it is queued, with the load's `pending` and the `release`
fence of the last consumer kernels that read it. A load into a slot waits for that fence, so a copy never
overwrites data still being read; a slot whose load failed holds no key and is never served. The store
decides which layer goes where and when (`KVStore.get`); the ring owns the slots and their buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Set

import torch

from .devices import DONE, Streams
from .layout import LayerLayout
from .plan import FILE
from .stats import StoreStats
from .tiers import Pending, Tier


class Slot:
    __slots__ = ("buffer", "coded", "key", "pending", "release", "typed")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None  # the layer as served (the dtype put)
        self.typed: Dict[torch.dtype, torch.Tensor] = {}  # `buffer` viewed as each dtype served (layout.typed_views)
        self.coded: Optional[torch.Tensor] = None  # with a codec: the encoded bytes a tier copies in
        self.key: Optional[Hashable] = None
        self.pending = Pending()
        self.release = DONE


@dataclass
class Layers:
    """What the store knows of its layers, shared with the ring (read-only here)."""
    layouts: Dict[Hashable, LayerLayout]  # as put (the slot's dtype)
    kept: Dict[Hashable, LayerLayout]  # as stored (encoded, with a codec)
    where: Dict[Hashable, str]  # the place of each layer
    resident: Set[Hashable]  # kept on the device, served without a load
    coded: bool  # a codec decodes into the slot at `get`
    exact: Set[Hashable]  # with a codec: layers kept as put all the same (they hold NaN or inf)

    def decoded(self, key: Hashable) -> bool:
        """Layer `key` comes back encoded and is decoded into the slot."""
        return self.coded and key not in self.exact


class SlotRing:
    def __init__(self, count: int, streams: Streams, tiers: Dict[str, Tier], layers: Layers, stats: StoreStats,
                 device: torch.device):
        self._streams, self._tiers, self._layers, self._stats, self._device = streams, tiers, layers, stats, device
        self.slots: List[Slot] = [Slot() for _ in range(count)]  # buffers come at the first load
        self.current: Optional[Slot] = None  # the slot the consumer was last served from

    def holding(self, key: Hashable) -> Optional[Slot]:
        return next((s for s in self.slots if s.key == key), None)

    def spare(self, keep: Iterable[Hashable]) -> Optional[Slot]:
        """An empty slot, else one holding a prefetch no longer expected (skipped block, changed order).

        Reusing a slot with a load still in flight is safe: copies into it are queued first-in-first-out on
        one stream (and one I/O thread), and each waits for the slot's release fence.
        """
        keep = set(keep)
        empty = next((s for s in self.slots if s.key is None), None)
        return empty or next((s for s in self.slots if s.key not in keep), None)

    def prefetch(self, key: Hashable, ahead: List[Hashable]) -> None:
        """Loads the layers `ahead` of `key` that no slot holds, into slots not needed by `key` or them."""
        for nxt in ahead:
            if self.holding(nxt) is None:
                spare = self.spare({key, *ahead})
                if spare is None:
                    return
                self.load(nxt, spare)

    def release_current(self) -> None:
        if self.current is not None:
            # Kernels reading this slot are queued on the consumer's stream up to here; a copy into the slot
            # waits for this event, so it can never overwrite data still being read.
            self.current.release = self._streams.record()
            self.current.key = None
            self.current = None

    def load(self, key: Hashable, slot: Slot) -> Slot:
        layers = self._layers
        layout, kept = layers.layouts[key], layers.kept[key]
        decoded = layers.decoded(key)
        # Encoded bytes are copied into `slot.coded` (None: no such copy), even when there are none (no tokens).
        coded = kept.data_bytes if decoded and key not in layers.resident else None
        self._fit(slot, layout.data_bytes, coded)
        slot.key = None  # set only once the load is queued: a failed load must never be served
        if key in layers.resident:
            slot.pending = Pending()  # decoded at `get` straight from the resident bytes: nothing to copy
        else:
            target = slot.coded if decoded else slot.buffer
            slot.pending = self._tiers[layers.where[key]].load(key, target, slot.release)
            self._stats.count_transfer(kept.data_bytes)
        slot.key = key
        self._stats.set_resident(len(layers.resident) + sum(1 for s in self.slots if s.key is not None))
        return slot

    def _fit(self, slot: Slot, nbytes: int, coded: Optional[int]) -> None:
        small = slot.buffer is None or slot.buffer.numel() < nbytes
        small_coded = coded is not None and (slot.coded is None or slot.coded.numel() < coded)
        if not (small or small_coded):
            return
        slot.pending.settle()  # the old buffers may still be the target of a copy
        grown = 0
        if small:
            grown += nbytes - (slot.buffer.numel() if slot.buffer is not None else 0)
            slot.buffer = self._new_buffer(nbytes)
            slot.typed = {}  # views of the old buffer: never serve them
        if small_coded:
            grown += coded - (slot.coded.numel() if slot.coded is not None else 0)
            slot.coded = self._new_buffer(coded)
        # The caching allocator may hand out memory freed by kernels still queued on the consumer's stream;
        # a copy on the side stream must not start before they have run.
        slot.release = self._streams.record()
        self._stats.add_device(grown, layers=0)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        files = self._tiers.get(FILE)
        if files is not None and self._streams.immediate:  # a CPU slot the file tier's O_DIRECT reads fill in place
            return files.new_slot(nbytes, self._device)
        return self._streams.empty(nbytes)

    def cancel(self) -> None:
        """At close: loads still queued are cancelled (running ones finish); the slots stay until the tiers close."""
        try:
            for slot in self.slots:
                slot.pending.cancel()
        finally:
            self.current = None

    def empty(self, give_back: Callable[[torch.Tensor], None]) -> None:
        """Between requests: waits for every load, then drops every slot's buffers (`give_back` sees each first)."""
        self.release_current()
        for slot in self.slots:
            slot.pending.settle()
        self._streams.drain()
        for slot in self.slots:
            for buffer in (slot.buffer, slot.coded):
                if buffer is not None:
                    give_back(buffer)
        self.slots = [Slot() for _ in self.slots]

    def drop(self) -> None:
        """After close: no copy into a slot can be in flight any more."""
        self.slots = []
        self.current = None
