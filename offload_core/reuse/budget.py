"""Byte budgets of the prefix registry (`registry.py`): per budget place, parsed once; what a store holds where; and
whether a new entry fits, as plain functions over plain data (the registry then does what they decide).
"""

from __future__ import annotations

import shutil
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import psutil

from ..places import BUDGET_DEVICE, BUDGET_FILE, BUDGET_HOST, BUDGET_PLACES, DEVICE, PLACES, MiB, budget_place

BudgetSpec = Union[None, int, Mapping[str, Optional[int]]]


def parse_budget(value: BudgetSpec, *, option: str = "reuse_budget") -> Dict[str, Optional[int]]:
    """`None` (defaults), bytes for every budget place, or `{place: bytes}` -> `{place: bytes or None}`.

    None for a place means: a quarter of what is free there when an entry is admitted (device: 0, so by
    default nothing is kept in VRAM between requests; on a CPU the compute "device" is host RAM and counts as
    `host`).
    """
    out: Dict[str, Optional[int]] = {BUDGET_DEVICE: 0, BUDGET_HOST: None, BUDGET_FILE: None}
    if value is None:
        return out
    if isinstance(value, bool) or not isinstance(value, (int, Mapping)):
        raise ValueError(f"`{option}` must be None, a byte count or a dict {{place: bytes}} with places "
                         f"{', '.join(BUDGET_PLACES)}; got {value!r}. Pass e.g. {{'host': 8 << 30}}.")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"`{option}` must be a byte count >= 0 (for every place) or None; got {value!r}.")
    items = {place: value for place in BUDGET_PLACES} if isinstance(value, int) else dict(value)
    for place, n in items.items():
        if place not in BUDGET_PLACES:
            raise ValueError(f"`{option}` has an unknown place {place!r}; the places are {', '.join(BUDGET_PLACES)}. "
                             f"Use e.g. {{'host': 8 << 30, 'file': 32 << 30}}.")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"`{option}[{place!r}]` must be a byte count >= 0 or None; got {n!r}.")
        out[place] = n
    return out


def store_places(stats: dict) -> Dict[str, int]:
    """A store's `stats()["bytes"]` (by place) folded into the budget places (a CPU "device" is host RAM)."""
    out = {place: 0 for place in BUDGET_PLACES}
    held = stats.get("bytes", {})
    on_cpu = str(stats.get("device", "")).startswith("cpu")
    for place in PLACES:
        out[BUDGET_HOST if on_cpu and place == DEVICE else budget_place(place)] += int(held.get(place, 0))
    return out


def free_in(place: str, store) -> int:
    """Bytes free now in budget place `place` (0 for the device: its budget is never a share of what is free)."""
    if place == BUDGET_HOST:
        return int(psutil.virtual_memory().available)
    if place == BUDGET_FILE:
        where = (store.stats().get("file_dir") if store is not None else None) or "."
        try:
            return int(shutil.disk_usage(where).free)
        except OSError:
            return 0
    return 0


def limits(budget: Dict[str, Optional[int]], kept: Sequence, store) -> Dict[str, int]:
    """Bytes the registry may hold per budget place: the budget, or where it is None a quarter of what the `kept`
    entries hold there plus what is free there now."""
    out = {}
    for place in BUDGET_PLACES:
        n = budget[place]
        out[place] = n if n is not None else (sum(e.places[place] for e in kept) + free_in(place, store)) // 4
    return out


def room_for(needed: Dict[str, int], limit: Dict[str, int], kept: Sequence) -> Tuple[Optional[str], List]:
    """(None, the entries to evict first) when an entry holding `needed` bytes per place fits within `limit`
    once they are gone, else (why not, []). `kept`: the entries held now, least recently used first, each with
    its `places` and whether it is `leased` (read right now: it cannot go). A query: it changes nothing."""
    for place, n in needed.items():
        if n > limit[place]:
            return f"it needs {n / MiB:.1f} MiB of {place}, the reuse budget there is {limit[place] / MiB:.1f} MiB", []
    used = {p: sum(e.places[p] for e in kept) + needed[p] for p in BUDGET_PLACES}
    victims: List = []
    for victim in kept:
        if all(used[p] <= limit[p] for p in BUDGET_PLACES):
            break
        if not victim.leased:
            victims.append(victim)
            used = {p: used[p] - victim.places[p] for p in BUDGET_PLACES}
    if not all(used[p] <= limit[p] for p in BUDGET_PLACES):
        return "the entries that would have to go are in use", []
    return None, victims
