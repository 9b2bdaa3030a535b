"""Opening a run's stores: which store is built, the host services it plans against, how the readout learns of it.

A store plans its places at its first put, against the free RAM its host services report. Under multi-GPU
sampling the stores of several devices share the host's RAM, so a new store sees the free RAM less what the run's
other stores planned to keep there and have not filled yet (`host_beside`), and the stores plan one at a time
(`StoreOpener.planning`): two devices never book the same free RAM.

No ComfyUI import.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Optional

from ...offload_core.places import HOST_PLACES
from ...offload_core.store.kvstore import KVStore
from ..readout.protocol import Readout

log = logging.getLogger(__name__)


def ram_to_fill(store) -> int:
    """Bytes of RAM `store` planned to keep and does not hold yet (0 for a store without a plan, or closed)."""
    plan = getattr(store, "plan", None)
    if plan is None or getattr(store, "closed", True):
        return 0
    counts = plan.counts()
    planned = sum(counts[p] for p in HOST_PLACES) * plan.layer_bytes
    try:  # its own thread may be closing it right now (an interrupt): then count it as not filled
        held = sum(store.stats()["bytes"].get(p) or 0 for p in HOST_PLACES)
    except Exception:  # noqa: BLE001 - a store read from another thread; planning must go on
        held = 0
    return max(0, planned - held)


def host_beside(host, others: Callable[[], Iterable]):
    """`host` as a new store sharing the host's RAM with `others()` sees it: its free RAM leaves out
    `ram_to_fill` of each of them, read each time the store asks (another device's store may be filling right now).
    `host` itself when it reports no free RAM (None, or no `free_host_memory`)."""
    free = getattr(host, "free_host_memory", None)
    if not callable(free):
        return host

    def free_beside_others() -> Optional[int]:
        total = free()
        if total is None:
            return None
        return max(0, total - sum(ram_to_fill(s) for s in others()))

    return dataclasses.replace(host, free_host_memory=free_beside_others)


@dataclasses.dataclass(frozen=True, eq=False)
class StoreOpener:
    """Opens the stores of one run and shows each in its readout.

    host: the run's `HostServices` (or None). telemetry: the run's readout, wrapped by `safe` (`nodes/readout/protocol.py`).
    factory: builds one store with `KVStore`'s signature (None: `KVStore`); tests pass a stand-in. The config is
    not held here but given at each open: a family may change the run's config once the run began (Wan Animate 2).
    """

    host: Any
    telemetry: Readout
    factory: Optional[Callable] = None
    _warned: set = dataclasses.field(default_factory=set, init=False, repr=False)  # (asked, in effect) said once
    _planning: Any = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    def open(self, name: str, config, device, expected_bytes: int, *, requested,
             others: Optional[Callable[[], Iterable]] = None):
        """A new store of `config` on `device`, expecting `expected_bytes`, shown in the readout as `name`.

        requested: the mode the run was asked for (`track`). others: under multi-GPU sampling, gives the run's
        other stores, whose RAM still to fill the free RAM this one plans against leaves out (`host_beside`); None
        on one device."""
        host = self.host if others is None else host_beside(self.host, others)
        store = (self.factory or KVStore)(config, device, host=host, expected_bytes=expected_bytes, name=name)
        self.track(name, store, requested)
        return store

    def track(self, name: str, store, requested) -> None:
        """Show `store` in the readout as `name`; warn once per run and pair of modes if it runs in another mode
        than `requested` (`auto` chooses, so it never warns)."""
        in_effect = getattr(store, "mode", None)  # a stand-in store of a test may not say
        if requested is not None and in_effect is not None and in_effect != requested and str(requested) != "auto":
            key = (str(requested), str(in_effect))
            if key not in self._warned:
                self._warned.add(key)
                log.warning("KV Offload: mode %s runs as %s: %s", requested, in_effect, getattr(store, "reason", ""))
        self.telemetry.track(name, store)

    def planning(self, shared: bool):
        """The context of a store's first put, where it plans its places: with `shared` (multi-GPU sampling, the
        devices' threads share the host's RAM) one store of the run at a time, each against the RAM the others
        booked (`open`'s `others`); else no lock."""
        return self._planning if shared else nullcontext()
