"""The serve path of a growing store: `depth + 1` device slots, each a working pair (B, S, H, D) at full capacity.

A slot holds one streamed layer's committed prefix (`key`, `tokens`) once its load is queued; the consumer reads
the prefix and writes its current block after it, in place, as it would in its own cache. When layer i is asked
for, the slot served before is released (a fence after the kernels that used it), layer i's prefix is waited
for (loaded now if no prefetch holds it at its current length) and the prefixes of the next `depth` streamed
layers in the learned order are loaded into free slots, behind this layer's compute. A load into a slot waits
for the slot's release fence, so it never overwrites what the consumer still reads.
"""

from __future__ import annotations

from typing import Callable, Hashable, List, Optional, Set, Tuple

import torch

from ..host.devices import DONE, Fence, Streams
from ..store.ring import LayerOrder
from ..store.stats import StoreStats
from ..tiers import Pending


class PrefixSlot:
    __slots__ = ("k", "v", "pk", "pv", "packed", "key", "tokens", "pending", "release", "kept")

    def __init__(self) -> None:
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.pk: Optional[torch.Tensor] = None  # with a codec: the packed prefix a tier loads, unpacked into k, v
        self.pv: Optional[torch.Tensor] = None
        self.packed = False  # the prefix is in pk, pv and not yet unpacked
        self.key: Optional[Hashable] = None
        self.tokens = 0
        self.pending = Pending()
        self.release = DONE
        self.kept = DONE  # after the last copy out of the slot (a committed block): the consumer writes after it


class PrefixRing:
    """Slots for the streamed layers of one growing store.

    load(key, k, v, release) -> Pending queues layer `key`'s committed prefix into `k`, `v` (the slot's first
    tokens); committed(key) -> its committed tokens now; new_pair() -> a fresh working pair on the device;
    packing: with a codec (`packing.Packing`), prefixes load packed and are unpacked when served.
    """

    def __init__(self, depth: int, streams: Streams, order: LayerOrder, stats: StoreStats,
                 load: Callable[..., Pending], committed: Callable[[Hashable], int],
                 new_pair: Callable[[], Tuple[torch.Tensor, torch.Tensor]], packing=None):
        self._depth, self._streams, self._order, self._stats = depth, streams, order, stats
        self._load, self._committed, self._new_pair = load, committed, new_pair
        self._packing = packing if packing is not None and packing.active else None
        self.slots: List[PrefixSlot] = [PrefixSlot() for _ in range(depth + 1)]
        self.current: Optional[PrefixSlot] = None
        self.moved = 0  # bytes loaded into slots so far

    def serve(self, key: Hashable, resident: Set[Hashable]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The working pair of layer `key` (None for a resident one, whose pair is its own), its prefix in place."""
        self._order.observe(key)
        if self.current is not None and self.current.key == key:
            return self.current.k, self.current.v  # the same layer again within its forward: nothing moves
        self.release_current()
        with self._streams.timed("wait"):
            ahead = self._order.ahead(key, self._depth, skip=resident)
            slot = None
            if key not in resident:
                slot = self._holding(key)
                if slot is None:
                    self._stats.count_miss()
                    slot = self._fill(key, self._free_slot(keep=ahead))
            for nxt in ahead:  # the next streamed prefixes load behind this layer's compute
                if self._holding(nxt) is None:
                    free = self._free_slot({key, *ahead})
                    if free is None:
                        break
                    self._fill(nxt, free)
            if slot is None:
                return None
            try:
                # The block last committed from this slot may still be on its way out on the side stream: the
                # consumer's kernels that write into the slot from now on must not overtake that copy.
                slot.kept.make_wait(self._streams.consumer())
                slot.pending.wait(self._streams.consumer())
                if slot.packed:  # on the consumer's stream, after the load; the slot's release fence follows it
                    t = slot.tokens
                    self._packing.unpack(slot.pk[:, :t], slot.pv[:, :t], slot.k[:, :t], slot.v[:, :t])
                    slot.packed = False
            except BaseException:
                slot.key = None  # what it holds is unknown now: never served
                raise
        self.current = slot
        return slot.k, slot.v

    def grown(self, key: Hashable, tokens: int, kept: Fence) -> None:
        """The consumer's working pair of `key` now holds `tokens` committed tokens (it wrote the block in place),
        copied out to the layer's place up to `kept`."""
        if self.current is not None and self.current.key == key:
            self.current.tokens, self.current.kept = tokens, kept

    def _holding(self, key: Hashable) -> Optional[PrefixSlot]:
        tokens = self._committed(key)
        return next((s for s in self.slots if s.key == key and s.tokens == tokens), None)

    def _free_slot(self, keep) -> Optional[PrefixSlot]:
        """An empty slot, else one holding a prefetch no longer expected (or a prefix that has grown since)."""
        keep = set(keep)
        empty = next((s for s in self.slots if s.key is None), None)
        return empty or next((s for s in self.slots if s.key not in keep or s.tokens != self._committed(s.key)), None)

    def _fill(self, key: Hashable, slot: PrefixSlot) -> PrefixSlot:
        if slot.k is None:
            slot.k, slot.v = self._new_pair()
            if self._packing is not None:
                slot.pk, slot.pv = self._packing.packed_pair(self._streams, tuple(slot.k.shape))
            # The allocator may hand out memory that kernels still queued on the consumer's stream use.
            slot.release = self._streams.record()
            self._stats.add_device(sum(t.numel() * t.element_size() for t in (slot.k, slot.v, slot.pk, slot.pv)
                                       if t is not None), layers=0)
        slot.pending.settle()  # a load still queued into it (a dropped prefetch) ends first
        slot.key = None  # set once the load is queued: a failed load is never served
        tokens = self._committed(key)
        k, v = (slot.pk, slot.pv) if self._packing is not None else (slot.k, slot.v)
        slot.pending = self._load(key, k[:, :tokens], v[:, :tokens], slot.release) if tokens else Pending()
        slot.packed = self._packing is not None and tokens > 0
        if tokens:
            nbytes = 2 * k[:, :tokens].numel() * k.element_size()
            self.moved += nbytes
            self._stats.count_transfer(nbytes)
        slot.key, slot.tokens = key, tokens
        return slot

    def release_current(self) -> None:
        if self.current is not None:
            # Kernels reading or writing this slot are queued on the consumer's stream up to here; a load into the
            # slot waits for this fence.
            self.current.release = self._streams.record()
            self.current = None

    def on_device(self) -> int:
        return sum(1 for s in self.slots if s.key is not None)

    def cancel(self) -> None:
        """At close: queued loads cancelled (running ones finish; the tiers' close waits for them)."""
        for slot in self.slots:  # a Ctrl-C here leaves the rest to the next close(), which cancels again
            slot.pending.cancel()
        self.current = None

    def drop(self) -> None:
        self.slots, self.current = [], None
