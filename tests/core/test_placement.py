"""Mixed placements through the store: bounds on the device and host, `auto`'s full plan, compact storage."""

import pytest
import torch

import offload_core.store.kvstore as store_module
from offload_core import HostServices, KVStore, OffloadConfig
from offload_core.places import GiB
from offload_core.store.plan import RESERVE_BYTES
from offload_core.tiers.file import fileio, iopool

from store_helpers import make_layers, put_all, tiers

SHAPE = (1, 2, 64, 32)  # bf16: K and V 8 KiB each, so a layer is exactly 16 KiB in the flat layout
LAYER = 16384
N = 32


def run(config, layers, steps=3, host=None, expected=None, check=lambda store: None):
    """Put every layer of `layers` ({key: (k, v)}), then `steps` passes of gets; returns (what each pass served,
    in `layers`' order, last stats)."""
    served = []
    with KVStore(config, "cpu", host=host, expected_bytes=expected) as store:
        for key, (k, v) in layers.items():
            store.put(key, k, v)
            check(store)
        for _ in range(steps):
            out = []
            for key in layers:
                k, v = store.get(key)
                out.append((k.clone(), v.clone()))
                check(store)
            served.append(out)
        stats = store.stats()
    return served, stats


PLANS = [
    {"mode": "ram_async", "device_budget": 8 * LAYER},
    {"mode": "file_async", "device_budget": 16 * LAYER, "prefetch_depth": 3},
    {"mode": "ram_sync", "host_budget": 10 * LAYER},
    {"mode": "ram_async", "device_budget": 8 * LAYER, "host_budget": 8 * LAYER, "prefetch_depth": 2},
]


@pytest.mark.parametrize("fields", PLANS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_32_layers_bounded_on_the_device_and_host_and_exact(fields, tmp_path):
    config = OffloadConfig(file_dir=str(tmp_path) if fields["mode"].startswith("file") or "host_budget" in fields
                           else None, **fields)
    layers = make_layers(range(N), shape=SHAPE)
    depth = config.depth
    # The file place's staging: read buffers (header + data each), and until the writes in flight at the first
    # get have finished (the next load frees them), the write ring too (a chunk, at most, per buffer).
    staging = (depth + 1) * (LAYER + 2 * 4096) + (iopool.IO_DEPTH + 2) * min(fileio.CHUNK, LAYER)
    peaks = {"host": 0}

    def check(store):
        stats = store.stats()
        host = stats["bytes"]["host_pinned"] + stats["bytes"]["host_pageable"]
        peaks["host"] = max(peaks["host"], host)
        assert stats["layers_on_device"] <= stats["plan"]["device"] + depth + 1
        assert stats["resident_layers"] == min(stats["layers"], stats["plan"]["device"])

    served, stats = run(config, layers, check=check)
    for out in served:
        for (k, v), (k0, v0) in zip(out, layers.values()):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    resident = stats["plan"]["device"]
    assert stats["peak_layers_on_device"] <= resident + depth + 1
    assert stats["peak_device_bytes"] <= resident * LAYER + (depth + 1) * LAYER
    if "device_budget" in fields:
        assert resident == fields["device_budget"] // LAYER
    if "host_budget" in fields:
        assert peaks["host"] <= fields["host_budget"] + staging and stats["plan"]["file"] > 0
    assert sum(stats["plan"].values()) == N and stats["reason"].startswith(fields["mode"] + ": ")
    # Resident layers need no load, so the next streamed layer is always in flight when asked for.
    if config.depth:
        assert stats["misses"] <= 1  # only the first get of the first pass: nothing is prefetched before it


@pytest.fixture
def discrete_device(monkeypatch):
    """Plans for the CPU as if it were a discrete GPU beside separate RAM (a stand-in for hardware we lack)."""
    monkeypatch.setattr(store_module, "same_pool_reason", lambda device: None)


def room_for(layers):
    need = layers * LAYER
    return need + need // 2 + RESERVE_BYTES


@pytest.mark.parametrize("free_device, free_host, expect, words", [
    (64 * GiB, 64 * GiB, {"device": N}, "all 32 layers (0.5 MiB) fit in free device memory"),
    (room_for(12), 64 * GiB, {"device": 10, "ram": 22}, "10 resident on the device"),
    (room_for(6), room_for(10), {"device": 4, "ram": 10, "file": 18}, "18 in files (beyond free RAM"),
], ids=["plenty", "tight-vram", "tight-both"])
def test_auto_builds_a_full_plan_from_free_figures(discrete_device, free_device, free_host, expect, words, tmp_path,
                                                   ordering):
    host = HostServices(free_device_memory=lambda d: free_device, free_host_memory=lambda: free_host,
                        temp_dir=lambda: str(tmp_path))
    layers = make_layers(range(N), shape=SHAPE)
    served, stats = run(OffloadConfig(mode="auto"), layers, steps=2, host=host, expected=N * LAYER)
    # Pinned where copies are asynchronous (the CUDA model), pageable on the plain CPU path.
    ram = "host_pinned" if ordering is not None else "host_pageable"
    assert {place: n for place, n in stats["plan"].items() if n} == {ram if p == "ram" else p: n
                                                                    for p, n in expect.items()}
    assert stats["reason"].startswith("auto: ") and words in stats["reason"], stats["reason"]
    assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(served[-1], layers.values()))


