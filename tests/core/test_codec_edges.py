"""Compact storage at its edges, on every tier: NaN and inf kept exactly (never spread, never dropped), huge
magnitudes measured without overflow, and layers of no tokens in every mode and storage."""

import pytest
import torch

from offload_core import HostServices, KVStore, OffloadConfig
from offload_core.store.codec import Codec, add_error, error_summary

from store_helpers import make_layers, put_all

MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto", "mixed"]
LOSSY = ["fp8", "int8"]
BOUNDS = {"fp8": 0.04, "int8": 0.015}
SHAPE = (1, 24, 2, 32)  # (B, P, H, D): 48 vectors of 32 values per tensor
LAYER = 8192  # one layer of SHAPE in the flat layout, exact or encoded (K and V each 4 KiB-aligned)


def store_for(mode, storage, tmp_path):
    """A CPU store of `mode`; `auto` is told nothing is free, so it plans files (the CPU shares one pool);
    `mixed` keeps layers on the device, in RAM and in files."""
    fields = {"file_dir": str(tmp_path)} if mode.startswith("file") else {}
    if mode == "mixed":
        mode, fields = "ram_async", {"device_budget": 2 * LAYER, "host_budget": LAYER, "file_dir": str(tmp_path)}
    host = HostServices(free_device_memory=lambda d: 0, free_host_memory=lambda: 0,
                        temp_dir=lambda: str(tmp_path)) if mode == "auto" else None
    return KVStore(OffloadConfig(mode=mode, storage=storage, **fields), "cpu", host=host)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def relative(x, y):
    x, y = x.double(), y.double()  # the test's reference may use float64: it runs on the CPU
    return ((x - y).norm() / x.norm()).item()


def serve(store, layers, passes=2):
    """Puts `layers` ({key: (k, v)}), gets them `passes` times; returns the last pass's copies in order, stats."""
    put_all(store, layers)
    out = []
    for _ in range(passes):
        out = [tuple(t.clone() for t in store.get(key)) for key in layers]
    return out, store.stats()


POISON = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("value", POISON)
@pytest.mark.parametrize("storage", LOSSY)
@pytest.mark.parametrize("mode", MODES)
def test_non_finite_values_keep_their_layer_exact(mode, storage, value, tmp_path, ordering):
    layers = make_layers(range(4), shape=SHAPE)
    layers[1][0][0, 5, 1, 7] = POISON[value]  # one value of one (token, head) vector of layer 1's K
    with store_for(mode, storage, tmp_path) as store:
        served, stats = serve(store, layers)
    # Layer 1 comes back exactly as put: the bad value kept, its neighbours untouched.
    assert same_bits(served[1][0], layers[1][0]) and same_bits(served[1][1], layers[1][1])
    for (k, v), (k0, v0) in zip(served[::2], (layers[0], layers[2])):  # the other layers are encoded as usual
        assert not same_bits(k, k0) and relative(k0, k) <= BOUNDS[storage] and relative(v0, v) <= BOUNDS[storage]
    error = stats["kv_error"]
    assert error["exact_layers"] == 1 and "NaN or inf" in error["exact_why"]
    assert 0 < error["relative"] <= BOUNDS[storage] and 0 < error["max_abs"] < 1  # the encoded layers' error


@pytest.mark.parametrize("storage", LOSSY)
@pytest.mark.parametrize("mode", MODES)
def test_huge_magnitudes_are_encoded_and_their_error_is_true(mode, storage, tmp_path, ordering):
    # About 1e20 in float32: (x - x')^2 and x^2 overflow float32 when summed as they are.
    layers = {key: (k.float() * 1e20, v.float() * 1e20) for key, (k, v) in make_layers(range(3), shape=SHAPE).items()}
    with store_for(mode, storage, tmp_path) as store:
        served, stats = serve(store, layers)
    error = stats["kv_error"]
    true_rel = relative(torch.cat([t.flatten() for kv in layers.values() for t in kv]),
                        torch.cat([t.flatten() for kv in served for t in kv]))
    true_max = max((a.double() - b.double()).abs().max().item() for kv0, kv in zip(layers.values(), served)
                   for a, b in zip(kv0, kv))
    assert error["exact_layers"] == 0 and error["exact_why"] is None
    assert 0 < true_rel <= BOUNDS[storage]
    assert error["relative"] == pytest.approx(true_rel, rel=1e-4)
    assert error["max_abs"] == pytest.approx(true_max, rel=1e-4) and 1e17 < error["max_abs"] < 1e20


