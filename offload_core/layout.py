"""How one layer's K and V sit in a flat byte buffer, and the safetensors header that describes it.

The same layout is used on the device (ring slots), in host RAM and on disk, so every copy between tiers is
one contiguous copy of `data_bytes`. K and V start on 4 KiB boundaries; on disk the header is padded with
spaces (allowed by the safetensors format) so the data starts on a 4 KiB boundary too, and explicit `U8`
padding entries keep the file fully indexed, as safetensors readers require.
"""

from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass
from typing import Dict, List, Tuple

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


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int  # from the start of the data section
    nbytes: int


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
    """K and V as views into the uint8 buffer `flat`, whose data section starts at byte `base`."""
    out = []
    for spec in layout.specs:
        start = base + spec.offset
        out.append(flat[start:start + spec.nbytes].view(spec.dtype).view(spec.shape))
    return out[0], out[1]


def typed_views(flat: torch.Tensor, layout: LayerLayout,
                typed: Dict[torch.dtype, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """`views(flat, layout)`, in one torch call per tensor: `typed` keeps `flat` viewed as each dtype (the
    caller's cache, to be emptied when `flat` changes), and K and V are strided views of that.

    For the tensors a `get` serves, made fresh every time (a consumer may change a view's shape in place), in
    as few torch calls as possible: each one releases the GIL and has to win it back from the I/O threads
    (figures in docs/benchmark.md, "Engine measurements")."""
    out = []
    for spec in layout.specs:
        whole = typed.get(spec.dtype)
        if whole is None:
            whole = typed[spec.dtype] = flat.view(spec.dtype)
        stride, n = [], 1
        for size in reversed(spec.shape):
            stride.append(n)
            n *= max(size, 1)  # as torch counts the strides of a shape with a 0 in it
        out.append(whole.as_strided(spec.shape, stride[::-1], spec.offset // whole.element_size()))
    return out[0], out[1]


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
    core and waits for the slowest part, which beside busy I/O and hash threads is far slower than one memmove
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
