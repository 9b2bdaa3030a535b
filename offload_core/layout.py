"""How one layer's K and V sit in a flat byte buffer, and the safetensors header that describes it.

The same layout is used on the device (ring slots), in host RAM and on disk, so every copy between tiers is
one contiguous copy of `data_bytes`. K and V start on 4 KiB boundaries; on disk the header is padded with
spaces (allowed by the safetensors format) so the data starts on a 4 KiB boundary too, and explicit `U8`
padding entries keep the file fully indexed, as safetensors readers require.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

ALIGN = 4096
NAMES = ("k", "v")

_DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, as torch counts them where a size is 0."""
    stride, n = [], 1
    for size in reversed(shape):
        stride.append(n)
        n *= max(size, 1)
    return tuple(stride[::-1])


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # from the start of the data section
    nbytes: int
    stride: Tuple[int, ...] = field(init=False, compare=False)  # a contiguous tensor's, counted once

    def __post_init__(self) -> None:
        object.__setattr__(self, "stride", _contiguous_stride(self.shape))


@dataclass(frozen=True)
class LayerLayout:
    k: TensorSpec
    v: TensorSpec
    data_bytes: int  # both tensors with alignment, a multiple of ALIGN: what a flat buffer of the layer holds

    @property
    def tensor_bytes(self) -> int:
        """K and V without alignment: what two tensors of the layer hold (the device tier keeps two)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def specs(self) -> Tuple[TensorSpec, TensorSpec]:
        return (self.k, self.v)


def layout_for(k: torch.Tensor, v: torch.Tensor, v_from: int = 0) -> LayerLayout:
    """K at 0, V at the next 4 KiB boundary after K (and at or after byte `v_from`)."""
    for name, t in (("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"KVStore.put: `{name}` has dtype {t.dtype}, which the store cannot hold; "
                            f"supported: {', '.join(str(d) for d in _DTYPES)}.")
    k_bytes = k.numel() * k.element_size()
    v_bytes = v.numel() * v.element_size()
    v_off = _align(max(k_bytes, v_from))
    return LayerLayout(
        TensorSpec(k.dtype, tuple(k.shape), 0, k_bytes),
        TensorSpec(v.dtype, tuple(v.shape), v_off, v_bytes),
        _align(v_off + v_bytes),
    )


def views(flat: torch.Tensor, layout: LayerLayout, base: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V as views into the uint8 buffer `flat`, whose data section starts at byte `base`.

    Raises `ValueError` when the layer does not fit in `flat` from `base` (a slice would silently be shorter)."""
    check_fits(flat.numel(), layout, base)
    out = []
    for spec in layout.specs:
        start = base + spec.offset
        out.append(flat[start:start + spec.nbytes].view(spec.dtype).view(spec.shape))
    if CHECK_VIEWS:
        check_within(flat, out, layout, base)
    return out[0], out[1]


