"""Property tests of the whole engine at the sizes real models put: every `get` returns the bytes put.

Each case is a random store (`property_draws.draw_case`): a mode, a storage, dedup on or off, budgets that mix
the places, and layers from a few bytes to 64 MiB on both sides of every whole number of 2 MiB, odd token counts,
batch rows equal and different, mixed shapes and dtypes in one store, got in a learned order with skipped and
repeated layers; on the plain CPU path and on the CPU model of CUDA. Lossless storage must return the bits put;
fp8 / int8 must return, in every tier, the bits the same storage returns from `ram_sync`.
"""

import os

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.store import kvstore as store_module
from offload_core.tiers.file import fileio, iopool

from property_draws import MiB, draw_case

CASES = 36
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its width: -0.0 and 0.0 differ, as do two NaNs of other payloads."""
    return t.contiguous().view(_BITS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def reference(case, tmp_path):
    """What the case's storage serves from `ram_sync`: the layers put, for exact storage."""
    if case.fields["storage"] == "exact":
        return case.layers
    config = OffloadConfig(mode="ram_sync", storage=case.fields["storage"], dedup=case.fields["dedup"])
    with KVStore(config, "cpu") as store:
        for key, (k, v) in case.layers.items():
            store.put(key, k, v)
        return {key: tuple(t.clone() for t in store.get(key)) for key in case.layers}


def run_case(case, tmp_path, monkeypatch):
    expected = reference(case, tmp_path)
    monkeypatch.setattr(fileio, "CHUNK", case.io[0])  # the pattern a probe might have chosen (the tests fix it)
    monkeypatch.setattr(iopool, "IO_DEPTH", case.io[1])
    if case.discrete:
        monkeypatch.setattr(store_module, "same_pool_reason", lambda device: None)
    files = tmp_path / "files"
    files.mkdir()
    total = sum(k.nbytes + v.nbytes for k, v in case.layers.values())
    with KVStore(case.config(str(files)), "cpu", host=case.host(str(files)), expected_bytes=total) as store:
        for key, (k, v) in case.layers.items():
            store.put(key, k, v)
        for step, keys in enumerate(case.passes):
            for key in keys:
                k, v = store.get(key)
                want_k, want_v = expected[key]
                assert same_bits(k, want_k) and same_bits(v, want_v), (
                    f"{case.describe()}: layer {key!r} differs in pass {step} (plan {store.stats()['plan']})")
        stats = store.stats()
    assert sum(stats["plan"].values()) == len(case.layers)
    assert os.listdir(files) == [], "the store left files behind"
    return stats


@pytest.mark.parametrize("seed", range(CASES))
def test_every_get_returns_the_bytes_put(seed, tmp_path, monkeypatch, ordering):
    run_case(draw_case(seed), tmp_path, monkeypatch)


def test_the_draws_cover_every_mode_place_storage_and_size_class():
    """The seeds above are not a lucky few: together they reach every mode, storage and size class."""
    cases = [draw_case(seed) for seed in range(CASES)]
    assert {c.fields["mode"] for c in cases} == {"gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"}
    assert {c.fields["storage"] for c in cases} == {"exact", "fp8", "int8"}
    assert {c.fields["dedup"] for c in cases} == {True, False}
    assert any("device_budget" in c.fields for c in cases) and any("host_budget" in c.fields for c in cases)
    specs = [s for c in cases for s in c.specs.values()]
    huge = 2 * MiB
    assert any(s.k_bytes < 4096 for s in specs) and any(s.k_bytes > 8 * MiB for s in specs)
    assert sum(s.k_bytes > huge and s.k_bytes % huge for s in specs) >= 10  # the sizes of issue #30
    assert any(s.k_shape[0] > 1 and s.same_rows for s in specs)  # rows kept once
    assert any(s.k_shape[0] > 1 and not s.same_rows for s in specs)
    assert any(s.k_shape != s.v_shape for s in specs)
    files = [c for c in cases if c._files]
    assert {c.io[0] for c in files} >= {64 << 10, 16 * MiB} and {c.io[1] for c in files} >= {1, 16}


REAL = {  # what real prefixes put: a Qwen-Image 2.1 layer of one 1024² reference and a prompt, odd token counts
    ("double", 0): ((1, 1025, 8, 64), torch.float32, False),  # 2 MiB and 4 KiB: just over one huge page
    ("double", 1): ((1, 4103, 24, 128), torch.bfloat16, False),  # 24 MiB each of K and V
    ("single", 0): ((2, 1031, 8, 64), torch.bfloat16, True),  # a batch of two from one prompt: kept as one row
    ("single", 1): ((1, 3, 2, 16), torch.float16, False),  # a few hundred bytes, served from the same slots
}
MB = 1 << 20
REAL_PLANS = {  # budgets that send the big layer and the small ones to different places
    "device+ram": {"mode": "ram_async", "device_budget": 8 * MB},
    "device+file": {"mode": "file_async", "device_budget": 8 * MB},
    "ram+file": {"mode": "ram_sync", "host_budget": 8 * MB},
    "device+ram+file": {"mode": "ram_async", "device_budget": 5 * MB, "host_budget": 40 * MB},
    "file_sync+device": {"mode": "file_sync", "device_budget": 6 * MB},
}


def real_layers():
    from property_draws import _random

    gen = torch.Generator().manual_seed(30)
    return {key: tuple(_random(gen, shape, dtype, same) for _ in "kv") for key, (shape, dtype, same) in REAL.items()}


@pytest.mark.parametrize("storage", ["exact", "fp8", "int8"])
@pytest.mark.parametrize("name", ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto", *REAL_PLANS])
def test_real_size_layers_come_back_as_put_in_every_mode(name, storage, tmp_path, monkeypatch, ordering):
    from property_draws import Case

    fields = {**REAL_PLANS.get(name, {"mode": name}), "storage": storage, "dedup": True}
    layers = real_layers()
    case = Case(0, fields, None, False, {}, [list(layers), list(reversed(layers))])
    case.__dict__["layers"] = layers  # the cached property, set: these layers are not drawn
    stats = run_case(case, tmp_path, monkeypatch)
    if name in REAL_PLANS:  # the budgets really mixed the places
        assert sum(1 for n in stats["plan"].values() if n) >= 2, stats["plan"]
