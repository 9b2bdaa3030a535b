"""The parts of one run's state: one branch's cache, the forward in progress, a family's own state.

No ComfyUI import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

PASS, CAPTURE, CACHED = "pass", "capture", "cached"
EXTRACT = CAPTURE  # the capture phase's old name, kept for one release


def layer_bytes(k: torch.Tensor, v: torch.Tensor) -> int:
    """One layer's K and V as put (exact dtype, no alignment): what `KVStore`'s `expected_bytes` counts a layer as."""
    return k.nbytes + v.nbytes


@dataclass
class BranchCache:
    """One branch's cache: the prefix of one cond (or a prefix entry, a pose window), its store, what it was
    captured from."""

    store: Any = None
    ref_tokens: int = 0
    rows: int = 0
    layers: set = field(default_factory=set)
    complete: bool = False
    name: str = ""


@dataclass
class ForwardState:
    """What the forward in progress does: pass through, capture, or feed back (cached).

    seq_len: the joint (text + image) length `post_input` left; the attention patch must see exactly that.
    """

    phase: str
    uuids: list
    rows: int = 0
    ref_tokens: int = 0
    capture: frozenset = frozenset()
    seq_len: Optional[int] = None


class RunExtension(Protocol):
    """What a family keeps for one run beside the stores (the Qwen-Image 2.1 prefix entries, the Wan Animate 2
    pose cache): freed once the run's stores are closed."""

    def free(self) -> None: ...


class ForwardWatcher(Protocol):
    """Told of each forward of a run (`RunState.watchers`): `begin(device)` before it runs (`device`: where it
    computes, None when unknown), `end(phase)` after it: CAPTURE when it put layers, CACHED when it only read
    them, PASS when it did neither."""

    def begin(self, device) -> None: ...

    def end(self, phase: str) -> None: ...


def repeat_to_batch_size(t: torch.Tensor, batch: int) -> torch.Tensor:
    """ComfyUI's `comfy.utils.repeat_to_batch_size` (batch dim 0), without importing ComfyUI."""
    if t.shape[0] > batch:
        return t[:batch]
    if t.shape[0] < batch:
        reps = -(-batch // t.shape[0])
        return t.repeat([reps] + [1] * (t.ndim - 1))[:batch]
    return t
