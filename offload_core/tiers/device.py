"""The device tier (place `device`): layers stay on the consuming device, as upstream caches keep them (mode `gpu`,
and the resident layers of every mode)."""

from __future__ import annotations

from typing import Callable, Dict, Hashable, Tuple

import torch

from ..host.devices import DONE, Fence
from ..layout import LayerLayout, views
from ..places import DEVICE
from .base import Pending, Tier, TierContext


def check_unmodified(key: Hashable, version: int, served: int) -> None:
    """Refuses to serve a layer whose tensors were written in place since the store handed them out."""
    if version != served:
        raise RuntimeError(
            f"KVStore.get: the K/V of layer {key!r} returned by an earlier get were modified in place; the store "
            "serves its own buffers, which consumers must only read. Copy them first (e.g. torch.cat, .clone()) "
            "before changing them. This layer is not served again as it is; recompute the prefix.")


class DeviceTier(Tier):
    def __init__(self, ctx: TierContext):
        self._streams = ctx.streams
        self._layers: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor, int, LayerLayout]] = {}
        self._growing: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._bytes = 0

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        # A copy into one buffer of its own, V right after K: it owns its memory, so neither a larger parent tensor
        # is kept alive nor can a later in-place change by the caller reach the cache; and a consumer that wants the
        # pair stacked gets a view of it (`layout.stacked`), not a copy per get.
        k_bytes = k.numel() * k.element_size()
        v_at = -(-k_bytes // v.element_size()) * v.element_size()
        flat = torch.empty(v_at + v.numel() * v.element_size(), dtype=torch.uint8, device=k.device)
        k, v = (_place(flat, 0, k), _place(flat, v_at, v))
        self._layers[key] = (k, v, k._version + v._version, layout)
        self._bytes += layout.tensor_bytes

    def view(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        # These are the cache itself, not a copy: a consumer that wrote into them would change every later
        # step. The version counters say whether anyone did; the other tiers check their slots the same way.
        k, v, version, _ = self._layers[key]
        check_unmodified(key, k._version + v._version, version)
        return k, v

    def load(self, key: Hashable, slot: torch.Tensor, release: Fence) -> Pending:
        # On the consumer's stream, so after `release` without waiting for it: a slot's release fence is always
        # recorded on the consumer's stream (`SlotRing.release_current`, `SlotRing._fit`), and work queued on one
        # stream runs in order. The copy never overwrites what the consumer's kernels still read.
        k, v = self.view(key)
        dst_k, dst_v = views(slot, self._layers[key][3])
        self._streams.copy(dst_k, k)
        self._streams.copy(dst_v, v)
        return Pending(self._streams.record())

    # -- growing layers: kept at full capacity where the consumer computes, as upstream's own caches ----------
    def open_growing(self, key: Hashable, make: Callable[[], Tuple[torch.Tensor, torch.Tensor]]
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of growing layer `key` at full capacity (B, S, H, D), made by `make` the first time: the
        consumer's working buffers, written in place; tokens are kept once `append` says so (nothing moves)."""
        pair = self._growing.get(key)
        if pair is None:
            pair = self._growing[key] = make()
            self._bytes += 2 * pair[0].numel() * pair[0].element_size()
        return pair

    def append(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, at: int) -> Fence:
        own_k, own_v = self._growing[key]
        for own, t in ((own_k, k), (own_v, v)):
            dst = own[:, at:at + t.shape[1]]
            if dst.data_ptr() != t.data_ptr():  # else the consumer wrote the block in place: nothing to copy
                self._streams.copy(dst, t)
        return DONE  # on the consumer's stream: in order with whatever it does next

    def load_prefix(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, release: Fence) -> Pending:
        own_k, own_v = self._growing[key]
        self._streams.copy(k, own_k[:, :k.shape[1]])
        self._streams.copy(v, own_v[:, :v.shape[1]])
        return Pending(self._streams.record())

    def drop_growing(self, key: Hashable) -> None:
        pair = self._growing.pop(key, None)
        if pair is not None:
            self._bytes -= 2 * pair[0].numel() * pair[0].element_size()

    def nbytes(self) -> Dict[str, int]:
        return {DEVICE: self._bytes}

    def close(self) -> None:
        self._layers.clear()
        self._growing.clear()
        self._bytes = 0


def _place(flat: torch.Tensor, at: int, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `flat` from byte `at`, as a contiguous view of the same dtype and shape."""
    out = flat[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t.detach())
    return out