class TypedViews:
    """A flat uint8 buffer viewed once as each dtype served from it, for `typed_views`; made anew (never reused)
    when the buffer changes.

    `as_strided` counts its offset from the start of the *storage*, not of the tensor it is called on, and a
    buffer is often a slice of a larger storage (a host buffer starts at its first huge page inside its
    mapping): so each dtype's view is kept with its own storage offset, added to every layer offset."""

    __slots__ = ("flat", "nbytes", "_typed")

    def __init__(self, flat: torch.Tensor):
        if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"TypedViews: the buffer must be a flat contiguous uint8 tensor; got {flat.dtype} "
                             f"of shape {tuple(flat.shape)}.")
        self.flat, self.nbytes = flat, flat.numel()
        self._typed: Dict[torch.dtype, Tuple[torch.Tensor, int]] = {}

    def of(self, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
        """`flat` viewed as `dtype` and the storage offset (in elements of `dtype`) of its first byte."""
        got = self._typed.get(dtype)
        if got is None:
            whole = self.flat.view(dtype)
            got = self._typed[dtype] = (whole, whole.storage_offset())
        return got


def typed_views(buffer: TypedViews, layout: LayerLayout) -> Tuple[torch.Tensor, torch.Tensor]:
    """`views(buffer.flat, layout)`, in one torch call per tensor: strided views of the buffer's typed views.

    For the tensors a `get` serves, made fresh every time (a consumer may change a view's shape in place), in
    as few torch calls as possible: each one releases the GIL and has to win it back from the I/O threads
    (figures in docs/benchmark.md, "Engine measurements")."""
    check_fits(buffer.nbytes, layout, 0)
    out = []
    for spec in layout.specs:
        whole, first = buffer.of(spec.dtype)
        out.append(whole.as_strided(spec.shape, spec.stride, first + spec.offset // whole.element_size()))
    if CHECK_VIEWS:
        check_within(buffer.flat, out, layout, 0)
    return out[0], out[1]


def stacked(k: torch.Tensor, v: torch.Tensor) -> Optional[torch.Tensor]:
    """K and V as one (B, 2, ...) tensor, as `torch.stack([k, v], dim=1)` would give, but a view without a copy:
    for a pair the store serves from one buffer (V after K, alike in dtype and shape, both contiguous). None for
    any other pair."""
    gap, size = v.data_ptr() - k.data_ptr(), k.element_size()
    if (k.dtype != v.dtype or k.shape != v.shape or k.dim() == 0 or gap < 0 or gap % size or not k.is_contiguous()
            or not v.is_contiguous() or k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()):
        return None
    return k.as_strided((k.shape[0], 2, *k.shape[1:]), (k.stride(0), gap // size, *k.stride()[1:]))


# Every view handed out is also checked against the buffer's address range (`check_within`): set by the tests
# (tests/conftest.py) and by KV_OFFLOAD_CHECK_VIEWS=1. Off by default: `check_fits`, always on, already proves
# the range from the sizes; this proves the address arithmetic too, at two address reads per view.
CHECK_VIEWS = os.environ.get("KV_OFFLOAD_CHECK_VIEWS", "") == "1"


def check_fits(available: int, layout: LayerLayout, base: int) -> None:
    """Raises `ValueError` unless the layer's data section fits in `available` bytes from byte `base`: before any
    copy into a buffer, whose slices would otherwise silently come out shorter."""
    if base < 0 or base + layout.data_bytes > available:
        raise ValueError(f"KV offload: a layer of {layout.data_bytes} bytes from byte {base} does not fit in a "
                         f"buffer of {available} bytes; this is a bug in the store, please report it.")


def check_within(flat: torch.Tensor, got, layout: LayerLayout, base: int) -> None:
    """Raises `AssertionError` unless each view in `got` starts exactly where its spec says inside `flat` (from
    byte `base`) and ends inside it: the guard against a view of the wrong bytes, whatever built it."""
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for spec, t in zip(layout.specs, got):
        if spec.nbytes == 0 and t.nbytes == 0:
            continue  # an empty view has no address (torch gives it 0) and serves no bytes
        at = t.data_ptr()
        if at != start + base + spec.offset or at + spec.nbytes > end or t.nbytes != spec.nbytes:
            raise AssertionError(
                f"KV offload: a view of {spec.nbytes} bytes meant for byte {base + spec.offset} of a buffer of "
                f"{end - start} bytes starts at byte {at - start}: it would serve other bytes.")


def copy_in(flat: torch.Tensor, layout: LayerLayout, k: torch.Tensor, v: torch.Tensor, non_blocking: bool = False) -> None:
    """Copies `k` and `v` into their places in `flat` (any device to any device)."""
    dst_k, dst_v = views(flat, layout)
    dst_k.copy_(k, non_blocking=non_blocking)
    dst_v.copy_(v, non_blocking=non_blocking)


def copy_range(dst: torch.Tensor, layout: LayerLayout, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
               non_blocking: bool = False) -> None:
    """Copies the bytes [start, end) of the layer's data section into `dst` (a uint8 buffer, from its byte 0).

    `copy_in`, one range of it, so a layer can go out chunk by chunk through a small buffer. Any layout of `k`
    and `v` works: a strided tensor is copied as the few strided views that cover the range (at most two per
    dimension), a contiguous one as one. The padding in the range is zeroed, so the bytes are the same for the
    same K and V whatever the buffer held before.
    """
    if not 0 <= start <= end <= layout.data_bytes or dst.numel() < end - start:
        raise ValueError(f"KV offload: bytes [{start}, {end}) of a layer of {layout.data_bytes} bytes do not fit in "
                         f"a buffer of {dst.numel()} bytes; this is a bug in the store, please report it.")
    at = start
    for spec, t in zip(layout.specs, (k, v)):
        lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
        if lo < hi:
            if lo > at:
                dst[at - start:lo - start].zero_()
            size = t.element_size()
            pos = lo - start
            for run in _runs(t, (lo - spec.offset) // size, (hi - spec.offset) // size):
                n = run.numel() * size
                _copy_run(dst[pos:pos + n], run, non_blocking)
                pos += n
            at = hi
    if end > at:
        dst[at - start:end - start].zero_()


def _copy_run(dst: torch.Tensor, run: torch.Tensor, non_blocking: bool) -> None:
    """`dst` (bytes) <- `run`. Host to host, a contiguous tensor goes as one memmove on this thread, with the
    GIL released (not a negated view, whose bytes are not its values): torch splits a large copy over every
    core and waits for the slowest part, which beside busy I/O threads is far slower than one memmove
    (figures in docs/benchmark.md, "Engine measurements")."""
    if dst.device.type == "cpu" and run.device.type == "cpu" and run.is_contiguous() and not run.is_neg():
        if dst.numel():
            ctypes.memmove(dst.data_ptr(), run.data_ptr(), dst.numel())
        return
    dst.view(run.dtype).view(run.shape).copy_(run, non_blocking=non_blocking)


def _runs(t: torch.Tensor, a: int, b: int) -> List[torch.Tensor]:
    """Views of `t` that hold its elements [a, b) (in row-major order), in that order."""
    if a >= b:
        return []
    if t.dim() <= 1 or t.is_contiguous():
        return [t.reshape(-1)[a:b]]  # a view: contiguous, or one dimension
    inner = t[0].numel()
    first, last = -(-a // inner), b // inner  # the whole rows in [a, b)
    if first > last:  # [a, b) lies inside one row
        row = a // inner
        return _runs(t[row], a - row * inner, b - row * inner)
    out = _runs(t[first - 1], a - (first - 1) * inner, inner) if a < first * inner else []
    if last > first:
        out.append(t[first:last])
    if b > last * inner:
        out += _runs(t[last], 0, b - last * inner)
    return out


def safetensors_header(layout: LayerLayout, metadata: Dict[str, str]) -> bytes:
    """The 8-byte length plus JSON header, padded so the data section starts on a 4 KiB boundary."""
    entries: Dict[str, object] = {"__metadata__": metadata}
    end = 0
    for name, spec in zip(NAMES, layout.specs):
        if spec.offset > end:
            entries[f"_pad_{name}"] = {"dtype": "U8", "shape": [spec.offset - end], "data_offsets": [end, spec.offset]}
        end = spec.offset + spec.nbytes
        entries[name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [spec.offset, end]}
    if layout.data_bytes > end:
        entries["_pad_end"] = {"dtype": "U8", "shape": [layout.data_bytes - end], "data_offsets": [end, layout.data_bytes]}
    body = json.dumps(entries, separators=(",", ":")).encode()
    total = _align(8 + len(body))
    body = body + b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body
