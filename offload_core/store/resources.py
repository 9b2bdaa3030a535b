"""What an open store runs on: its streams, host allocators, the tiers of its places and the ring of slots.

Made when the store's mode is known (at construction, or at the first put for `auto`); each tier opens at the
first layer placed in its place (a plan with no file layer creates no directory). `close` frees them in the one
order that frees nothing still in use: queued loads cancelled, background work finished, tiers closed, device
slots last.
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, List, Tuple

import torch

from ..config import HostServices, OffloadConfig
from ..host.devices import open_streams
from .checks import Owner
from .hostfacts import host_dir
from ..host.hostmem import HostAllocator
from .layers import Layers
from .ring import LayerOrder, SlotRing
from .stats import StoreStats
from ..tiers import Tier, TierContext
from ..tiers.registry import PlaceOptions, close_tiers, open_tier

log = logging.getLogger(__name__)


def _close_in_owner(owner: Owner, tiers: Dict[str, Tier], streams) -> None:
    """The safety net of a store dropped unclosed, or whose close did not finish: run by the garbage collector or
    at exit, where an error has nobody to reach but the log."""
    if owner.here:
        try:
            close_tiers(tiers, streams)
        except BaseException as exc:
            log.warning("KV offload: closing a store that was dropped unclosed failed: %s: %s", type(exc).__name__, exc)


class StoreResources:
    def __init__(self, store: object, owner: Owner, config: OffloadConfig, host: HostServices, device: torch.device,
                 asynchronous: bool, layers: Layers, order: LayerOrder, stats: StoreStats):
        self._config, self._host, self._stats = config, host, stats
        self.depth = config.depth if asynchronous else 0
        self.streams = open_streams(device, asynchronous, host.stream)
        # Pinned memory only pays where copies are asynchronous (async modes on CUDA). One pinned-memory budget
        # per process (the host's, else the engine's) is shared by every store; `pin_budget` caps this one inside it.
        self.allocator = HostAllocator(self.streams.asynchronous, config.pin_budget, host.pin, host.unpin)
        self.pageable = HostAllocator(False, 0)
        self.tiers: Dict[str, Tier] = {}  # place -> its tier, opened at the first layer stored there
        self.notes: List[str] = []  # what the tiers add (e.g. files on a RAM-backed filesystem)
        self._ctx = TierContext(device, self.streams, self.allocator, self.depth)
        self.ring = SlotRing(self.depth, self.streams, self.tiers, layers, order, stats)
        # A safety net for stores dropped without close(): files and pinned pages still go away. It holds the
        # dict itself, so tiers opened later are closed too; in a forked child (garbage collection, interpreter
        # exit) it does nothing: the files and buffers are the parent's.
        self._finalizer = weakref.finalize(store, _close_in_owner, owner, self.tiers, self.streams)
        self.closed = False

    def tier(self, place: str) -> Tier:
        """The tier of `place`, opened at the first layer placed there."""
        tier = self.tiers.get(place)
        if tier is None:
            host = self._host
            parent = self._config.file_dir or (host_dir(host.temp_dir()) if host.temp_dir else None)
            opts = PlaceOptions(self.pageable, parent, self._config.bypass, asynchronous=self.depth > 0)
            tier = self.tiers[place] = open_tier(place, self._ctx, opts)
            if tier.note:  # e.g. files on a RAM-backed filesystem: the stats say why this place saves no RAM
                self.notes.append(tier.note)
        return tier

    def stored(self, closed: bool) -> Tuple[Dict[str, int], Dict[str, object]]:
        """Bytes the tiers keep, by place (none once closed), and what they add to the stats."""
        stored: Dict[str, int] = {}
        info: Dict[str, object] = {}
        for tier in list(self.tiers.values()):
            if not closed:
                for place, n in tier.nbytes().items():
                    stored[place] = stored.get(place, 0) + n
            info.update(tier.info())
        return stored, info

    def seconds(self) -> Dict[str, float]:
        """Transfer and exposed-wait seconds measured so far (the events that finished are read, none waited for)."""
        self.streams.resolve(block=False)
        return dict(self.streams.seconds)

    def seal(self) -> None:
        for tier in list(self.tiers.values()):
            tier.seal()  # every layer in place (on disk, and counted there), the write staging freed

    def close(self, tag: str) -> None:
        """Frees everything; a no-op once done. Every step takes a repeat, and the safety net stays armed until
        the tiers have closed, so a close that Ctrl-C stopped at any line is finished by the next call."""
        if self.closed:
            return
        try:
            self.ring.cancel()
        finally:
            close_tiers(self.tiers, self.streams)  # background work finished, then buffers freed and files deleted
            self._finalizer.detach()
            self.streams.resolve(block=True)
            self.ring.drop()  # device slots go last: no copy into them can be in flight any more
            self.closed = True
            log.info("KV offload%s: closed; %s", tag, self._stats.summary(self.streams.seconds))
