"""`gpu` tier: the cache stays on the consuming device, as upstream caches keep it. The baseline."""

from __future__ import annotations

from typing import Dict, Hashable, Tuple

import torch

from ..layout import LayerLayout
from .base import Tier, TierContext


class DeviceTier(Tier):
    name = "device"
    on_device = True

    def __init__(self, ctx: TierContext):
        self._layers: Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._bytes = 0

    def store(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, layout: LayerLayout) -> None:
        # A contiguous clone: owns its memory, so neither a larger parent tensor is kept alive nor can a later
        # in-place change by the caller reach the cache.
        self._layers[key] = (k.detach().clone(memory_format=torch.contiguous_format),
                             v.detach().clone(memory_format=torch.contiguous_format))
        self._bytes += layout.k.nbytes + layout.v.nbytes

    def view(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._layers[key]

    def nbytes(self) -> Dict[str, int]:
        return {"device": self._bytes}

    def close(self) -> None:
        self._layers.clear()
        self._bytes = 0
