"""Policy as plain functions over plain data: which layers come next (`LayerOrder`).

Where each layer is kept is the placement plan's business (`plan.py`); its names are re-exported here for
code written against the first version. Nothing here moves memory; `store.py` asks and the tiers act.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, List

from .plan import ASSUMED_LAYERS, GiB, RESERVE_BYTES, choose_tier, fits, resolve  # noqa: F401 (re-exports)

__all__ = ["ASSUMED_LAYERS", "GiB", "LayerOrder", "RESERVE_BYTES", "choose_tier", "fits", "resolve"]


class LayerOrder:
    """Learns the order in which layers are consumed and predicts the next ones.

    Starts from the order of `put`s; after each full pass of `get`s (a layer seen again starts a new pass)
    the observed pass replaces it, so skipped blocks or a double-then-single order are followed.
    """

    def __init__(self) -> None:
        self.order: List[Hashable] = []
        self._index: Dict[Hashable, int] = {}
        self._pass: List[Hashable] = []
        self._seen: set = set()

    def add(self, key: Hashable) -> None:
        self._index[key] = len(self.order)
        self.order.append(key)

    def observe(self, key: Hashable) -> None:
        if self._pass and self._pass[-1] == key:
            return  # the same layer asked for again is not a new pass
        if key in self._seen:
            if self._pass != self.order and self._pass:
                self.order = list(self._pass)
                self._index = {k: i for i, k in enumerate(self.order)}
            self._pass, self._seen = [], set()
        self._pass.append(key)
        self._seen.add(key)

    def ahead(self, key: Hashable, n: int, skip: Iterable[Hashable] = ()) -> List[Hashable]:
        """Up to `n` layers expected after `key`, wrapping into the next step, never `key` itself.

        Layers in `skip` (resident ones, which need no load) are passed over, so the next streamed layer's
        copy starts as early as possible and hides behind every resident layer before it.
        """
        i = self._index.get(key)
        if i is None or n <= 0:
            return []
        skip = skip if isinstance(skip, (set, frozenset, dict)) else set(skip)
        count, out = len(self.order), []
        for j in range(1, count):
            nxt = self.order[(i + j) % count]
            if nxt in skip:
                continue
            out.append(nxt)
            if len(out) == n:
                break
        return out
