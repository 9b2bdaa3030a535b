"""The placement plan is pure: sizes, budgets and free figures in, layer -> place and a reason out."""

import pytest

from offload_core.config import Mode
from offload_core.places import DEVICE, FILE, PAGEABLE, PINNED, GiB, MiB
from offload_core.store.plan import RESERVE_BYTES, Figures, make_plan, resident_indices

LAYER = 64 * MiB


def figures(**kw):
    base = dict(layers=32, layer_bytes=LAYER, slot_bytes=LAYER, slots=2, pin_budget=64 * GiB)
    base.update(kw)
    return Figures(**base)


def free(n_layers):
    """Free memory in which `auto` keeps exactly `n_layers` layers (its margin and reserve included)."""
    need = n_layers * LAYER
    return need + need // 2 + RESERVE_BYTES


def test_auto_plenty_of_vram_keeps_everything_resident():
    plan = make_plan(Mode.AUTO, figures(free_device=64 * GiB, free_host=64 * GiB))
    assert plan.counts() == {DEVICE: 32, PINNED: 0, PAGEABLE: 0, FILE: 0} and plan.mode is Mode.GPU
    assert plan.reason.startswith("auto: all 32 layers (2.00 GiB) fit in free device memory")


def test_auto_tight_vram_plenty_of_ram_is_partly_resident():
    plan = make_plan(Mode.AUTO, figures(free_device=free(10), free_host=64 * GiB, pin_budget=12 * LAYER))
    counts = plan.counts()
    assert counts[DEVICE] == 8  # 10 layers of room, 2 of them taken by the ring's slots
    assert counts[PINNED] == 12 and counts[PAGEABLE] == 12 and counts[FILE] == 0
    assert plan.mode is Mode.RAM_ASYNC
    assert "8 resident on the device" in plan.reason and "12 in pinned RAM" in plan.reason


def test_auto_tight_both_spills_to_files():
    plan = make_plan(Mode.AUTO, figures(free_device=free(6), free_host=free(10)))
    counts = plan.counts()
    assert counts[DEVICE] == 4 and counts[PINNED] + counts[PAGEABLE] == 10 and counts[FILE] == 18
    assert plan.mode is Mode.FILE_ASYNC and "18 in files" in plan.reason


@pytest.mark.parametrize("free_device, free_host, expected", [
    (64 * GiB, 64 * GiB, Mode.GPU),
    (free(10), 64 * GiB, Mode.RAM_ASYNC),
    (free(6), free(10), Mode.FILE_ASYNC),
    (None, None, Mode.FILE_ASYNC),  # nothing known: the place that needs no memory
])
def test_auto_runs_as_the_mode_of_its_slowest_place(free_device, free_host, expected):
    assert make_plan(Mode.AUTO, figures(free_device=free_device, free_host=free_host)).mode is expected


def test_unified_memory_never_plans_a_ram_place():
    plan = make_plan(Mode.AUTO, figures(free_device=free(10), free_host=64 * GiB, unified="unified memory (x)"))
    counts = plan.counts()
    assert counts[PINNED] == counts[PAGEABLE] == 0 and counts[DEVICE] == 8 and counts[FILE] == 24
    assert "RAM places disabled, unified memory (x)" in plan.reason
    assert plan.place_of(40, LAYER, on_device=32 * LAYER, on_host=0) == FILE  # beyond the plan: never RAM


def test_device_budget_keeps_whole_layers_spread_over_the_order():
    plan = make_plan(Mode.RAM_ASYNC, figures(device_budget=8 * LAYER + LAYER // 2))
    assert plan.counts()[DEVICE] == 8
    assert [i for i, p in enumerate(plan.places) if p == DEVICE] == [0, 4, 8, 12, 16, 20, 24, 28]
    assert plan.reason.startswith("ram_async: ") and "device_budget" in plan.reason


def test_host_budget_spills_to_files_and_caps_every_later_layer():
    plan = make_plan(Mode.RAM_SYNC, figures(host_budget=16 * LAYER))
    assert plan.counts() == {DEVICE: 0, PINNED: 0, PAGEABLE: 16, FILE: 16}  # sync: nothing pinned
    assert "beyond host_budget" in plan.reason
    # A layer larger than expected, or one more than expected, never pushes RAM over the budget.
    assert plan.place_of(0, 2 * LAYER, on_device=0, on_host=15 * LAYER) == FILE
    assert plan.place_of(32, LAYER, on_device=0, on_host=0) == FILE


def test_device_cap_holds_for_layers_beyond_the_plan():
    plan = make_plan(Mode.FILE_ASYNC, figures(layers=4, device_budget=4 * LAYER))
    assert plan.counts()[DEVICE] == 4
    assert plan.place_of(4, LAYER, on_device=4 * LAYER, on_host=0) == FILE


def test_explicit_modes_without_budgets_say_requested():
    for mode, place in ((Mode.GPU, DEVICE), (Mode.RAM_SYNC, PAGEABLE), (Mode.RAM_ASYNC, PINNED),
                        (Mode.FILE_SYNC, FILE), (Mode.FILE_ASYNC, FILE)):
        plan = make_plan(mode, figures())
        assert set(plan.places) == {place} and plan.reason == "requested"


def test_not_pinnable_plans_pageable_ram():
    plan = make_plan(Mode.RAM_ASYNC, figures(pinnable=False))
    assert plan.counts()[PAGEABLE] == 32


@pytest.mark.parametrize("layers, resident, expected", [
    (32, 0, []), (32, 1, [0]), (4, 2, [0, 2]), (5, 5, [0, 1, 2, 3, 4]), (3, 9, [0, 1, 2])])
def test_resident_indices(layers, resident, expected):
    assert resident_indices(layers, resident) == expected


def test_explicit_ram_async_beyond_the_pin_budget_says_so():
    plan = make_plan(Mode.RAM_ASYNC, figures(pin_budget=10 * LAYER))
    assert plan.counts()[PINNED] == 10 and plan.counts()[PAGEABLE] == 22
    assert "10 in pinned RAM (pin budget 0.62 GiB), 22 in pageable RAM (beyond the pin budget)" in plan.reason


def test_auto_honours_a_device_budget_below_the_free_vram():
    plan = make_plan(Mode.AUTO, figures(free_device=64 * GiB, free_host=64 * GiB, device_budget=4 * LAYER))
    assert plan.counts()[DEVICE] == 4 and plan.counts()[PINNED] == 28 and "device_budget" in plan.reason


def test_zero_budgets_keep_nothing_there():
    plan = make_plan(Mode.RAM_SYNC, figures(device_budget=0, host_budget=0))
    assert plan.counts() == {DEVICE: 0, PINNED: 0, PAGEABLE: 0, FILE: 32}


@pytest.mark.parametrize("mode", ["auto", "ram_sync", "gpu"])
def test_an_absurd_expected_size_plans_a_bounded_list_within_the_same_caps(mode):
    """`KVStore(expected_bytes=2**63 - 1)` in `auto` built one plan entry per expected layer: MemoryError."""
    import torch

    from offload_core import KVStore, OffloadConfig

    budget = {} if mode == "gpu" else {"host_budget": 1 * MiB}
    with KVStore(OffloadConfig(mode=mode, **budget), torch.device("cpu"),
                 expected_bytes=2 ** 63 - 1) as store:
        k = torch.arange(64, dtype=torch.float32).view(1, 4, 16)
        store.put(0, k, k + 1)
        got_k, got_v = store.get(0)
        assert torch.equal(got_k, k) and torch.equal(got_v, k + 1)
