"""The counters of one store, and the plain dict `KVStore.stats()` turns them into."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from ..places import DEVICE, PLACES, MiB

STATS_VERSION = 1


@dataclass(frozen=True)
class Snapshot:
    """What a store holds and decided right now, as plain values (`KVStore.stats` makes one per call)."""
    mode: Optional[str]  # the mode in effect (None: `auto` before the first put)
    reason: str
    prefetch_depth: int
    closed: bool
    layers: int
    plan: Dict[str, int]  # layers put, per place
    stored: Dict[str, int]  # bytes the places keep (no device slots; file staging included)
    info: Dict[str, object]  # what the tiers add (page-cache mode, file directory)
    seconds: Dict[str, float]  # "transfer" and "wait"
    pinned_fallback: Optional[str]  # why pinned memory fell back to pageable (None: it did not)
    kv_error: Optional[Dict[str, object]]
    dedup: Dict[str, object]


class StoreStats:
    """Running counters of one store (updated only through the methods here); `as_dict` words them."""

    def __init__(self, name: str, device: str, requested: str, storage: str) -> None:
        self._facts = {"name": name, "device": device, "requested": requested}
        self.storage = storage
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.resident_layers = 0  # kept on the device for the store's lifetime (docs/glossary.md: resident)
        self.peak_resident_layers = 0
        self.on_device_layers = 0  # the resident layers and those the ring's slots hold now
        self.peak_on_device_layers = 0
        self.transfers = 0
        self.transfer_bytes = 0
        self.gets = 0
        self.misses = 0  # gets whose layer was not already loaded or in flight

    def add_device(self, nbytes: int, layers: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        if layers:
            self.resident_layers += layers
            self.peak_resident_layers = max(self.peak_resident_layers, self.resident_layers)
            self.set_on_device(self.on_device_layers + layers)

    def set_on_device(self, layers: int) -> None:
        """`layers` distinct layers are on the device now: the resident ones and those in the ring's slots."""
        self.on_device_layers = layers
        self.peak_on_device_layers = max(self.peak_on_device_layers, layers)

    def parked(self, device_bytes: int, layers: int) -> None:
        """The ring's slots are gone: what stays on the device is the resident layers."""
        self.device_bytes = device_bytes
        self.set_on_device(layers)

    def emptied(self) -> None:
        """The store closed: nothing of it is on the device any more."""
        self.device_bytes = 0
        self.resident_layers = self.on_device_layers = 0

    def count_transfer(self, nbytes: int) -> None:
        self.transfers += 1
        self.transfer_bytes += nbytes

    def count_get(self) -> None:
        self.gets += 1

    def count_miss(self) -> None:
        self.misses += 1

    def summary(self, seconds: Dict[str, float]) -> str:
        return (f"{self.transfers} loads, {self.transfer_bytes / MiB:.1f} MiB, peak {self.peak_on_device_layers} "
                f"layers / {self.peak_device_bytes / MiB:.1f} MiB on the device, exposed wait "
                f"{seconds['wait'] * 1000:.1f} ms")

    def as_dict(self, now: Snapshot) -> dict:
        places = dict.fromkeys(PLACES, 0)
        for place, n in now.stored.items():
            places[place] += n
        places[DEVICE] = max(places[DEVICE], self.device_bytes)
        return {
            "v": STATS_VERSION,
            **self._facts,
            "mode": now.mode,  # the mode in effect
            "tier": now.mode,  # deprecated alias of "mode", kept for one release
            "reason": now.reason,
            "layers": now.layers,
            "bytes": places,
            "stored_bytes": dict(now.stored),
            "device_bytes": self.device_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "resident_layers": self.resident_layers,
            "peak_resident_layers": self.peak_resident_layers,
            "layers_on_device": self.on_device_layers,  # resident plus those in slots now
            "peak_layers_on_device": self.peak_on_device_layers,
            "prefetch_depth": now.prefetch_depth,
            "transfers": {"count": self.transfers, "bytes": self.transfer_bytes, "seconds": now.seconds["transfer"]},
            "exposed_wait_s": now.seconds["wait"],
            "gets": self.gets,
            "misses": self.misses,
            "page_cache": now.info.get("page_cache"),
            "file_dir": now.info.get("file_dir"),
            "file_io": now.info.get("file_io"),  # the file tiers' request size and requests in flight, and why
            "pinned_fallback": now.pinned_fallback is not None,
            "pinned_fallback_reason": now.pinned_fallback,
            "closed": now.closed,
            "plan": now.plan,
            "storage": self.storage,
            "kv_error": now.kv_error,
            "dedup": now.dedup,  # identical batch rows kept once (dedup.py)
        }
