"""Identical batch rows: a layer whose every row of K and V equals row 0 is kept, moved and written once.

A batch of B images from one prompt and one set of references puts B bit-identical copies of each prefix
layer, shape `(B, ...)`. At `put` the store compares every row (along dim 0) of K and of V against row 0 on
the consuming device, in one pass, bit for bit: as integers of the same width, so that -0.0 and +0.0 differ
and a NaN matches only the same NaN, which float equality would get wrong. When all match, the tiers are
handed row 0 alone (dedup first, then the codec, which encodes that row); at `get` the row is moved into the
ring slot and broadcast to the B rows there, a copy on the device, so the consumer gets the `(B, ...)`
tensors that were put. A difference in any element of any row, in K or in V, keeps the layer whole.

The check needs its answer at `put`, so it waits for the device once per layer, on the capture step only;
`stats()["dedup"]["check_s"]` is its measured cost (the comparison and that wait, after the device had
finished the work queued before it). `OffloadConfig(dedup=False)` skips it.
"""

from __future__ import annotations

import time
from typing import Tuple

import torch

from ..host import devices
from ..layout import LayerLayout, layout_for

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integers, by element size


def batch_rows(k: torch.Tensor, v: torch.Tensor) -> int:
    """The rows (dim 0) a layer could be kept one of: K's first size when V's matches it, else 1.

    A layer with no elements, or a 0-d tensor, has nothing to share: 1."""
    if k.dim() == 0 or v.dim() == 0 or k.shape[0] != v.shape[0] or k.numel() == 0 or v.numel() == 0:
        return 1
    return k.shape[0]


def identical_rows(t: torch.Tensor) -> bool:
    """Whether every row of `t` (dim 0) has the bits of row 0; one pass over rows 1.., on `t`'s device."""
    bits = t.view(_BITS[t.element_size()])  # same element size: a reinterpreting view, any strides
    rest = bits[1:]
    return torch.equal(rest, bits[:1].expand_as(rest))


class RowDedup:
    """The check of one store and its counters (`stats()["dedup"]`)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.layers = 0  # layers kept as one row
        self.rows_put = 0
        self.rows_kept = 0
        self.saved_bytes = 0  # bytes of K and V as put that the store keeps no copy of
        self.check_s = 0.0

    def split(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(k, v, 1) as they are, or (row 0 of k, row 0 of v, B) when all B rows of both are identical.

        The rows returned are views of the caller's tensors: the tier takes its private copy of them."""
        rows = batch_rows(k, v) if self.enabled else 1
        put = k.shape[0] if k.dim() else 1
        same = rows > 1 and self._check(k, v)
        self.rows_put += put
        if not same:
            self.rows_kept += put
            return k, v, 1
        self.layers += 1
        self.rows_kept += 1
        self.saved_bytes += (k.nbytes + v.nbytes) * (rows - 1) // rows
        return k[:1], v[:1], rows

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        # The comparison returns to the host, so it waits for everything queued before it anyway (the kernels
        # that produced `k` and `v`): wait for that first, so that the time measured is the check's own, not
        # the model's, and so that the host reads the rows only once they are written.
        devices.wait_for_device(k.device)
        start = time.perf_counter()
        try:
            return identical_rows(k) and identical_rows(v)
        finally:
            self.check_s += time.perf_counter() - start

    def as_dict(self) -> dict:
        return {"enabled": self.enabled, "layers": self.layers, "rows_put": self.rows_put,
                "rows_kept": self.rows_kept, "saved_bytes": self.saved_bytes, "check_s": self.check_s}


def served_layout(k: torch.Tensor, v: torch.Tensor, row_k: torch.Tensor, row_v: torch.Tensor) -> LayerLayout:
    """The slot layout of a layer kept as one row (`row_k`, `row_v`), served as `k`, `v`: as `layout_for(k, v)`,
    but with V starting after the row's bytes as kept, so a tier copies the row into the slot's start (K's row
    lands where K's row 0 goes) and the ring (`SlotRing._expand`) broadcasts it there without a staging buffer."""
    row = layout_for(row_k, row_v)
    return layout_for(k, v, v_from=row.v.offset + row.v.nbytes)

