"""What a store knows of its layers: how each is laid out as put and as kept, its place, and how it is served.

The store adds to it at every `put`; the ring (`ring.py`) reads it to serve each `get`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Set, Tuple

from .codec import Compact
from .layout import LayerLayout
from .places import BUDGET_PLACES, DEVICE, PLACES, budget_place


@dataclass
class Layers:
    compact: Compact  # the codec (None: exact storage) and the layers it keeps exact (NaN or inf)
    layouts: Dict[Hashable, LayerLayout] = field(default_factory=dict)  # as put (the slot's dtype)
    kept: Dict[Hashable, LayerLayout] = field(default_factory=dict)  # as stored (encoded, with a codec)
    where: Dict[Hashable, str] = field(default_factory=dict)  # the place of each layer
    resident: Set[Hashable] = field(default_factory=set)  # kept on the device, served without a load
    rows: Dict[Hashable, int] = field(default_factory=dict)  # layers kept as one row: the rows they are served as
    tried: Dict[Hashable, Set[str]] = field(default_factory=dict)  # places each key's puts went to, until settled

    def trying(self, key: Hashable, place: str) -> None:
        """A put of `key` hands it to the tier of `place` next (recorded first: a Ctrl-C may stop it there)."""
        self.tried.setdefault(key, set()).add(place)

    def add(self, key: Hashable, layout: LayerLayout, kept: LayerLayout, place: str, rows: int) -> None:
        """The layout last, in a line of its own: the key is put (and served) only once every other field is set,
        and a put that Ctrl-C stopped before that line sets them all again."""
        if rows > 1:
            self.rows[key] = rows
        else:
            self.rows.pop(key, None)
        if place == DEVICE:
            self.resident.add(key)
        else:
            self.resident.discard(key)
        self.kept[key], self.where[key] = kept, place
        self.layouts[key] = layout

    def strays(self) -> List[Tuple[Hashable, Set[str]]]:
        """Per key tried, the places whose tiers hold a copy that is never served: every place of a layer whose
        put Ctrl-C stopped, the others of one put after it was repeated elsewhere."""
        return [(key, places - {self.where[key]} if key in self.layouts else places)
                for key, places in list(self.tried.items())]

    def settle(self, key: Hashable) -> None:
        """Once its stray copies are dropped: forgets what `add` recorded of `key` if it never finished."""
        if key not in self.layouts:
            # One line (Ctrl-C comes between lines): forgotten whole or not at all, and then again at the next call.
            self.rows.pop(key, None), self.resident.discard(key), self.kept.pop(key, None), self.where.pop(key, None)
        del self.tried[key]

    # What follows counts the layers put, not one whose `add` a Ctrl-C stopped (until the store forgets it).
    def placement(self) -> Dict[str, int]:
        """Layers put so far, per place."""
        out = dict.fromkeys(PLACES, 0)
        for key, place in list(self.where.items()):  # a copy: stats() may run on another thread during puts
            if key in self.layouts:
                out[place] += 1
        return out

    def used(self) -> Dict[str, int]:
        """Bytes as kept, per budget place (what a plan's caps count)."""
        out = dict.fromkeys(BUDGET_PLACES, 0)
        for key in list(self.layouts):  # `add` sets `kept` and `where` first
            out[budget_place(self.where[key])] += self.kept[key].data_bytes
        return out

    def kept_bytes(self) -> int:
        return sum(kept.data_bytes for key, kept in list(self.kept.items()) if key in self.layouts)

    def resident_bytes(self) -> int:
        """Bytes of the resident layers' tensors, as the device tier keeps them."""
        return sum(self.kept[key].tensor_bytes for key in list(self.resident))  # (read once strays are settled)
