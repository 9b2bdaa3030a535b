"""What the readout shows, as plain data: JSON-safe values, each store's `stats()` as the page shows it, totals.

A store is held weakly (a run that drops it must free it); its last figures are kept, so a store closed and
collected before the run's final push still shows what it held and moved. No ComfyUI import.
"""

from __future__ import annotations

import enum
import logging
import math
import weakref
from typing import Any, Callable, Optional

from ...offload_core.places import PLACES

log = logging.getLogger(__name__)

# Never published: any client of the server gets the payload, and a cache path would tell it where K/V of
# another user's images lies on disk. `on_disk` (bool) says whether a store has files.
PRIVATE_KEYS = ("file_dir",)


def to_json(value: Any) -> Any:
    """Plain JSON types only: enums to their value, tuples to lists, NaN/inf to None (JSON.parse rejects NaN)."""
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v) for v in value]
    return str(value)


def _ratio(num: Any, den: Any) -> Optional[float]:
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or den <= 0:
        return None
    return num / den


def _sum_known(values: list) -> Optional[float]:
    known = [v for v in values if isinstance(v, (int, float))]
    return sum(known) if known else None


def derive_store(stats: dict) -> dict:
    """A store's `stats()` plus the rates the readout shows.

    bandwidth = transfer bytes / transfer seconds (None before the first timed transfer);
    bytes_while_open = the store's `bytes` when it was last seen open (a closed store holds nothing);
    passes = gets / layers (how many times the store has served its whole prefix: one per cached step of
    its branch); exposed wait per pass = exposed_wait_s / passes.
    """
    out = {k: v for k, v in stats.items() if k not in PRIVATE_KEYS}
    out["on_disk"] = bool(stats.get("file_dir"))
    out.setdefault("bytes_while_open", None)
    transfers = stats.get("transfers") or {}
    out["bandwidth_bytes_per_s"] = _ratio(transfers.get("bytes"), transfers.get("seconds"))
    passes = _ratio(stats.get("gets"), stats.get("layers"))
    out["passes"] = passes
    out["exposed_wait_per_pass_s"] = _ratio(stats.get("exposed_wait_s"), passes) if passes else None
    out["scope"] = "process"
    return out


def totals(stores: list, forwards: int) -> dict:
    """Bytes per place and waits summed over the stores (None where no store knows the figure)."""
    wait = _sum_known([s.get("exposed_wait_s") for s in stores])
    return {
        "stores": len(stores),
        "bytes": {place: _sum_known([(s.get("bytes") or {}).get(place) for s in stores]) for place in PLACES},
        "device_bytes": _sum_known([s.get("device_bytes") for s in stores]),
        "exposed_wait_s": wait,
        "exposed_wait_per_forward_s": _ratio(wait, forwards) if wait is not None else None,
    }


def per_device(stores: list, memory: Callable[[str], Optional[dict]]) -> list:
    """One entry per device the stores serve, in order of first appearance: the device, its memory figures
    (`memory(device)`: a `memory_snapshot`, None if unknown), its stores' names, bytes per place and waits.

    Under ComfyUI's multi-GPU sampling each device's thread has its own stores; on one device the list has one
    entry."""
    out: dict = {}
    for s in stores:
        device = s.get("device")
        if device:
            out.setdefault(str(device), []).append(s)
    entries = []
    for device, mine in out.items():
        snap = memory(device) or {}
        sums = totals(mine, 0)
        entries.append({"device": device, "memory": {"process": snap.get("process"), "device": snap.get("device")},
                        "stores": [s.get("name") for s in mine], "bytes": sums["bytes"],
                        "device_bytes": sums["device_bytes"], "exposed_wait_s": sums["exposed_wait_s"]})
    return entries


def store_order(name: str) -> tuple:
    """Sort key of store names: "cond", "cond 2", ..., then "uncond", "uncond 2", ..., then any other."""
    base, _, number = str(name).partition(" ")
    rank = {"cond": 0, "uncond": 1}.get(base, 2)
    return rank, base, int(number) if number.isdigit() else 1, str(name)


class StoreFigures:
    """The stores of one run by readout name, and the figures each last reported. Not thread-safe: the hub
    calls it under its lock."""

    def __init__(self) -> None:
        self._stores: dict = {}  # name -> weakref (or strong ref when the object refuses weakrefs)
        self._last: dict = {}  # name -> last stats() seen, kept when the store object is gone
        self._failed: set = set()  # names whose stats() raised, warned about once

    def __bool__(self) -> bool:
        return bool(self._stores)

    def track(self, name: str, store: Any) -> None:
        try:
            ref = weakref.ref(store)
        except TypeError:
            ref = lambda s=store: s  # noqa: E731 - dropped at run end like the weak ones
        self._stores[str(name)] = ref

    def clear(self) -> None:
        self._stores.clear()
        self._last.clear()
        self._failed.clear()

    def refresh(self) -> None:
        """Read every store's figures now: a store may be closed and gone before the next push."""
        for name, ref in self._stores.items():
            self._stats(name, ref)

    def collect(self) -> list:
        """Every store's derived figures, cond before uncond."""
        named = sorted(self._stores.items(), key=lambda item: store_order(item[0]))
        return [derive_store(stats) for stats in (self._stats(n, r) for n, r in named) if stats is not None]

    def _stats(self, name: str, ref) -> Optional[dict]:
        """Fresh stats of a live store; for a store already gone, its last stats marked closed."""
        previous = self._last.get(name)
        store = ref()
        if store is None:
            if previous is None or previous.get("closed"):
                return previous
            stats = dict(previous, closed=True, bytes={place: None for place in PLACES}, device_bytes=None)
        else:
            stats = self._read(name, store)
            if stats is None:
                return previous
        if stats.get("closed"):  # a closed store holds nothing: keep what it held while open, for the readout
            before = previous or {}
            stats["bytes_while_open"] = before.get("bytes_while_open") or (None if before.get("closed")
                                                                             else before.get("bytes"))
        self._last[name] = stats
        return stats

    def _read(self, name: str, store) -> Optional[dict]:
        # A store closed by another thread mid-call may raise anything its tiers raise; the readout runs inside
        # sampling and must not end it, so the store keeps its last figures and the failure is logged once.
        try:
            stats = dict(store.stats())
        except Exception:
            if name not in self._failed:
                self._failed.add(name)
                log.warning("KV Offload: the readout could not read KV store %r; it shows its last figures", name,
                            exc_info=True)
            return None
        stats.setdefault("name", name)
        return stats
