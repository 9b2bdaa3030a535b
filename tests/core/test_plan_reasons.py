"""`stats()["reason"]` describes the plan in force, mode by mode, worded from the layers actually put."""

import re

import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig
from offload_core.config import Mode
from offload_core.places import MiB
from offload_core.store.plan import Figures, make_plan

SHAPE = (1, 2, 64, 32)  # bf16: a layer is exactly 16 KiB in the flat layout
LAYER = 16384
WORDS = {"device": "resident on the device", "host_pinned": "in pinned RAM", "host_pageable": "in pageable RAM",
         "file": "in files"}
STREAMING = ["ram_sync", "ram_async", "file_sync", "file_async", "auto"]


def layer(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).bfloat16(), torch.randn(SHAPE, generator=gen).bfloat16()


def store_for(mode, tmp_path, expected, free_device=0, **fields):
    """A CPU store; `auto` sees `free_device` bytes free on the device, nothing in RAM (it plans files)."""
    if Mode(mode).is_file:
        fields["file_dir"] = str(tmp_path)
    host = HostServices(free_device_memory=lambda d: free_device, free_host_memory=lambda: 0,
                        temp_dir=lambda: str(tmp_path)) if mode == "auto" else None
    return KVStore(OffloadConfig(mode=mode, **fields), "cpu", host=host, expected_bytes=expected)


def assert_describes(reason, plan):
    """Every place that holds layers is named with its count, no other place is, and the total is right."""
    total = sum(plan.values())
    assert re.search(rf"\b{total} layers? \(", reason), reason
    for place, n in plan.items():
        assert (f"{n} {WORDS[place]}" in reason) == bool(n) or (n == total and "all " in reason), (place, reason)


@pytest.mark.parametrize("expected", [None, LAYER, 60 * LAYER], ids=["unknown", "one", "sixty"])
@pytest.mark.parametrize("mode", STREAMING)
def test_the_reason_counts_the_layers_put_not_the_expectation(mode, expected, tmp_path, ordering):
    with store_for(mode, tmp_path, expected, free_device=64 << 30, device_budget=3 * LAYER) as store:
        store.put(0, *layer(0))
        first = store.stats()
        for i in range(1, 6):
            store.put(i, *layer(i))
        stats = store.stats()
    label = "auto" if mode == "auto" else mode
    assert first["reason"].startswith(f"{label}: ") and stats["reason"].startswith(f"{label}: ")
    assert "1 layer (" in first["reason"] or "all 1 layer " in first["reason"], first["reason"]
    assert sum(stats["plan"].values()) == 6 and sum(n > 0 for n in stats["plan"].values()) >= 2
    assert_describes(stats["reason"], stats["plan"])
    assert "60 layers" not in stats["reason"]


@pytest.mark.parametrize("mode", ["ram_sync", "ram_async"])
def test_pageable_ram_says_why_it_is_not_pinned(mode, tmp_path, ordering):
    with store_for(mode, tmp_path, None, device_budget=LAYER) as store:
        for i in range(3):
            store.put(i, *layer(i))
        reason = store.stats()["reason"]
    if mode == "ram_sync":  # never pins, on any device
        assert "2 in pageable RAM (ram_sync copies synchronously and never pins)" in reason, reason
    elif ordering is None:  # the plain CPU path: copies are synchronous, nothing is pinned
        assert "2 in pageable RAM (copies here are synchronous, so nothing is pinned)" in reason, reason
    else:  # the CUDA model: pinned within the (process) pin budget
        assert "2 in pinned RAM (pin budget" in reason, reason
    assert "beyond the pin budget" not in reason


def test_a_granted_explicit_mode_says_requested(tmp_path):
    for mode in ("gpu", "ram_sync", "ram_async", "file_sync", "file_async"):
        with store_for(mode, tmp_path, None) as store:
            for i in range(3):
                store.put(i, *layer(i))
            assert store.stats()["reason"] == "requested", mode


def test_the_plan_words_each_place_for_its_mode():
    base = dict(layers=8, layer_bytes=MiB, slot_bytes=MiB, slots=2, device_budget=2 * MiB)
    sync = make_plan(Mode.RAM_SYNC, Figures(**base)).reason
    unpinnable = make_plan(Mode.RAM_ASYNC, Figures(pinnable=False, **base)).reason
    pinned = make_plan(Mode.RAM_ASYNC, Figures(pin_budget=3 * MiB, **base)).reason
    assert sync == ("ram_sync: 8 layers (8.0 MiB): 2 resident on the device (device_budget 2.0 MiB), "
                    "6 in pageable RAM (ram_sync copies synchronously and never pins)")
    assert "6 in pageable RAM (copies here are synchronous, so nothing is pinned)" in unpinnable
    assert "3 in pinned RAM (pin budget 3.0 MiB), 3 in pageable RAM (beyond the pin budget)" in pinned
    plan = make_plan(Mode.FILE_SYNC, Figures(**base))
    assert plan.describe({"device": 2, "host_pinned": 0, "host_pageable": 0, "file": 0}, 2 * MiB) == \
        "file_sync: all 2 layers (2.0 MiB) fit within device_budget 2.0 MiB"
