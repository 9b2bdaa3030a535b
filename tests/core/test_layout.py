"""`layout.copy_range`: any range of a layer's data section, from K/V of any layout, into a small buffer."""

import pytest
import torch

from offload_core.layout import _runs, copy_in, copy_range, layout_for, stacked
from store_helpers import tiers

SHAPES = [
    ("contiguous", lambda t: t),
    ("transposed", lambda t: t.transpose(1, 3)),
    ("every other", lambda t: t[:, :, ::2]),
    ("sliced rows", lambda t: t[:, 1:, 2:5]),
    ("expanded", lambda t: t[:, :1].expand(-1, 3, -1, -1)),
]


@pytest.mark.parametrize("name,make", SHAPES, ids=[s[0] for s in SHAPES])
def test_runs_cover_the_range_in_order_with_few_views(name, make):
    t = make(torch.arange(2 * 3 * 7 * 5, dtype=torch.float32).reshape(2, 3, 7, 5))
    flat = t.reshape(-1)
    for a in range(0, t.numel() + 1, 7):
        for b in range(a, t.numel() + 1, 11):
            runs = _runs(t, a, b)
            got = torch.cat([r.reshape(-1) for r in runs]) if runs else flat[:0]
            assert torch.equal(got, flat[a:b])
            assert len(runs) <= 2 * t.dim()
            assert all(r.data_ptr() >= t.data_ptr() - 8 * t.numel() for r in runs)  # views, not copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
@pytest.mark.parametrize("chunk", [4096, 12288])
def test_chunks_put_together_equal_the_whole_layer_and_zero_the_padding(dtype, chunk):
    k = (torch.randn(3, 5, 700) * 50).to(dtype).transpose(1, 2)
    v = (torch.randn(2, 333) * 50).to(dtype)[:, ::3]
    layout = layout_for(k, v)
    whole = torch.zeros(layout.data_bytes, dtype=torch.uint8)
    copy_in(whole, layout, k, v)
    out = torch.empty(layout.data_bytes, dtype=torch.uint8)
    for off in range(0, layout.data_bytes, chunk):
        end = min(off + chunk, layout.data_bytes)
        buffer = torch.full((chunk,), 0xAB, dtype=torch.uint8)  # stale bytes of an earlier chunk
        copy_range(buffer, layout, k, v, off, end)
        out[off:end] = buffer[:end - off]
    assert torch.equal(out, whole)  # padding included: zeros, whatever the buffer held


@pytest.mark.parametrize("make", [lambda x: x, torch._neg_view], ids=["plain", "negated view"])
def test_a_contiguous_host_range_is_copied_as_its_values(make):
    """Contiguous host K/V take the one-memmove path; a negated view (contiguous, but its bytes are not its
    values) must still come out negated."""
    k, v = make(torch.randn(64, 33)), make(torch.randn(2, 1000))
    assert k.is_contiguous() and v.is_contiguous()
    layout = layout_for(k, v)
    out = torch.full((layout.data_bytes,), 0xAB, dtype=torch.uint8)
    for off in range(0, layout.data_bytes, 5000):
        copy_range(out[off:], layout, k, v, off, min(off + 5000, layout.data_bytes))
    expected = torch.zeros(layout.data_bytes, dtype=torch.uint8)
    copy_in(expected, layout, k.resolve_neg(), v.resolve_neg())
    assert torch.equal(out, expected)


