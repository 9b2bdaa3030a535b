"""What a store knows of its layers: how each is laid out as put and as kept, its place, and how it is served.

The store adds to it at every `put`; the ring (`ring.py`) reads it to serve each `get`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, Set

from .codec import Compact
from ..layout import LayerLayout
from ..places import BUDGET_PLACES, DEVICE, PLACES, budget_place


@dataclass
class Layers:
    compact: Compact  # the codec (None: exact storage) and the layers it keeps exact (NaN or inf)
    layouts: Dict[Hashable, LayerLayout] = field(default_factory=dict)  # as put (the slot's dtype)
    kept: Dict[Hashable, LayerLayout] = field(default_factory=dict)  # as stored (encoded, with a codec)
    where: Dict[Hashable, str] = field(default_factory=dict)  # the place of each layer
    resident: Set[Hashable] = field(default_factory=set)  # kept on the device, served without a load
    rows: Dict[Hashable, int] = field(default_factory=dict)  # layers kept as one row: the rows they are served as

    def add(self, key: Hashable, layout: LayerLayout, kept: LayerLayout, place: str, rows: int) -> None:
        """The layout last: a key is put (and served) once every other field is set."""
        if rows > 1:
            self.rows[key] = rows
        if place == DEVICE:
            self.resident.add(key)
        self.kept[key], self.where[key] = kept, place
        self.layouts[key] = layout

    def placement(self) -> Dict[str, int]:
        """Layers put so far, per place."""
        out = dict.fromkeys(PLACES, 0)
        for place in list(self.where.values()):  # a copy: stats() may run on another thread during puts
            out[place] += 1
        return out

    def used(self) -> Dict[str, int]:
        """Bytes as kept, per budget place (what a plan's caps count)."""
        out = dict.fromkeys(BUDGET_PLACES, 0)
        for key in list(self.layouts):  # `add` sets `kept` and `where` first
            out[budget_place(self.where[key])] += self.kept[key].data_bytes
        return out

    def kept_bytes(self) -> int:
        return sum(kept.data_bytes for kept in list(self.kept.values()))

    def resident_bytes(self) -> int:
        """Bytes of the resident layers' tensors, as the device tier keeps them."""
        return sum(self.kept[key].tensor_bytes for key in list(self.resident))
