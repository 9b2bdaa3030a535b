"""The places a layer's K/V can be kept, and the units its size is counted in: defined here once.

The place names key `KVStore.stats()["bytes"]` and are what the planner assigns; a mode (`config.Mode`) decides
which of them it may use. What a place, a mode and a tier are: docs/glossary.md.
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