@pytest.mark.parametrize("start", [0, 4096, 3 << 20])  # a buffer at its storage's start, and slices of one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_typed_views_are_the_views_in_one_call_each(dtype, start):
    from offload_core.layout import TypedViews, typed_views, views

    k, v = torch.randn(2, 3, 50, 7).to(dtype), torch.randn(5, 1, 0).to(dtype)  # an empty V too
    for kk, vv in ((k, v), (k[0], k.reshape(-1)), (torch.tensor(3.0).to(dtype), k)):  # a scalar K
        layout = layout_for(kk, vv)
        storage = torch.full((start + layout.data_bytes + 4096,), 0xAB, dtype=torch.uint8)
        flat = storage[start:start + layout.data_bytes]  # as a host buffer is a slice of its mapping
        copy_in(flat, layout, kk, vv)
        typed = TypedViews(flat)
        for _ in range(2):  # the second time from the cache
            got, want = typed_views(typed, layout), views(flat, layout)
            for a, b in zip(got, want):
                assert (a.dtype, a.shape, a.stride(), a.data_ptr()) == (b.dtype, b.shape, b.stride(), b.data_ptr())
                assert torch.equal(a, b)
            assert torch.equal(got[0], kk) and torch.equal(got[1], vv)
        got[0].add_(1)
        assert got[0]._version == want[0]._version  # one version counter: an in-place write is still seen


def test_a_view_outside_its_buffer_is_refused():
    from offload_core import layout as lay

    k, v = torch.randn(3, 1000), torch.randn(3, 1000)
    layout = layout_for(k, v)
    flat = torch.zeros(layout.data_bytes + 8192, dtype=torch.uint8)[8192:]
    with pytest.raises(ValueError, match="does not fit"):
        lay.views(flat[:layout.data_bytes - 1], layout)
    with pytest.raises(ValueError, match="does not fit"):
        lay.typed_views(lay.TypedViews(flat[:layout.data_bytes - 4096]), layout)
    wrong = (flat[4096:].view(torch.float32)[:3000].view(3, 1000), flat[:12000].view(torch.float32).view(3, 1000))
    with pytest.raises(AssertionError, match="other bytes"):
        lay.check_within(flat, wrong, layout, 0)
    assert lay.CHECK_VIEWS  # the tests run with every view's address checked (tests/conftest.py)


def test_copy_range_refuses_a_range_its_buffer_cannot_hold():
    from offload_core.layout import copy_range

    k, v = torch.randn(3, 1000), torch.randn(3, 1000)
    layout = layout_for(k, v)
    with pytest.raises(ValueError, match="do not fit"):
        copy_range(torch.zeros(4095, dtype=torch.uint8), layout, k, v, 0, 4096)  # a shorter slice, silently
    with pytest.raises(ValueError, match="do not fit"):
        copy_range(torch.zeros(layout.data_bytes + 4096, dtype=torch.uint8), layout, k, v, 0, layout.data_bytes + 1)


@pytest.mark.parametrize("mode", ["ram_sync", "file_sync", "file_async"])
def test_a_tier_refuses_to_load_into_a_slot_too_small(mode, tmp_path):
    from offload_core import KVStore, OffloadConfig

    k, v = torch.randn(2, 3000), torch.randn(2, 3000)
    fields = {"file_dir": str(tmp_path)} if mode.startswith("file") else {}
    with KVStore(OffloadConfig(mode=mode, **fields), "cpu") as store:
        store.put(0, k, v)
        tier = next(iter(tiers(store).values()))
        with pytest.raises(ValueError, match="does not fit"):
            tier.load(0, torch.zeros(4096, dtype=torch.uint8), store._res.ring.slots[0].release)
        assert torch.equal(store.get(0)[0], k)  # the store serves on as before


def test_only_a_pair_kept_in_one_buffer_stacks_as_a_view():
    flat = torch.zeros(4096 * 2, dtype=torch.uint8)
    k, v = flat[:24].view(torch.float32).view(1, 2, 3), flat[4096:4120].view(torch.float32).view(1, 2, 3)
    k.copy_(torch.arange(6.0).view(1, 2, 3))
    v.copy_(-torch.arange(6.0).view(1, 2, 3))
    both = stacked(k, v)
    assert torch.equal(both, torch.stack([k, v], dim=1)) and both.untyped_storage().data_ptr() == flat.data_ptr()
    apart = torch.zeros(1, 2, 3)
    assert stacked(k, apart) is None  # another buffer
    assert stacked(v, k) is None  # V before K
    assert stacked(k, flat[4096:4120].view(torch.int32).view(1, 2, 3)) is None  # another dtype
    assert stacked(k, flat[4096:4120].view(torch.float32).view(1, 3, 2)) is None  # another shape
