"""Growing layers: a cache whose layers grow by blocks of tokens and are read back as a prefix (autoregressive
video). `store.GrowingKVStore` keeps the contract, `ring.PrefixRing` serves the streamed layers through device slots,
`packing` keeps blocks in fp8 / int8 on request, `shape.GrowingShape` sizes it all; the tiers keep the blocks
(`tiers/blocks.py`, `tiers/fileappend.py`)."""

from .shape import GrowingShape
from .store import GrowingKVStore

__all__ = ["GrowingKVStore", "GrowingShape"]
