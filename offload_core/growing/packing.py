"""Compact storage of growing layers: each committed block quantised per token and head, the token axis kept.

A block (B, n, H, D) is encoded by the store's codec (`codec.Codec`: one byte a value, one float32 scale a vector)
and packed as (B, n, H, D + 4) bytes: each vector's values, then its scale. So a packed block grows along its
tokens like the block itself, and every tier keeps, appends and loads it as it does an exact one (`tiers/blocks`):
a prefix of packed tokens comes back into a packed slot, and is decoded into the working pair on the device.
The error of every block is measured at commit (`codec.Compact`'s figures, `stats()["kv_error"]`); a block the
codec cannot hold (NaN or inf, values past the dtype's range, a relative error above `codec.MAX_RELATIVE`) is an
error, since a growing layer is kept one way throughout: such K/V needs storage 'exact'.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Hashable, Tuple

import torch

from ..store.codec import CHUNK_ELEMENTS, MAX_RELATIVE, SCALE_BYTES, Compact, _views, add_error
from ..host.devices import Fence


def packed_width(head_dim: int) -> int:
    return head_dim + SCALE_BYTES


def encode_block(compact: Compact, key: Hashable, x: torch.Tensor) -> torch.Tensor:
    """`x` (B, n, H, D) as packed bytes (B, n, H, D + 4) on its device, its error added to `compact`'s figures."""
    codec = compact.codec
    b, n, h, d = x.shape
    flat = codec.encode(x)
    q, scales = _views(flat, b * n * h, d, codec.qdtype)
    err = codec.error(x, flat)
    held, top, worst, sq_err, sq_ref = torch.cat([codec.holds(flat, x).reshape(1).float(), err]).tolist()
    relative = (sq_err / sq_ref) ** 0.5 if sq_ref > 0 else 0.0
    if not held or not relative <= MAX_RELATIVE:
        raise ValueError(f"KV offload: growing layer {key!r} got a block that storage {codec.name!r} cannot hold (NaN or "
                         "inf, values past the dtype's range, or far below float32's normal range); a growing layer "
                         "is kept one way throughout. Use storage 'exact' for this cache.")
    compact.total = err if compact.total is None else add_error(compact.total, err)
    if compact.worst is None or relative > compact.worst["relative"]:
        compact.worst = {"layer": repr(key)[:200], "relative": relative, "max_abs": worst * top}
    packed = torch.empty(b, n, h, packed_width(d), dtype=torch.uint8, device=x.device)
    packed[..., :d] = q.view(torch.uint8).view(b, n, h, d)
    packed[..., d:] = scales.view(torch.uint8).view(b, n, h, SCALE_BYTES)
    return packed


def decode_prefix(compact: Compact, packed: torch.Tensor, out: torch.Tensor) -> None:
    """Packed tokens (B, t, H, D + 4) into `out` (B, t, H, D) of the cache's dtype, as `Codec.decode` computes."""
    d = out.shape[-1]
    q, scales = packed[..., :d].view(compact.codec.qdtype), packed[..., d:].view(torch.float32)
    step = max(1, CHUNK_ELEMENTS // max(out[0, 0].numel(), 1))
    for start in range(0, out.shape[1], step):
        part = q[:, start:start + step].float().mul_(scales[:, start:start + step])
        out[:, start:start + step].copy_(part)


class Packing:
    """The codec side of one growing store: packs each committed block of its streamed layers, unpacks prefixes
    into the working pairs, and keeps each packed block alive until the copy out of it has run."""

    def __init__(self, compact: Compact):
        self.compact = compact
        self._in_flight: Deque[Tuple[Fence, Tuple[torch.Tensor, ...]]] = deque()

    @property
    def active(self) -> bool:
        return self.compact.codec is not None

    def pack(self, key: Hashable, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return encode_block(self.compact, key, k), encode_block(self.compact, key, v)

    def hold(self, fence: Fence, *tensors: torch.Tensor) -> None:
        """Keeps `tensors` (packed blocks a tier copies on its side stream) until `fence`: freed earlier, the caching
        allocator could hand their memory to a later kernel before the copy read it."""
        while self._in_flight and self._in_flight[0][0].done():
            self._in_flight.popleft()
        self._in_flight.append((fence, tensors))

    def unpack(self, pk: torch.Tensor, pv: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        decode_prefix(self.compact, pk, k)
        decode_prefix(self.compact, pv, v)

    def packed_pair(self, streams, pair: Tuple[int, int, int, int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """A slot's packed K and V at full capacity (B, S, H, D + 4) bytes, from the streams' allocator."""
        b, s, h, d = pair
        shape = (b, s, h, packed_width(d))
        return tuple(streams.empty(b * s * h * packed_width(d)).view(shape) for _ in range(2))

    def clear(self) -> None:
        """After the streams were drained (the store's close)."""
        self._in_flight.clear()
