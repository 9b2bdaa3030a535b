"""The blocks of a growing layer, as every tier keeps them: each block a (K, V) pair of `n` tokens appended at
token `at`, laid out flat like a whole layer (`layout.layout_for`), so a tier moves a block the way it moves a
layer. A prefix is read back as whole blocks, in order, into the token range each block came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, List, Sequence, Tuple

import torch

from ..layout import LayerLayout


@dataclass(frozen=True)
class Block:
    at: int  # the first token of the block in its layer
    tokens: int
    layout: LayerLayout  # the block's K (B, tokens, H, D) and V, flat

    @property
    def end(self) -> int:
        return self.at + self.tokens


def next_at(blocks: Sequence[Block], key: Hashable, at: int, tokens: int) -> None:
    """Raises unless a block of `tokens` tokens at `at` continues `blocks` (a layer grows only at its end)."""
    end = blocks[-1].end if blocks else 0
    if at != end:
        raise ValueError(f"KV offload: growing layer {key!r} holds tokens [0, {end}); a block appended at token {at} "
                         f"would leave a gap or overwrite kept tokens. Append at its end ({end}).")
    if tokens <= 0:
        raise ValueError(f"KV offload: a block appended to growing layer {key!r} must hold tokens; got {tokens}.")


def covering(blocks: Sequence[Block], tokens: int, key: Hashable) -> List[Block]:
    """The blocks that make up tokens [0, `tokens`) of a layer: whole blocks only, else a `ValueError`."""
    out = []
    for block in blocks:
        if block.end > tokens:
            break
        out.append(block)
    got = out[-1].end if out else 0
    if got != tokens:
        kept = blocks[-1].end if blocks else 0
        raise ValueError(f"KV offload: growing layer {key!r} holds tokens [0, {kept}) in blocks; a prefix of {tokens} "
                         "tokens is not made of whole blocks. Read the prefix the layer holds.")
    return out


def into(k: torch.Tensor, v: torch.Tensor, block: Block) -> Tuple[torch.Tensor, torch.Tensor]:
    """The token range of `block` in the prefix buffers `k`, `v` (B, tokens, H, D): where its K and V go."""
    return k[:, block.at:block.end], v[:, block.at:block.end]