@pytest.mark.parametrize("storage", ["exact", *LOSSY])
@pytest.mark.parametrize("mode", MODES)
def test_layers_of_no_tokens(mode, storage, tmp_path, ordering):
    full = make_layers(range(2), shape=SHAPE)
    empty = (torch.empty(1, 0, 2, 32, dtype=torch.bfloat16), torch.empty(1, 0, 2, 32, dtype=torch.bfloat16))
    layers = {0: full[0], 1: empty, 2: full[1], 3: empty}
    with store_for(mode, storage, tmp_path) as store:
        served, stats = serve(store, layers, passes=3)
    for (k, v), (k0, v0) in zip(served, layers.values()):
        assert k.shape == k0.shape and v.shape == v0.shape and k.dtype == k0.dtype
    assert stats["layers"] == 4 and sum(stats["plan"].values()) == 4
    if storage != "exact":
        assert 0 < stats["kv_error"]["relative"] <= BOUNDS[storage] and stats["kv_error"]["exact_layers"] == 0


@pytest.mark.parametrize("storage", LOSSY)
def test_put_reads_float32_k_and_v_without_writing_them(storage):
    k, v = make_layers([0], torch.float32, shape=SHAPE)[0]
    k0, v0 = k.clone(), v.clone()
    with KVStore(OffloadConfig(mode="gpu", storage=storage), "cpu") as store:
        store.put(0, k, v)
        store.stats()
    assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("name", LOSSY)
def test_holds_reads_the_scales(name):
    codec = Codec(name)
    x = torch.randn(4, 16)
    assert bool(codec.holds(codec.encode(x), x)) and bool(codec.holds(codec.encode(x * 1e30), x))
    assert bool(codec.holds(codec.encode(torch.zeros(4, 16)), x))
    for bad in POISON.values():
        y = x.clone()
        y[2, 3] = bad
        assert not bool(codec.holds(codec.encode(y), y))
    huge = x.double() * 1e300  # beyond float32: its scale cannot be held either
    assert not bool(codec.holds(codec.encode(huge), huge))


@pytest.mark.parametrize("name", LOSSY)
def test_error_is_the_same_at_every_magnitude(name, monkeypatch):
    import offload_core.store.codec as codec_module

    monkeypatch.setattr(codec_module, "CHUNK_ELEMENTS", 64)  # totals merged across chunks, too
    codec = Codec(name)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    x[7] *= 1e-30  # a vector far smaller than the rest, and one of zeros: neither disturbs the totals
    x[9] = 0
    base = error_summary(codec.error(x, codec.encode(x)))
    for factor in (1e-30, 1e15, 1e20, 1e35):
        scaled = error_summary(codec.error(x * factor, codec.encode(x * factor)))
        assert scaled["relative"] == pytest.approx(base["relative"], rel=1e-4)
        assert scaled["max_abs"] == pytest.approx(base["max_abs"] * factor, rel=1e-4)
    # Totals of tensors 1e30 apart: the small one adds nothing measurable, and nothing overflows.
    total = add_error(codec.error(x, codec.encode(x)), codec.error(x * 1e30, codec.encode(x * 1e30)))
    assert error_summary(total)["relative"] == pytest.approx(base["relative"], rel=1e-4)


@pytest.mark.parametrize("storage", ["exact", *LOSSY])
def test_a_first_layer_of_no_tokens_does_not_size_the_plan(storage):
    # The expected layer count is the cache's bytes over the first layer's: an empty one would plan a layer per byte.
    empty = torch.empty(1, 0, 2, 32, dtype=torch.bfloat16)
    config = OffloadConfig(mode="ram_sync", storage=storage, device_budget=2 * LAYER)
    with KVStore(config, "cpu", expected_bytes=1 << 21) as store:  # small enough to fail fast without the guard
        store.put(0, empty, empty)
        put_all(store, make_layers(range(1, 4), shape=SHAPE))
        assert len(store.plan.places) <= 60 and store.stats()["plan"]["device"] >= 1
        assert store.get(0)[0].shape == empty.shape and store.get(2)[0].shape == SHAPE
