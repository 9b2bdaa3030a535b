"""Compact storage: K/V quantised at `put`, dequantised into the device slot at load.

A codec sits between the cache's dtype and the bytes the tiers keep; the tiers never know. `encode` turns
one tensor into one flat uint8 tensor on the same device — the quantised values, then one float32 scale per
vector along the last dimension (per token and head, for both `(B, P, H, D)` and `(B, H, L, D)` layouts) —
so a tier keeps, copies and writes it like any other layer (`layout_for(encoded_k, encoded_v)`). `decode`
writes the values back in the original dtype into a caller's tensor. Work is done in chunks of rows, so the
float32 temporaries stay small next to the layer.

Lossy by design: `exact` (no codec) stays the default, and the error of every lossy layer is measured and
reported (`stats()["kv_error"]`; typical figures in docs/benchmark.md, "Engine measurements").

What a codec cannot hold is kept exact (`Compact.encode`), so that no finite input ever decodes to a
non-finite value and no layer comes back far from what was put:
- NaN or inf: an absmax scale cannot hold one (it would make its whole vector NaN, or be flushed to a finite
  number), and neither format has room to mark single elements without slowing every decode;
- a vector that would decode past its dtype's range (float32's largest value: max / 127 * 127 rounds to inf);
  `holds` sees both from the scales alone, no pass over the data;
- a layer whose relative error passes `MAX_RELATIVE` (values below float32's normal range, where every scale
  is floored at `TINY` and int8 rounds them all to 0).
So such values neither spread to their neighbours nor vanish; `stats()["kv_error"]` counts the layers kept
exact and why, and names the worst encoded layer beside the aggregate. `error` works in units of each vector's scale, so its sums stay in float32
range for any magnitude (no float64, which MPS lacks); `error_summary` turns them into plain floats.
"""

from __future__ import annotations

import logging
from typing import Dict, Hashable, Optional, Set, Tuple

import torch

log = logging.getLogger(__name__)

SCALE_BYTES = 4  # float32
CHUNK_ELEMENTS = 1 << 22  # float32 temporaries of at most 16 MiB
# The smallest normal float32: a vector of zeros (or of values below float32's normal range) gets this scale, so
# every scale is > 0 and finite exactly when its vector is.
TINY = torch.finfo(torch.float32).tiny


