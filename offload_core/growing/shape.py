"""The shape of a growing cache: every layer's working pair, and its size in bytes (defined here once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch


@dataclass(frozen=True)
class GrowingShape:
    """Every layer's working pair: K and V of (batch, capacity, heads, head_dim) in `dtype`."""

    batch: int
    capacity: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def pair(self) -> Tuple[int, int, int, int]:
        return (self.batch, self.capacity, self.heads, self.head_dim)

    def bytes(self, tokens: int) -> int:
        """K and V of `tokens` tokens of one layer."""
        return 2 * self.batch * tokens * self.heads * self.head_dim * torch.empty(0, dtype=self.dtype).element_size()


def working_pair(streams, shape: GrowingShape) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer at full capacity on the device (from the caching allocator on the current stream)."""
    half = shape.bytes(shape.capacity) // 2
    return tuple(streams.empty(half).view(shape.dtype).view(shape.pair) for _ in range(2))
