"""The serve path of a store: the learned layer order and the ring of `depth + 1` device slots.

A slot holds one layer (its `key`) once a load into it is queued, with the load's `pending` and the `release`
fence of the last consumer kernels that read it. A load into a slot waits for that fence, so a copy never
overwrites data still being read. A load or wait that fails breaks the store (`KVStore._fail`): nothing is
served after it. When the consumer
asks for layer i (`SlotRing.serve`), the slot of the layer it used before is released, layer i is waited for,
and the next `depth` streamed layers in the learned order are loaded into free slots (resident layers need no
load and are skipped, so a copy hides behind every resident layer before its use). What it serves is the
store's own memory: a consumer's write into it is caught at the next `serve`, which raises.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional, Set, Tuple

import torch

from ..host.devices import DONE, Streams
from .layers import Layers
from ..layout import TypedViews, typed_views, views
from ..places import DEVICE
from .stats import StoreStats
from ..tiers import Pending, Tier
from ..tiers.device import check_unmodified


class Slot:
    __slots__ = ("buffer", "coded", "key", "pending", "release", "typed")

    def __init__(self) -> None:
        self.buffer: Optional[torch.Tensor] = None  # the layer as served (the dtype put)
        self.typed: Optional[TypedViews] = None  # `buffer` viewed as each dtype served (layout.typed_views)
        self.coded: Optional[torch.Tensor] = None  # with a codec: the encoded bytes a tier copies in
        self.key: Optional[Hashable] = None
        self.pending = Pending()
        self.release = DONE


class LayerOrder:
    """The order in which layers are consumed: that of the `put`s, replaced by each full pass of `get`s that
    differs from it (a layer seen again starts a new pass), so skipped blocks or a double-then-single order are
    followed."""

    def __init__(self) -> None:
        self.order: List[Hashable] = []
        self._index: Dict[Hashable, int] = {}
        self._pass: List[Hashable] = []
        self._seen: set = set()

    def add(self, key: Hashable) -> None:
        self._index[key] = len(self.order)
        self.order.append(key)

    def observe(self, key: Hashable) -> None:
        if self._pass and self._pass[-1] == key:
            return  # the same layer asked for again is not a new pass
        if key in self._seen:
            if self._pass != self.order and self._pass:
                self.order = list(self._pass)
                self._index = {k: i for i, k in enumerate(self.order)}
            self._pass, self._seen = [], set()
        self._pass.append(key)
        self._seen.add(key)

    def ahead(self, key: Hashable, n: int, skip: Set[Hashable]) -> List[Hashable]:
        """Up to `n` layers expected after `key`, wrapping into the next step, never `key` itself, passing over
        those in `skip` (resident ones), so the next streamed layer's copy starts as early as possible."""
        i = self._index.get(key)
        count, out = len(self.order), []
        for j in range(1, count if i is not None and n > 0 else 0):
            nxt = self.order[(i + j) % count]
            if nxt not in skip:
                out.append(nxt)
                if len(out) == n:
                    break
        return out


