"""`gpu` tier: the cache stays on the consuming device, as upstream caches keep it. The baseline."""

from __future__ import annotations

from typing import Dict, Hashable, Tuple

import torch

from ..layout import LayerLayout
from .base import Tier, TierContext, check_unmodified


class DeviceTier(Tier):
    name = "device"
    on_device = True

    def __init__(self, ctx: TierContext):
        self._layers: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._bytes = 0

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        # A contiguous clone: owns its memory, so neither a larger parent tensor is kept alive nor can a later
        # in-place change by the caller reach the cache.
        k, v = (k.detach().clone(memory_format=torch.contiguous_format),
                v.detach().clone(memory_format=torch.contiguous_format))
        self._layers[key] = (k, v, k._version + v._version)
        self._bytes += layout.k.nbytes + layout.v.nbytes

    def view(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        # These are the cache itself, not a copy: a consumer that wrote into them would change every later
        # step. The version counters say whether anyone did; the other tiers check their slots the same way.
        k, v, version = self._layers[key]
        check_unmodified(key, k._version + v._version, version)
        return k, v

    def nbytes(self) -> Dict[str, int]:
        return {"device": self._bytes}

    def close(self) -> None:
        self._layers.clear()
        self._bytes = 0
