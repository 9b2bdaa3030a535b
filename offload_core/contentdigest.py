"""A digest of tensors' every byte: what a prefix key reads the model's weights with (`fingerprint.model_state`).

A real hash, with no structured blind spot (a weighted sum of words, the former digest, is linear: an edit that
flips bit 63 of an even number of words leaves it unchanged):

- a CPU tensor's bytes go through xxh3-128 where they are (no copy; ~10 GiB/s per core);
- a tensor on another device is hashed there, so its bytes never cross the bus: each 64-bit word is mixed with
  its position through murmur3's 64-bit finaliser, a bijection that spreads every input bit over the output,
  twice (word first, then with the position folded in), and the mixed words are summed modulo 2**64 in two
  lanes of different seeds. An edit goes unseen only if the sum of its mixed differences is 0 in both lanes:
  about 2**-128 for any edit that does not depend on the mixer's constants. One small copy per device brings
  the sums to the host, where xxh3-128 takes them.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import xxhash

_WORDS = 1 << 21  # 64-bit words mixed per kernel on a device: 16 MiB of int64 temporaries per lane
_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)  # one per lane (digits of pi)
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3 fmix64
_GOLDEN = 0x9E3779B97F4A7C15


def content_digest(tensors: Sequence[torch.Tensor]) -> bytes:
    """A 16-byte digest of every byte of `tensors` (order, shapes and dtypes included). CPU tensors are hashed
    in place; others on their own device (see the module docstring)."""
    sums: Dict[torch.device, List[torch.Tensor]] = {}
    order: List[Tuple[torch.device, int]] = []
    for t in tensors:
        if t.device.type != "cpu":
            per_device = sums.setdefault(t.device, [])
            order.append((t.device, len(per_device)))
            per_device.append(device_sum(t))
        else:
            order.append((t.device, -1))
    host = {d: torch.stack(s).cpu() for d, s in sums.items()}
    h = xxhash.xxh3_128()
    for (device, i), t in zip(order, tensors):
        h.update(repr((tuple(t.shape), str(t.dtype), device.type)).encode())
        h.update(_host_bytes(t) if i < 0 else host[device][i].numpy().tobytes())
    return h.digest()


def _host_bytes(t: torch.Tensor):
    """The bytes of CPU tensor `t` as a buffer, copied only when `t` is not contiguous."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy()


def device_sum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums (lanes) over the mixed 64-bit words of `t`, computed on `t`'s device."""
    words = _words(t)
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _WORDS):
        chunk = words[start:start + _WORDS]
        pos = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=t.device)
        for lane, seed in enumerate(_SEEDS):
            total[lane] += _fmix(_fmix(chunk ^ _signed(seed)) ^ _fmix(pos * _signed(_GOLDEN) + _signed(seed))).sum()
    return total


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` as 64-bit words, zero-padded to a whole word (its byte length is in the header)."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    pad = -raw.numel() % 8
    if pad or raw.storage_offset() % 8:
        raw = torch.cat([raw, raw.new_zeros(pad)])  # a fresh storage starts aligned
    return raw.view(torch.int64)


def _fmix(x: torch.Tensor) -> torch.Tensor:
    """murmur3's fmix64 on int64 (wrapping multiplies; `_shr` is the logical shift)."""
    x = x ^ _shr(x, 33)
    x = x * _signed(_C1)
    x = x ^ _shr(x, 33)
    x = x * _signed(_C2)
    return x ^ _shr(x, 33)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)  # int64 `>>` is arithmetic: mask the copied sign bits away


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
