"""Policy as plain functions over plain data: which tier `auto` picks, which layers come next.

Nothing here moves memory; `store.py` asks and the tiers act.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

from .config import Mode

GiB = 1 << 30
RESERVE_BYTES = GiB // 2  # memory left free beside the cache for activations and other programs
ASSUMED_LAYERS = 60  # when `auto` is not told the cache size: the deepest supported model (Qwen-Image-Edit)


def fits(free: Optional[int], need: int) -> bool:
    """True when `need` bytes fit into `free` with half of `need` plus a fixed reserve left over."""
    return free is not None and free >= need + need // 2 + RESERVE_BYTES


def choose_tier(need: int, free_device: Optional[int], free_host: Optional[int], unified: Optional[str],
                pin_budget: Optional[int] = None) -> Tuple[Mode, str]:
    """The fastest tier that fits right now, and why.

    `unified` is the reason host RAM is no separate pool (unified memory, or the device is the CPU itself), in
    which case a RAM tier would free nothing and is never picked.
    """
    gib = need / GiB
    if fits(free_device, need):
        return Mode.GPU, f"{gib:.2f} GiB fits in free device memory ({(free_device or 0) / GiB:.2f} GiB)"
    if unified is None and fits(free_host, need):
        pinned = "" if pin_budget is None or pin_budget >= need else \
            f", {pin_budget / GiB:.2f} GiB of it pinned (budget), the rest pageable"
        return Mode.RAM_ASYNC, f"{gib:.2f} GiB does not fit on the device but fits in free RAM{pinned}"
    why = f"RAM tiers disabled, {unified}" if unified else \
        f"{gib:.2f} GiB fits neither in free device memory nor in free RAM"
    return Mode.FILE_ASYNC, why


def resolve(requested: Mode, unified: Optional[str]) -> Tuple[Mode, str]:
    """The tier an explicit mode actually gets: RAM tiers become `gpu` where RAM and VRAM are one pool."""
    if requested.is_ram and unified is not None:
        return Mode.GPU, f"{requested.value} -> gpu: RAM tiers disabled, {unified}"
    return requested, "requested"


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

    def ahead(self, key: Hashable, n: int) -> List[Hashable]:
        """Up to `n` layers expected after `key`, wrapping into the next step, never `key` itself."""
        i = self._index.get(key)
        if i is None or n <= 0:
            return []
        count = len(self.order)
        return [self.order[(i + j) % count] for j in range(1, min(n, count - 1) + 1)]
