"""The places a layer's K/V can be kept, and the units its size is counted in: defined here once.

A *place* is where one layer's bytes live between gets; it is what `KVStore.stats()["bytes"]` is keyed by and
what the planner assigns. A *mode* (`config.Mode`) is what the user picks; it decides which places the planner
may use. A *tier* is the code that keeps the bytes of one or more places (`tiers/`).
"""

from __future__ import annotations

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

DEVICE, PINNED, PAGEABLE, FILE = "device", "host_pinned", "host_pageable", "file"
PLACES = (DEVICE, PINNED, PAGEABLE, FILE)  # fastest first
HOST_PLACES = (PINNED, PAGEABLE)
STREAMED = (PINNED, PAGEABLE, FILE)  # served through the ring of device slots, not in place

WORDS = {DEVICE: "resident on the device", PINNED: "in pinned RAM", PAGEABLE: "in pageable RAM", FILE: "in files"}

# The coarser places a reuse budget is given for (`reuse_budget`): host is pinned and pageable RAM together.
BUDGET_DEVICE, BUDGET_HOST, BUDGET_FILE = "device", "host", "file"
BUDGET_PLACES = (BUDGET_DEVICE, BUDGET_HOST, BUDGET_FILE)


def budget_place(place: str) -> str:
    """The budget place that counts bytes kept in `place`."""
    return BUDGET_HOST if place in HOST_PLACES else place
