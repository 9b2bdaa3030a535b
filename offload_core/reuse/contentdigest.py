"""A digest of tensors' every byte: what a prefix key reads the model's weights with (`fingerprint.model_state`).

A real hash, with no structured blind spot (a weighted sum of words, the former digest, is linear: an edit that
flips bit 63 of an even number of words leaves it unchanged):

- a CPU tensor's bytes go through xxh3-128 where they are (no copy; ~10 GiB/s per core);
- a tensor on another device is hashed there, so its bytes never cross the bus: each 64-bit word is xored with
  a key of its position and mixed through murmur3's 64-bit finaliser (a bijection that spreads every input bit
  over the output), and the mixed words are summed modulo 2**64 (`device_sum`). One small copy per device
  brings the sums to the host, where xxh3-128 takes them.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import xxhash

_WORDS = 1 << 21  # 64-bit words mixed per kernel on a device: 16 MiB of int64 temporaries
_SEED = 0x243F6A8885A308D3  # digits of pi
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
    """sum(fmix64(word_i ^ key_i)) modulo 2**64 over the 64-bit words of `t`, computed on `t`'s device. The keys
    are distinct (fmix64 of distinct numbers), so no two edits of the words give the same multiset of mixed
    terms: an edit goes unseen only if the sum of its mixed differences is 0, a 2**-64 chance."""
    words = _words(t)
    keys = _keys(t.device)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for number, start in enumerate(range(0, words.numel(), _WORDS)):
        chunk = words[start:start + _WORDS]
        # each chunk's sum mixed again with its number: a word moved to the same place in another chunk shows
        total += _fmix(_fmix(chunk ^ keys[: chunk.numel()]).sum() ^ _signed((number * _GOLDEN + 1) % (1 << 64)))
    return total


_KEYS: Dict[torch.device, torch.Tensor] = {}


def _keys(device: torch.device) -> torch.Tensor:
    """One pseudo-random key per word position in a chunk (16 MiB per device, made once)."""
    keys = _KEYS.get(device)
    if keys is None:
        pos = torch.arange(_WORDS, dtype=torch.int64, device=device)
        keys = _KEYS[device] = _fmix(pos * _signed(_GOLDEN) + _signed(_SEED))
    return keys


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
