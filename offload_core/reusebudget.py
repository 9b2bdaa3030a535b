"""Byte budgets of the prefix registry (`reuse.py`): per place, parsed once, and what a store holds where."""

from __future__ import annotations

import shutil
from typing import Dict, Mapping, Optional, Union

import psutil

PLACES = ("device", "host", "file")  # host: pinned + pageable RAM
BudgetSpec = Union[None, int, Mapping[str, Optional[int]]]


def parse_budget(value: BudgetSpec, *, option: str = "reuse_budget") -> Dict[str, Optional[int]]:
    """`None` (defaults), bytes for every place, or `{place: bytes}` -> `{place: bytes or None}`.

    None for a place means: a quarter of what is free there when an entry is admitted (device: 0, so by
    default nothing is kept in VRAM between requests; on a CPU the compute "device" is host RAM and counts as
    `host`).
    """
    out: Dict[str, Optional[int]] = {"device": 0, "host": None, "file": None}
    if value is None:
        return out
    if isinstance(value, bool) or not isinstance(value, (int, Mapping)):
        raise ValueError(f"`{option}` must be None, a byte count or a dict {{place: bytes}} with places "
                         f"{', '.join(PLACES)}; got {value!r}. Pass e.g. {{'host': 8 << 30}}.")
    items = {place: value for place in PLACES} if isinstance(value, int) else dict(value)
    for place, n in items.items():
        if place not in PLACES:
            raise ValueError(f"`{option}` has an unknown place {place!r}; the places are {', '.join(PLACES)}. "
                             f"Use e.g. {{'host': 8 << 30, 'file': 32 << 30}}.")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"`{option}[{place!r}]` must be a byte count >= 0 or None; got {n!r}.")
        out[place] = n
    return out


def store_places(stats: dict) -> Dict[str, int]:
    """A store's `stats()["bytes"]` folded into the registry's places (a CPU "device" is host RAM)."""
    b = stats.get("bytes", {})
    device = int(b.get("device", 0))
    host = int(b.get("host_pinned", 0)) + int(b.get("host_pageable", 0))
    if str(stats.get("device", "")).startswith("cpu"):
        device, host = 0, host + device
    return {"device": device, "host": host, "file": int(b.get("file", 0))}


def free_in(place: str, store) -> int:
    if place == "host":
        return int(psutil.virtual_memory().available)
    if place == "file":
        where = (store.stats().get("file_dir") if store is not None else None) or "."
        try:
            return int(shutil.disk_usage(where).free)
        except OSError:
            return 0
    return 0
