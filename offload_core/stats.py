"""Counters of one store and the host facts `auto` and the pin budget are decided from."""

from __future__ import annotations

import math
import numbers
import os
from typing import Dict, Optional

import psutil
import torch

from . import plan
from .config import HostServices

STATS_VERSION = 1


def host_figure(name: str, value) -> Optional[int]:
    """A byte count a `HostServices` callable returned, checked like an option: an int >= 0, or None (unknown).

    A finite real number >= 0 (a float, a NumPy integer) is accepted and truncated to whole bytes; NaN, inf, a
    negative number, a bool or anything else raises, naming the callable, the value and the fix, so a bad
    figure never becomes a plan (NaN compared False against every budget and put every layer on the device).
    """
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return int(value)
    raise ValueError(f"HostServices: `{name}` returned {value!r} ({type(value).__name__}); it must return a byte "
                     "count >= 0 (an int), or None when the figure is unknown. Fix that callable, or leave it None "
                     "so the engine queries the figure itself.")


def host_dir(value) -> str:
    """The directory `HostServices.temp_dir` returned, checked before a file place is made in it."""
    if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
        return os.fspath(value)
    raise ValueError(f"HostServices: `temp_dir` returned {value!r} ({type(value).__name__}); it must return the path of "
                     "an existing directory. Fix that callable, or leave it None for the system temp dir.")


def free_device_memory(device: torch.device, host: HostServices) -> Optional[int]:
    if host.free_device_memory is not None:
        return host_figure("free_device_memory", host.free_device_memory(device))
    if device.type == "cuda":
        # Memory torch's caching allocator holds but does not use is free for our tensors too; the driver's
        # figure alone would push a cache that fits off the device after the first request.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
    if device.type == "cpu":
        return free_host_memory(host)
    return None


def free_host_memory(host: HostServices) -> Optional[int]:
    if host.free_host_memory is not None:
        return host_figure("free_host_memory", host.free_host_memory())
    return int(psutil.virtual_memory().available)


class StoreStats:
    """Running counters of one store; `as_dict` turns them into the plain dict of `KVStore.stats()`."""

    def __init__(self) -> None:
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.resident_layers = 0
        self.peak_resident_layers = 0
        self.transfers = 0
        self.transfer_bytes = 0
        self.gets = 0
        self.misses = 0  # gets whose layer was not already loaded or in flight

    def add_device(self, nbytes: int, layers: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        if layers:
            self.set_resident(self.resident_layers + layers)

    def set_resident(self, layers: int) -> None:
        self.resident_layers = layers
        self.peak_resident_layers = max(self.peak_resident_layers, layers)

    def count_transfer(self, nbytes: int) -> None:
        self.transfers += 1
        self.transfer_bytes += nbytes

    def summary(self, streams) -> str:
        return (f"{self.transfers} loads, {self.transfer_bytes / 2**20:.1f} MiB, peak {self.peak_resident_layers} "
                f"layers / {self.peak_device_bytes / 2**20:.1f} MiB on the device, exposed wait "
                f"{streams.seconds['wait'] * 1000:.1f} ms")

    def as_dict(self, store, layers: int, tier_bytes: Dict[str, int], info: Dict[str, object], streams,
                fallback: Optional[str]) -> dict:
        places = {"device": 0, "host_pinned": 0, "host_pageable": 0, "file": 0}
        for place, n in tier_bytes.items():
            places[place] += n
        places["device"] = max(places["device"], self.device_bytes)
        seconds = streams.seconds if streams is not None else {"transfer": 0.0, "wait": 0.0}
        return {
            "v": STATS_VERSION,
            "name": store.name,
            "device": str(store.device),
            "requested": store.requested.value,
            "tier": store.mode.value if store.mode is not None else None,
            "reason": store.reason,
            "layers": layers,
            "bytes": places,
            "stored_bytes": dict(tier_bytes),  # what the places keep (no device slots; file staging included)
            "device_bytes": self.device_bytes,
            "peak_device_bytes": self.peak_device_bytes,
            "resident_layers": self.resident_layers,
            "peak_resident_layers": self.peak_resident_layers,
            "prefetch_depth": getattr(store, "depth", None),
            "transfers": {"count": self.transfers, "bytes": self.transfer_bytes, "seconds": seconds["transfer"]},
            "exposed_wait_s": seconds["wait"],
            "gets": self.gets,
            "misses": self.misses,
            "page_cache": info.get("page_cache"),
            "file_dir": info.get("file_dir"),
            "pinned_fallback": fallback is not None,
            "pinned_fallback_reason": fallback,
            "closed": store.closed,
            "plan": store.placement(),
            "storage": store.config.storage,
            "kv_error": store.kv_error(),
            "dedup": store.dedup.as_dict(),  # identical batch rows kept once (dedup.py)
        }
