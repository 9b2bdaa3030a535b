"""The RAM tier (places `host_pinned` and `host_pageable`, one instance each): one page-aligned buffer per layer.

Synchronous (`ram_sync`, and every copy when the device is not CUDA): blocking copies on the current stream.
Asynchronous (`ram_async` on CUDA): buffers are pinned within the budget; device->host and host->device copies
run on the store's side stream, ordered by events, so the consumer's stream never waits on the host.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Deque, Dict, Hashable, List, Tuple

import torch

from ..host.devices import DONE, Fence, Streams
from ..host.hostmem import HostBuffer
from ..layout import LayerLayout, check_fits, layout_for, views
from ..places import PAGEABLE, PINNED
from .base import LOADED, Pending, Tier, TierContext
from .blocks import Block, covering, into, next_at


class RamTier(Tier):
    def __init__(self, ctx: TierContext):
        self._ctx = ctx
        self._layers: Dict[Hashable, Tuple[HostBuffer, LayerLayout]] = {}
        self._offloads: Deque[Fence] = deque()  # device->host copies still running, oldest first
        self._host_to_host = ctx.streams.immediate and ctx.device.type == "cpu"  # a CPU device: no streams at all
        self._grown: Dict[Hashable, List[Tuple[HostBuffer, Block]]] = {}  # growing layers: a buffer per block

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        ctx = self._ctx
        streams = ctx.streams
        buf = ctx.allocator.alloc(layout.data_bytes)
        side = streams.side
        if side is None:
            with streams.timed("transfer"):
                _copy_layer(streams, buf.tensor, layout, k, v)  # blocking: the private copy exists on return
            self._keep(key, buf, layout)
            return
        # Snapshot on the producer's stream first (a device-to-device copy, ~100x faster than the link): later
        # kernels on that stream may overwrite `k`/`v`, and they are not ordered after our side stream.
        snap = streams.empty(layout.data_bytes)
        _copy_layer(streams, snap, layout, k, v)
        self._bound_offloads(ctx.depth + 1)
        streams.record().make_wait(side)  # the side stream must not read `snap` before it is written
        with streams.on_side(), streams.timed("transfer", side):
            streams.copy(buf.tensor, snap, non_blocking=buf.pinned)
        # `snap` is freed by Python below while the copy may still run: record_stream on the stream that reads
        # it keeps the caching allocator from handing its memory out before that copy has finished.
        streams.record_stream(snap, side)
        self._offloads.append(streams.record(side))
        self._keep(key, buf, layout)

    def _keep(self, key: Hashable, buf: HostBuffer, layout: LayerLayout) -> None:
        self._layers[key] = (buf, layout)

    def _free(self, buf: HostBuffer) -> None:
        self._bound_offloads(0)  # every device-to-host copy ended: none still writes into `buf`
        self._ctx.allocator.free(buf)

    def _bound_offloads(self, limit: int) -> None:
        """Keeps at most `limit` snapshots in flight, so offloading never holds the whole cache on the device."""
        while self._offloads and (len(self._offloads) >= limit or self._offloads[0].done()):
            self._offloads.popleft().synchronize()

    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        ctx = self._ctx
        buf, layout = self._layers[key]
        check_fits(slot.numel(), layout, 0)  # a slice of a smaller slot would come out shorter
        if self._host_to_host:
            # No stream to order and both sides in this process's memory: one memmove, without the torch calls
            # (a slice and a copy) that cost several times the copy of a small layer.
            with ctx.streams.timed("transfer"):
                ctypes.memmove(slot.data_ptr(), buf.tensor.data_ptr(), layout.data_bytes)
            return LOADED
        side = ctx.streams.side
        with ctx.streams.on_side():
            release.make_wait(side)  # no-op without a side stream: the current stream is already in order
            with ctx.streams.timed("transfer", side):
                ctx.streams.copy(slot[:layout.data_bytes], buf.tensor, non_blocking=buf.pinned and side is not None)
            return Pending(ctx.streams.record(side))

    # -- growing layers ------------------------------------------------------------------------------------------
    def append(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, at: int) -> Fence:
        blocks = self._grown.setdefault(key, [])
        next_at([b for _, b in blocks], key, at, k.shape[1])
        ctx, streams = self._ctx, self._ctx.streams
        layout = layout_for(k, v)
        buf = ctx.allocator.alloc(layout.data_bytes)
        side = streams.side
        try:
            if side is None:
                with streams.timed("transfer"):
                    _copy_layer(streams, buf.tensor, layout, k, v)
            else:
                # `k`/`v` may be a view of a ring slot: a load into that slot is queued on the side stream after
                # this copy (first in first out), so no snapshot is needed (and none is bounded: the host never
                # waits here); the wait orders the copy after the consumer's kernels that wrote the block.
                while self._offloads and self._offloads[0].done():
                    self._offloads.popleft()
                streams.record().make_wait(side)
                with streams.on_side(), streams.timed("transfer", side):
                    dst_k, dst_v = views(buf.tensor, layout)
                    streams.copy(dst_k, k, non_blocking=buf.pinned)
                    streams.copy(dst_v, v, non_blocking=buf.pinned)
                self._offloads.append(streams.record(side))
        except BaseException:
            self._free(buf)
            raise
        blocks.append((buf, Block(at, k.shape[1], layout)))
        return self._offloads[-1] if side is not None else DONE

    def load_prefix(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, release: Fence) -> Pending:
        held = dict((id(b), buf) for buf, b in self._grown.get(key, []))
        blocks = covering([b for _, b in self._grown.get(key, [])], k.shape[1], key)
        streams = self._ctx.streams
        side = streams.side
        with streams.on_side():
            release.make_wait(side)
            with streams.timed("transfer", side):
                for block in blocks:
                    buf = held[id(block)]
                    src_k, src_v = views(buf.tensor, block.layout)
                    dst_k, dst_v = into(k, v, block)
                    streams.copy(dst_k, src_k, non_blocking=buf.pinned and side is not None)
                    streams.copy(dst_v, src_v, non_blocking=buf.pinned and side is not None)
            return Pending(streams.record(side)) if side is not None or not self._host_to_host else LOADED

    def drop_growing(self, key: Hashable) -> None:
        for buf, _ in self._grown.pop(key, []):
            self._free(buf)

    def nbytes(self) -> Dict[str, int]:
        buffers = [b for b, _ in list(self._layers.values())]  # one atomic snapshot: stats() may run on any thread
        buffers += [b for blocks in list(self._grown.values()) for b, _ in list(blocks)]
        pinned = sum(b.nbytes for b in buffers if b.pinned)
        pageable = sum(b.nbytes for b in buffers if not b.pinned)
        return {PINNED: pinned, PAGEABLE: pageable}

    def close(self) -> None:
        # Every copy touching our buffers is on the side stream; the store synchronized it before calling us.
        self._offloads.clear()
        for buf, _ in self._layers.values():
            self._ctx.allocator.free(buf)
        self._layers.clear()
        for blocks in self._grown.values():
            for buf, _ in blocks:
                self._ctx.allocator.free(buf)
        self._grown.clear()


def _copy_layer(streams: Streams, flat: torch.Tensor, layout: LayerLayout, k: torch.Tensor, v: torch.Tensor) -> None:
    """`k` and `v` into their places in `flat`, queued on the current stream."""
    dst_k, dst_v = views(flat, layout)
    streams.copy(dst_k, k)
    streams.copy(dst_v, v)