def test_auto_on_unified_memory_never_plans_ram(monkeypatch, tmp_path):
    monkeypatch.setattr(store_module, "same_pool_reason", lambda device: "unified memory (stand-in)")
    host = HostServices(free_device_memory=lambda d: room_for(6), free_host_memory=lambda: 64 * GiB,
                        temp_dir=lambda: str(tmp_path))
    _, stats = run(OffloadConfig(mode="auto"), make_layers(range(N), shape=SHAPE), steps=1, host=host,
                   expected=N * LAYER)
    assert stats["plan"]["host_pinned"] == stats["plan"]["host_pageable"] == 0 and stats["plan"]["file"] > 0
    assert "RAM places disabled, unified memory (stand-in)" in stats["reason"]


def test_layers_beyond_the_expectation_respect_the_budgets(tmp_path, ordering):
    # Told 4 layers, given 32: the device keeps what its budget allows, RAM its budget, the rest goes to files.
    config = OffloadConfig(mode="ram_async", device_budget=3 * LAYER, host_budget=5 * LAYER, file_dir=str(tmp_path))
    served, stats = run(config, make_layers(range(N), shape=SHAPE), steps=2, expected=4 * 2 * 8192)
    ram = stats["plan"]["host_pinned"] + stats["plan"]["host_pageable"]
    assert (stats["plan"]["device"], ram, stats["plan"]["file"]) == (3, 5, 24)
    assert all(torch.equal(k, k0) for (k, _), (k0, _) in zip(served[-1], make_layers(range(N), shape=SHAPE).values()))