class Codec:
    """Per-vector absmax quantisation to one byte per value (`name`: "fp8" or "int8")."""

    def __init__(self, name: str):
        if name == "fp8":
            self.qdtype, self.qmax = torch.float8_e4m3fn, 448.0
        elif name == "int8":
            self.qdtype, self.qmax = torch.int8, 127.0
        else:
            raise ValueError(f"codec: unknown storage {name!r}; expected 'fp8' or 'int8'.")
        self.name = name

    @staticmethod
    def _rows(shape: Tuple[int, ...]) -> Tuple[int, int]:
        width = shape[-1] if shape else 1
        rows = 1
        for n in shape[:-1]:
            rows *= n
        return (rows, width) if width else (0, 0)  # no values: nothing kept, not even scales

    def encoded_bytes(self, shape: Tuple[int, ...]) -> int:
        rows, width = self._rows(shape)
        return _scale_offset(rows * width) + rows * SCALE_BYTES

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (floating point, any shape) -> a new flat uint8 tensor on `x`'s device; `x` is only read."""
        if not x.is_floating_point():
            raise TypeError(f"KVStore.put: storage {self.name!r} quantises floating-point K/V; got {x.dtype}. "
                            "Use storage='exact' for this cache.")
        rows, width = self._rows(tuple(x.shape))
        out = torch.empty(self.encoded_bytes(tuple(x.shape)), dtype=torch.uint8, device=x.device)
        src = x.reshape(rows, width)
        q, scales = _views(out, rows, width, self.qdtype)
        step = max(1, CHUNK_ELEMENTS // max(width, 1))
        for start in range(0, rows, step):
            part = src[start:start + step].float()
            scale = part.abs().amax(dim=1, keepdim=True).div_(self.qmax).clamp_min_(TINY)  # NaN stays NaN
            scaled = part / scale
            if self.qdtype is torch.int8:
                scaled = scaled.round_().clamp_(-self.qmax, self.qmax)
            q[start:start + step].copy_(scaled.to(self.qdtype))
            scales[start:start + step].copy_(scale)
        return out

    def decode(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        """Writes the values `encoded` holds into `out` (the original shape and dtype, same device)."""
        rows, width = self._rows(tuple(out.shape))
        q, scales = _views(encoded, rows, width, self.qdtype)
        dst = out.view(rows, width)
        step = max(1, CHUNK_ELEMENTS // max(width, 1))
        for start in range(0, rows, step):
            part = q[start:start + step].float().mul_(scales[start:start + step])
            dst[start:start + step].copy_(part)


    def holds(self, encoded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A 0-dim bool tensor on the device: True when decoding `encoded` gives finite values of `x`'s dtype.

        Reads the scales only: an absmax scale is NaN or inf exactly when its vector holds a NaN or an inf (or
        is beyond float32's range), and a decoded value is at most `qmax * scale`, computed as `decode` computes
        it, so a vector decodes within `x`'s dtype exactly when that product does (float32's largest value
        divided by 127 and multiplied back rounds past it: such a vector would come back as inf)."""
        rows, width = self._rows(tuple(x.shape))
        scales = _views(encoded, rows, width, self.qdtype)[1]
        top = torch.tensor(self.qmax, dtype=torch.float32, device=scales.device).mul(scales.amax() if rows else 0.0)
        return torch.isfinite(scales).all() & (top <= torch.finfo(x.dtype).max)

    def error(self, x: torch.Tensor, encoded: torch.Tensor) -> torch.Tensor:
        """The error of `encoded` against `x`: a float32 tensor [S, M, E, N] on x's device (no host sync).

        S is the largest scale; M = max |x - x'| / S, E = sum (x - x')^2 / S^2 and N = sum x^2 / S^2, where x'
        is what `decode` gives back in x's dtype. Each vector is measured in units of its own scale (|x| / scale
        <= qmax), then weighted by (scale / S)^2 <= 1, so no term overflows float32, whatever the magnitude.
        Totals over several tensors: `add_error`; plain figures: `error_summary`.
        """
        rows, width = self._rows(tuple(x.shape))
        q, scales = _views(encoded, rows, width, self.qdtype)
        src = x.reshape(rows, width)
        out = torch.zeros(4, dtype=torch.float32, device=x.device)
        step = max(1, CHUNK_ELEMENTS // max(width, 1))
        for start in range(0, rows, step):
            scale = scales[start:start + step]
            ref = src[start:start + step].float() / scale  # not in place: for float32 `x`, .float() is `x`
            diff = q[start:start + step].float().mul_(scale).to(x.dtype).float().div_(scale).sub_(ref)
            top = scale.max()
            w = scale / top
            part = torch.stack([top, (diff.abs().amax(dim=1, keepdim=True) * w).max(),
                                (diff.square().sum(dim=1, keepdim=True) * w.square()).sum(),
                                (ref.square().sum(dim=1, keepdim=True) * w.square()).sum()])
            out = add_error(out, part)
        return out


def _scale_offset(values: int) -> int:
    return (values + SCALE_BYTES - 1) // SCALE_BYTES * SCALE_BYTES  # float32 scales start 4-byte aligned


def _views(flat: torch.Tensor, rows: int, width: int, qdtype: torch.dtype):
    values = rows * width
    offset = _scale_offset(values)
    q = flat[:values].view(qdtype).view(rows, width)
    scales = flat[offset:offset + rows * SCALE_BYTES].view(torch.float32).view(rows, 1)
    return q, scales


def add_error(total: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """Two `Codec.error` results as one, still on the device: rescaled to the larger S, so nothing overflows."""
    top = torch.maximum(total[0], err[0]).clamp_min(TINY)
    a, b = total[0] / top, err[0] / top
    return torch.stack([top, torch.maximum(total[1] * a, err[1] * b),
                        total[2] * a.square() + err[2] * b.square(), total[3] * a.square() + err[3] * b.square()])


def error_summary(err: torch.Tensor) -> Dict[str, float]:
    """`{"max_abs", "relative"}` (relative: ||x - x'|| / ||x||) of an `add_error` total; one host sync."""
    top, worst, sq_err, sq_ref = err.tolist()
    return {"max_abs": worst * top, "relative": (sq_err / sq_ref) ** 0.5 if sq_ref > 0 else 0.0}


# A layer whose relative error (||x - x'|| / ||x|| over its K and V) would pass this is kept exact: the codec
# cannot hold it (values below float32's normal range, where every scale is floored at TINY and the values round
# to 0; an absmax that hides every other value of its vectors). Random data gives 2.6 % (fp8) and 0.7 % (int8).
MAX_RELATIVE = 0.25
_WHY = {"non_finite": "NaN or inf in K/V", "range": "values that would decode past the dtype's range",
        "error": f"a relative error above {MAX_RELATIVE:g} (e.g. values below float32's normal range)"}


class Compact:
    """A store's codec (None: exact storage) and what it measured over the layers put."""

    def __init__(self, codec: Optional[Codec], tag: str = ""):
        self.codec, self._tag = codec, tag
        self.total: Optional[torch.Tensor] = None  # `Codec.error` totals over every layer encoded
        self.exact: Set[Hashable] = set()  # layers kept as put under a codec: the codec cannot hold them
        self.why: Dict[str, int] = {}  # layers kept exact, by cause (`_WHY`)
        self.worst: Optional[Dict[str, object]] = None  # the encoded layer of the largest relative error

    def coded(self, key: Hashable) -> bool:
        """Layer `key` is kept encoded (a codec the layer fits): `get` decodes it into a slot."""
        return self.codec is not None and key not in self.exact

    def encode(self, key: Hashable, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V as the store keeps them: quantised on the device, before any byte moves, and the error
        measured; or, where the codec cannot hold them (NaN or inf, values that would decode past the dtype's
        range, an error above `MAX_RELATIVE`), as put (`key` joins `exact`). `k` and `v` are only read."""
        codec = self.codec
        ek, ev = codec.encode(k), codec.encode(v)
        err = add_error(codec.error(k, ek), codec.error(v, ev))
        # One host sync per layer put, lossy storage only (exact storage never syncs here): the capture
        # waits for this layer's encode before it queues the next layer.
        held = codec.holds(ek, k) & codec.holds(ev, v)
        held, top, worst, sq_err, sq_ref = torch.cat([held.reshape(1).float(), err]).tolist()
        relative = (sq_err / sq_ref) ** 0.5 if sq_ref > 0 else 0.0
        cause = None if held else "non_finite" if not bool(torch.isfinite(k).all() & torch.isfinite(v).all()) \
            else "range"
        if cause is None and not relative <= MAX_RELATIVE:
            cause = "error"
        if cause is not None:
            if not self.exact:
                log.warning("%s: layer %r holds %s, which storage %r cannot hold; this layer (and any other such) "
                            "is kept exact, see stats()['kv_error']", self._tag, key, _WHY[cause], codec.name)
            self.exact.add(key)
            self.why[cause] = self.why.get(cause, 0) + 1
            return k, v
        self.total = err if self.total is None else add_error(self.total, err)
        if self.worst is None or relative > self.worst["relative"]:
            self.worst = {"layer": repr(key)[:200], "relative": relative, "max_abs": worst * top}
        return ek, ev

    def summary(self) -> Optional[Dict[str, object]]:
        """Max absolute and relative error (‖x − x'‖ / ‖x‖) over the layers encoded, finite for any magnitude,
        the worst layer's, and the count of layers kept exact and why; None for exact storage."""
        if self.codec is None:
            return None
        out: Dict[str, object] = dict(error_summary(self.total)) if self.total is not None else \
            {"max_abs": 0.0, "relative": 0.0}  # one host sync, lossy storage only
        out["worst"] = dict(self.worst) if self.worst is not None else None
        out["exact_layers"] = len(self.exact)
        out["exact_why"] = "; ".join(f"{n} with {_WHY[c]}" for c, n in self.why.items()) + \
            f", which {self.codec.name} cannot hold" if self.exact else None
        return out


def codec_for(storage: str) -> Optional[Codec]:
    """The codec of an `OffloadConfig.storage` value; None for "exact" (bytes kept as they are)."""
    return None if storage == "exact" else Codec(storage)
