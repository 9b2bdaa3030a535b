"""A digest of tensors' every byte, computed on the device each tensor lives on: what a prefix key reads the
model's weights with (`fingerprint.model_state`).

Exact integer arithmetic, so any single changed bit changes the digest and the result does not depend on
reduction order or float rounding; one small copy per device brings the sums to the host.
"""

from __future__ import annotations

import hashlib
from typing import Dict, List, Sequence, Tuple

import torch

_WORDS = 1 << 21  # 64-bit words hashed per kernel: 16 MiB of int64 temporaries (and of kept weights)
_MULTIPLIER = 0x9E3779B97F4A7C15  # odd: word i is weighted by an odd number, so a changed word always shows


def content_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """A digest of every byte of `tensors` (order, shapes and dtypes included), computed on each tensor's device.

    Per tensor: the sum of its 64-bit words, each multiplied by an odd weight that depends on its position,
    modulo 2**64, so any one changed word changes it.
    """
    sums: Dict[torch.device, List[torch.Tensor]] = {}
    order: List[Tuple[torch.device, int]] = []
    for t in tensors:
        per_device = sums.setdefault(t.device, [])
        order.append((t.device, len(per_device)))
        per_device.append(_tensor_sum(t))
    host = {d: torch.stack(s).cpu() for d, s in sums.items()}
    h = hashlib.sha256()
    for (device, i), t in zip(order, tensors):
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(host[device][i].numpy().tobytes())
    return h.digest()


def _tensor_sum(t: torch.Tensor) -> torch.Tensor:
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    weights = _weights(t.device)
    for part, words in enumerate(_as_words(t)):
        for start in range(0, words.numel(), _WORDS):
            chunk = words[start:start + _WORDS].to(torch.int64)
            total[0] += _weighted_sum(chunk, weights[: chunk.numel()])
            total[1] += chunk.sum() * (2 * (start // _WORDS) + 4 * part + 1)  # which chunk a word sits in
    return total


def _weighted_sum(chunk: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(chunk * weights) modulo 2**64: one pass on the CPU (`dot`, twice as fast, no temporary); CUDA has no
    integer `dot`, so there the product is summed."""
    if chunk.device.type == "cpu":
        return torch.dot(chunk, weights)
    return (chunk * weights).sum()


def _as_words(t: torch.Tensor) -> List[torch.Tensor]:
    """The bytes of `t` as 64-bit words (so a bf16 weight takes a quarter of the elements through the kernels),
    then the bytes that do not fill a last word, in `t`'s own element width. The grouping depends only on the
    bytes, never on where the tensor starts in its storage: an unaligned one is copied first."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    own = flat.view(_INT_OF_WIDTH[flat.element_size()])
    per_word = 8 // flat.element_size()
    whole = flat.numel() // per_word * per_word
    head = own[:whole]
    if head.storage_offset() * head.element_size() % 8:
        head = head.clone()  # a fresh storage starts aligned
    return [head.view(torch.int64), own[whole:]]


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_WEIGHTS: Dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        pos = torch.arange(_WORDS, dtype=torch.int64, device=device)
        w = _WEIGHTS[device] = (pos * _MULTIPLIER_SIGNED) | 1  # wraps modulo 2**64; odd at every position
    return w


_MULTIPLIER_SIGNED = _MULTIPLIER - (1 << 64)  # the same 64 bits as a signed int64
