"""Compact storage at the limits of the dtypes: no finite input ever decodes to a non-finite value, and a layer
the codec cannot hold within its error (values past the range once decoded, values below float32's normal range)
is kept exact and counted, beside the worst encoded layer's error."""

import math
import random

import pytest
import torch

from offload_core import KVStore, OffloadConfig
from offload_core.store.codec import MAX_RELATIVE, Codec

LOSSY = ["fp8", "int8"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPE = (1, 6, 2, 16)


def bits_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def relative(x, y):
    x, y = x.double(), y.double()
    return ((x - y).norm() / x.norm()).item() if x.norm() > 0 else 0.0


def serve(storage, layers, mode="ram_sync", tmp_path=None):
    fields = {"file_dir": str(tmp_path)} if mode.startswith("file") else {}
    with KVStore(OffloadConfig(mode=mode, storage=storage, **fields), "cpu") as store:
        for key, (k, v) in layers.items():
            store.put(key, k, v)
        out = {key: tuple(t.clone() for t in store.get(key)) for key in layers}
        return out, store.stats()["kv_error"]


@pytest.mark.parametrize("mode", ["gpu", "ram_sync", "file_sync"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("storage", LOSSY)
def test_the_largest_finite_values_come_back_finite(storage, dtype, mode, tmp_path, ordering):
    big = torch.finfo(dtype).max
    k = torch.randn(SHAPE).to(dtype)
    k[0, 1, 0, 3], k[0, 2, 1, :] = big, -big  # one vector with the largest value, one all of its negative
    v = torch.full(SHAPE, big, dtype=dtype)
    served, error = serve(storage, {0: (k, v), 1: (torch.randn(SHAPE).to(dtype), torch.randn(SHAPE).to(dtype))},
                          mode, tmp_path)
    for got_k, got_v in served.values():
        assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all()
    if error["exact_layers"]:  # kept exact: the bits put
        assert bits_equal(served[0][0], k) and bits_equal(served[0][1], v)
        assert "past the dtype's range" in error["exact_why"]
    else:
        assert relative(k, served[0][0]) <= MAX_RELATIVE and relative(v, served[0][1]) <= MAX_RELATIVE
    assert all(math.isfinite(error[name]) for name in ("max_abs", "relative"))


def test_float32s_largest_value_under_int8_is_kept_exact_not_served_as_inf():
    k = torch.randn(SHAPE)
    k[0, 0, 0, 0] = torch.finfo(torch.float32).max
    served, error = serve("int8", {"layer": (k, torch.randn(SHAPE))})
    assert torch.isfinite(served["layer"][0]).all()
    assert bits_equal(served["layer"][0], k)  # max / 127 * 127 rounds past float32's range: kept exact
    assert error["exact_layers"] == 1 and "past the dtype's range" in error["exact_why"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("storage", LOSSY)
def test_a_layer_below_float32s_normal_range_is_kept_exact_not_zeroed(storage, dtype, ordering):
    tiny = (torch.randn(SHAPE) * 1e-40).to(dtype)  # subnormal: every scale floors at float32's smallest normal
    normal = torch.randn(SHAPE).to(dtype)
    served, error = serve(storage, {"tiny": (tiny, tiny.clone()), "normal": (normal, normal.clone())})
    assert (served["tiny"][0] != 0).any()
    if storage == "int8":  # a scale floored at 1.2e-38 over values of 1e-40: every one rounds to 0
        assert bits_equal(served["tiny"][0], tiny) and bits_equal(served["tiny"][1], tiny)
        assert error["exact_layers"] == 1 and "relative error above" in error["exact_why"]
        assert error["worst"]["layer"] == "'normal'"
    else:  # fp8 has exponents below 1: it holds them, within its error
        assert relative(tiny, served["tiny"][0]) <= MAX_RELATIVE
    assert error["worst"]["relative"] <= MAX_RELATIVE


def magnitudes(rng, dtype, n):
    """`n` finite values of `dtype` whose magnitudes are spread over its whole range, subnormals included."""
    info = torch.finfo(dtype)
    low, high = math.log10(info.smallest_normal) - 2, math.log10(info.max)
    values = [rng.choice([-1, 1]) * 10 ** rng.uniform(low, high) for _ in range(n)]
    t = torch.tensor(values, dtype=torch.float64).clamp(-info.max, info.max).to(dtype)
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


@pytest.mark.parametrize("seed", range(12))
def test_no_finite_input_decodes_to_a_non_finite_value_and_every_layer_is_held_or_kept(seed):
    rng = random.Random(seed)
    storage, dtype = rng.choice(LOSSY), rng.choice(DTYPES)
    layers = {}
    for i in range(4):
        shape = (1, rng.randint(1, 9), rng.choice([1, 3]), rng.choice([1, 8, 16]))
        n = math.prod(shape)
        # Whole vectors of one magnitude, others spread over the range, and vectors mixing both.
        k = magnitudes(rng, dtype, n).reshape(shape)
        v = (torch.randn(shape) * 10 ** rng.uniform(-30, 30)).to(dtype)
        layers[i] = (k, torch.where(torch.isfinite(v), v, torch.zeros_like(v)))
    served, error = serve(storage, layers)
    worst = 0.0
    for key, (k, v) in layers.items():
        got_k, got_v = served[key]
        assert torch.isfinite(got_k).all() and torch.isfinite(got_v).all(), (seed, key)
        if not (bits_equal(got_k, k) and bits_equal(got_v, v)):  # encoded: within the bound
            both = relative(torch.cat([k.flatten(), v.flatten()]), torch.cat([got_k.flatten(), got_v.flatten()]))
            assert both <= MAX_RELATIVE * 1.01, (seed, key, both)
            worst = max(worst, both)
    if error["worst"] is not None:
        assert error["worst"]["relative"] == pytest.approx(worst, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("name", LOSSY)
def test_holds_sees_a_decode_past_the_dtypes_range(name):
    codec = Codec(name)
    x = torch.randn(3, 8, dtype=torch.float16)
    assert bool(codec.holds(codec.encode(x), x))
    x[1, 2] = torch.finfo(torch.float16).max
    assert bool(codec.holds(codec.encode(x), x)) or name == "int8"  # fp16's max decodes within fp16 or not at all
    y = torch.randn(3, 8)
    y[0, 0] = torch.finfo(torch.float32).max
    encoded = codec.encode(y)
    decoded = torch.empty_like(y)
    codec.decode(encoded, decoded)
    assert bool(codec.holds(encoded, y)) == bool(torch.isfinite(decoded).all())
