"""Compact storage: about half the bytes of bf16, errors within the stated bounds, the dtype put comes back."""

import pytest
import torch

from offload_core.store.codec import Codec
from offload_core.layout import layout_for

BOUNDS = {"fp8": 0.04, "int8": 0.015}


def relative_error(x, y):
    return ((x.float() - y.float()).norm() / x.float().norm()).item()


@pytest.mark.parametrize("name", ["fp8", "int8"])
@pytest.mark.parametrize("shape", [(1, 512, 4, 128), (2, 4, 300, 64)], ids=["BPHD", "BHLD"])
def test_round_trip_error_and_bytes(name, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    codec = Codec(name)
    encoded = codec.encode(x)
    assert encoded.dtype == torch.uint8 and encoded.dim() == 1
    y = torch.full_like(x, float("nan"))
    codec.decode(encoded, y)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert relative_error(x, y) <= BOUNDS[name]
    # What a tier keeps: the encoded K and V in the store's flat layout, against exact K and V.
    kept = layout_for(encoded, encoded).data_bytes / layout_for(x, x).data_bytes
    assert kept <= 0.55


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_scales_are_per_vector(name):
    # One row 1000x larger than the others: a shared scale would flush the small rows to zero.
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    x[3] *= 1000
    y = torch.empty_like(x)
    Codec(name).decode(Codec(name).encode(x), y)
    for row in range(8):
        assert relative_error(x[row], y[row]) <= BOUNDS[name] * 2


def test_zeros_and_chunks_round_trip(monkeypatch):
    import offload_core.store.codec as codec_module

    monkeypatch.setattr(codec_module, "CHUNK_ELEMENTS", 64)  # several chunks even for a small tensor
    x = torch.randn(3, 50, 32, generator=torch.Generator().manual_seed(2)).half()
    x[1] = 0
    y = torch.empty_like(x)
    codec = Codec("int8")
    codec.decode(codec.encode(x), y)
    assert torch.equal(y[1], x[1]) and relative_error(x, y) <= BOUNDS["int8"]


def test_integer_tensors_are_refused():
    with pytest.raises(TypeError, match="storage 'int8' quantises floating-point"):
        Codec("int8").encode(torch.ones(2, 4, dtype=torch.int32))