@pytest.mark.parametrize("storage", ["fp8", "int8"])
def test_compact_storage_halves_bytes_everywhere_and_places_agree(storage, tmp_path):
    # K 128 KiB: the 4 KiB alignment of a flat layout costs < 4 % of the encoded bytes
    layers = make_layers(range(4), torch.bfloat16, seed=3, shape=(1, 8, 64, 128))
    layer = 2 * 8 * 64 * 128 * 2
    exact = run(OffloadConfig(mode="gpu"), layers, steps=1)[1]["stored_bytes"]["device"]
    configs = {
        "gpu": OffloadConfig(mode="gpu", storage=storage),
        "ram": OffloadConfig(mode="ram_async", storage=storage),
        "file": OffloadConfig(mode="file_sync", storage=storage, file_dir=str(tmp_path)),
        "mixed": OffloadConfig(mode="ram_async", storage=storage, device_budget=layer // 2 + 8192,
                               host_budget=layer // 2 + 8192, file_dir=str(tmp_path)),
    }
    results = {name: run(config, layers, steps=2) for name, config in configs.items()}
    gpu_served, gpu_stats = results["gpu"]
    # gpu + fp8/int8: half the VRAM of the cache, plus one slot the consumer reads decoded layers from.
    assert gpu_stats["stored_bytes"]["device"] <= 0.55 * exact and gpu_stats["storage"] == storage
    assert gpu_stats["peak_device_bytes"] <= gpu_stats["stored_bytes"]["device"] + layer
    ram = results["ram"][1]["stored_bytes"]
    assert ram["host_pinned"] + ram["host_pageable"] <= 0.55 * exact
    moved = results["ram"][1]["transfers"]
    assert moved["bytes"] <= 0.55 * layer * moved["count"]  # every copy moves the encoded bytes only
    assert results["mixed"][1]["plan"] == {"device": 1, "host_pinned": results["mixed"][1]["plan"]["host_pinned"],
                                           "host_pageable": results["mixed"][1]["plan"]["host_pageable"], "file": 2}
    bound = {"fp8": 0.04, "int8": 0.015}[storage]
    for (k, v), (k0, v0) in zip(gpu_served[-1], layers.values()):
        assert k.dtype == k0.dtype and k.shape == k0.shape
        assert ((k.float() - k0.float()).norm() / k0.float().norm()) <= bound
        assert ((v.float() - v0.float()).norm() / v0.float().norm()) <= bound
    error = gpu_stats["kv_error"]  # measured at put, over every layer's K and V
    assert 0 < error["relative"] <= bound and 0 < error["max_abs"] < 1
    worst = max((k.float() - k0.float()).abs().max().item() for (k, _), (k0, _) in zip(gpu_served[-1], layers.values()))
    assert worst <= error["max_abs"]
    assert error["worst"]["relative"] >= error["relative"] * (1 - 1e-6)  # the worst layer, beside the aggregate
    ram_error = dict(results["ram"][1]["kv_error"])
    assert ram_error.pop("worst") == {**error["worst"], "relative": pytest.approx(error["worst"]["relative"]),
                                      "max_abs": pytest.approx(error["worst"]["max_abs"])}
    assert ram_error == pytest.approx({key: value for key, value in error.items() if key != "worst"})
    for name, (served, _) in results.items():
        for out in served:  # the codec is deterministic: every place serves the same decoded values
            for (k, v), (gk, gv) in zip(out, gpu_served[-1]):
                assert torch.equal(k, gk) and torch.equal(v, gv), name


def test_fp8_on_mps_is_refused_before_anything_is_allocated():
    with pytest.raises(ValueError, match="`storage` 'fp8' needs float8 kernels.*Use storage='int8'"):
        KVStore(OffloadConfig(mode="gpu", storage="fp8"), "mps")


def test_a_failing_tier_close_still_closes_the_other_places(tmp_path):
    config = OffloadConfig(mode="ram_sync", device_budget=LAYER, host_budget=LAYER, file_dir=str(tmp_path))
    store = KVStore(config, "cpu", expected_bytes=4 * LAYER)
    put_all(store, make_layers(range(4), shape=SHAPE))
    assert set(tiers(store)) == {"device", "host_pageable", "file"} and len(list(tmp_path.iterdir())) == 1

    def broken():
        raise KeyboardInterrupt  # e.g. Ctrl-C while one place closes

    tiers(store)["host_pageable"].close = broken
    with pytest.raises(KeyboardInterrupt):
        store.close()
    assert list(tmp_path.iterdir()) == []  # the file place was closed anyway
    assert tiers(store)["device"].nbytes() == {"device": 0} and store.closed
    del tiers(store)["host_pageable"].close  # a close that works again: the next call finishes
    store.close()


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_store_whose_close_did_not_finish_is_closed_again_when_dropped_and_logs_what_fails(tmp_path, caplog):
    import gc
    import logging

    config = OffloadConfig(mode="ram_sync", device_budget=LAYER, host_budget=LAYER, file_dir=str(tmp_path))
    store = KVStore(config, "cpu", expected_bytes=4 * LAYER)
    put_all(store, make_layers(range(4), shape=SHAPE))
    tier, calls = tiers(store)["host_pageable"], []

    def broken():
        calls.append(1)
        raise OSError("a place that never closes")

    tier.close = broken
    try:
        store.close()
    except OSError:  # (no `pytest.raises`: its traceback would keep the store alive)
        pass
    with caplog.at_level(logging.WARNING, logger="offload_core.store.resources"):
        del store
        gc.collect()
    assert len(calls) == 2  # the safety net tried again
    assert any("dropped unclosed failed: OSError: a place that never closes" in r.getMessage() for r in caplog.records)


def test_when_two_places_fail_to_close_the_first_is_raised_and_the_other_logged(tmp_path, caplog):
    import logging

    config = OffloadConfig(mode="ram_sync", device_budget=LAYER, host_budget=LAYER, file_dir=str(tmp_path))
    store = KVStore(config, "cpu", expected_bytes=4 * LAYER)
    put_all(store, make_layers(range(4), shape=SHAPE))

    def broken(why):
        def close():
            raise OSError(why)
        return close

    tiers(store)["device"].close = broken("the first place")
    tiers(store)["host_pageable"].close = broken("the second place")
    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="the first place"):
        store.close()
    assert any("closing another place failed too: OSError: the second place" in r.getMessage()
               for r in caplog.records)
    assert list(tmp_path.iterdir()) == []
    for place in ("device", "host_pageable"):
        del tiers(store)[place].close
    store.close()