class SlotRing:
    def __init__(self, depth: int, streams: Streams, tiers: Dict[str, Tier], layers: Layers, order: LayerOrder,
                 stats: StoreStats):
        self._streams, self._tiers, self._layers, self._stats = streams, tiers, layers, stats
        self._depth, self._order = depth, order
        self.slots: List[Slot] = [Slot() for _ in range(depth + 1)]  # buffers come at the first load
        self.current: Optional[Slot] = None  # the slot the consumer was last served from
        self._served: Optional[tuple] = None  # (key, k, v, version) of the last serve: read-only to the consumer

    def serve(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer `key` on the device, as put: the resident tensors, or views of the slot holding it."""
        self._check_served()
        self._stats.count_get()
        layers = self._layers
        expands = layers.compact.coded(key) or key in layers.rows  # decoded or broadcast into a slot
        if key in layers.resident and not expands:
            if len(layers.resident) < len(layers.layouts):  # else nothing streams: nothing to schedule
                self._schedule(key, direct=True)
            k, v = self._tiers[DEVICE].view(key)
        else:
            if self.current is None or self.current.key != key:  # else the same layer again: nothing moves
                slot = self._schedule(key)
                if expands:
                    self._expand(key, slot)
                self.current = slot
            k, v = typed_views(self.current.typed, layers.layouts[key])
        self._served = (key, k, v, k._version + v._version)
        return k, v

    def _check_served(self) -> None:
        # Views of one slot share its version counter, and the device tier's tensors have one too, so an
        # in-place write by the consumer is seen here the same way on every tier.
        served, self._served = self._served, None
        if served is not None and served[1]._version + served[2]._version != served[3]:
            self.release_current()  # an offloaded tier reloads the layer clean next time
            check_unmodified(served[0], served[1]._version + served[2]._version, served[3])

    def _schedule(self, key: Hashable, direct: bool = False) -> Optional[Slot]:
        """Releases the slot served before, waits for layer `key` (unless `direct`: resident, served as kept) and
        queues the loads of the layers ahead of it."""
        self._order.observe(key)
        self.release_current()
        # Timed on the consumer's stream: a copy made there (sync modes) or a wait for a late prefetch is time
        # the consumer is stalled; copies queued on the side stream are not.
        with self._streams.timed("wait"):
            ahead = self._order.ahead(key, self._depth, skip=self._layers.resident)
            slot = None if direct else self.holding(key)
            if slot is None and not direct:  # not prefetched: the consumer waits for the whole load
                if key not in self._layers.resident:
                    self._stats.count_miss()
                slot = self.load(key, self.free_slot(keep=ahead))
            self.prefetch(key, ahead)  # the next streamed layers' copies hide behind this layer's compute
            if slot is not None:
                slot.pending.wait(self._streams.consumer())
        return slot

    def _expand(self, key: Hashable, slot: Slot) -> None:
        """Writes layer `key` as served into `slot` from the layer as kept: decoded by the codec when there is one,
        broadcast from one row when it is kept as one (`dedup.served_layout`).

        On the consumer's stream, which `pending.wait` ordered after the copy into the slot (its `coded` staging
        with a codec); the slot's next load waits for the release fence recorded after this and the kernels
        reading its output. A streamed row without a codec lies in the slot itself: V's row inside K's rows 1..,
        K's row where row 0 goes; so V goes first, and K's row is broadcast to rows 1.. only."""
        layers = self._layers
        codec = layers.compact.codec if layers.compact.coded(key) else None
        rows = layers.rows.get(key, 1)
        if key in layers.resident:
            source = self._tiers[DEVICE].view(key)
        else:
            source = views(slot.coded if codec is not None else slot.buffer, layers.kept[key])
        for src, out in zip(reversed(source), reversed(views(slot.buffer, layers.layouts[key]))):
            if codec is not None:
                first = out[:1] if rows > 1 else out
                codec.decode(src, first)
            elif src.data_ptr() == out.data_ptr():  # K's row, already in place as row 0
                first = out[:1]
            else:
                self._streams.copy(out, src.expand_as(out))
                continue
            if rows > 1:
                self._streams.copy(out[1:], first.expand_as(out[1:]))

    def holding(self, key: Hashable) -> Optional[Slot]:
        return next((s for s in self.slots if s.key == key), None)

    def free_slot(self, keep: Iterable[Hashable]) -> Optional[Slot]:
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
                free = self.free_slot({key, *ahead})
                if free is None:
                    return
                self.load(nxt, free)

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
        decoded = layers.compact.coded(key)
        # Encoded bytes are copied into `slot.coded` (None: no such copy), even when there are none (no tokens).
        coded = kept.data_bytes if decoded and key not in layers.resident else None
        self._fit(slot, layout.data_bytes, coded)
        if key in layers.resident:
            slot.pending = Pending()  # decoded at `get` straight from the resident bytes: nothing to copy
        else:
            target = slot.coded if decoded else slot.buffer
            slot.pending = self._tiers[layers.where[key]].load(key, target, slot.release)
            self._stats.count_transfer(kept.data_bytes)
        slot.key = key
        self._stats.set_on_device(len(layers.resident | {s.key for s in self.slots if s.key is not None}))
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
            slot.typed = TypedViews(slot.buffer)  # views of the old buffer: never served again
        if small_coded:
            grown += coded - (slot.coded.numel() if slot.coded is not None else 0)
            slot.coded = self._new_buffer(coded)
        # The caching allocator may hand out memory freed by kernels still queued on the consumer's stream;
        # a copy on the side stream must not start before they have run.
        slot.release = self._streams.record()
        self._stats.add_device(grown, layers=0)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        """A slot buffer, made by a tier that wants to make the slots it reads into (`Tier.own_slots`: e.g.
        page-aligned for the file tier's `O_DIRECT` reads on a CPU) if one is open, else by any open tier."""
        tiers = list(self._tiers.values())
        return next((t for t in tiers if t.own_slots), tiers[0]).new_slot(nbytes, self._streams)

    def cancel(self) -> None:
        """At close: loads still queued are cancelled (running ones finish); the slots stay until the tiers close."""
        self._served = None
        for slot in self.slots:  # a Ctrl-C here leaves the rest to the next close(), which cancels again
            slot.pending.cancel()
        self.current = None

    def empty(self) -> None:
        """Between requests: waits for every load, then drops every slot's buffers, each given back to the tiers
        first (`Tier.release_slot`: the one that made it frees it now)."""
        self._served = None
        self.release_current()
        for slot in self.slots:
            slot.pending.settle()
        self._streams.drain()
        # The ring lets go of the slots before any is freed: a Ctrl-C among the frees leaves it with new empty
        # slots, never with one whose memory is gone (the rest stay with the tier that made them until it closes).
        old, self.slots = self.slots, [Slot() for _ in self.slots]
        for slot in old:
            for buffer in (slot.buffer, slot.coded):
                for tier in (list(self._tiers.values()) if buffer is not None else ()):
                    tier.release_slot(buffer)

    def drop(self) -> None:
        """After close: no copy into a slot can be in flight any more."""
        self.slots = []
        self.current = None
