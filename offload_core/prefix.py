"""What a prefix's K/V were computed from: `PrefixKey` (a header plus content tensors, hashed by an on-device
digest, compared in full on a hit) and `model_fingerprint` (the part of a key every torch model shares).

Used by the prefix registry (`reuse.py`); what else goes into a key is the adapter's decision.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

_PROBE = 64  # elements sampled per parameter for the weight fingerprint


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Three fp32 numbers on `t`'s device: the plain sum and two sums weighted by fixed position patterns."""
    x = t.detach().reshape(-1).float()
    pos = torch.arange(x.numel(), device=x.device, dtype=torch.float32)
    return torch.stack([x.sum(), (x * torch.sin(pos * 1.6180339)).sum(), (x * torch.cos(pos * 0.7071068 + 0.3)).sum()])


@dataclass(frozen=True, eq=False)
class PrefixKey:
    """What a prefix's K/V were computed from. Build it with `PrefixKey.build`.

    header: a hashable tuple of everything that is not tensor content (shapes, dtypes, model identity, scalars).
    tensors: host copies of the content tensors, compared in full on a hit.
    """

    header: tuple
    digest: bytes
    tensors: Tuple[torch.Tensor, ...]

    @classmethod
    def build(cls, header: tuple, tensors: Sequence[torch.Tensor]) -> "PrefixKey":
        tensors = [t.detach() for t in tensors]
        shapes = tuple((tuple(t.shape), str(t.dtype)) for t in tensors)
        if tensors:
            by_device: Dict[torch.device, List[torch.Tensor]] = {}
            for t in tensors:
                by_device.setdefault(t.device, []).append(_digest(t))
            digest = b"".join(struct.pack(f"{3 * len(ds)}f", *torch.cat(ds).cpu().tolist())
                              for _, ds in sorted(by_device.items(), key=lambda kv: str(kv[0])))
        else:
            digest = b""
        # The header is hashed as its repr: it holds only plain values (ints, strings, tuples).
        head = hashlib.sha256(repr((header, shapes)).encode()).digest()
        return cls((header, shapes), head + digest, tuple(tensors))

    def __hash__(self) -> int:
        return hash(self.digest)

    def matches(self, other: "PrefixKey") -> bool:
        """Full comparison: header, then every content tensor element by element."""
        if self.header != other.header or self.digest != other.digest:
            return False
        return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.tensors, other.tensors))

    def on_host(self) -> "PrefixKey":
        """The same key with its content copied to host memory (what an entry keeps: no VRAM between requests)."""
        return PrefixKey(self.header, self.digest, tuple(t.to("cpu", copy=True) for t in self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def model_fingerprint(module: torch.nn.Module) -> Tuple[str, torch.Tensor]:
    """(identity string, weight probe) of a torch model as it affects its outputs now.

    The identity covers the object, every parameter and buffer (name, shape, dtype, in-place version counter),
    adapter state that PEFT keeps on layers (active / merged adapters, scaling, disabled) and the attention
    processors. The probe samples `_PROBE` elements of every parameter, so weights replaced or edited through
    `.data` (which version counters do not see, e.g. a LoRA fused and then unloaded) change it too. Device
    placement is left out on purpose: model CPU offload moves the weights every request.
    """
    parts: List[object] = [id(module), type(module).__qualname__]
    probes: Dict[torch.device, List[torch.Tensor]] = {}
    for name, p in list(module.named_parameters()) + list(module.named_buffers()):
        parts.append((name, tuple(p.shape), str(p.dtype), p._version))
        flat = p.detach().reshape(-1)
        if flat.numel() and p.device.type != "meta":
            step = max(1, flat.numel() // _PROBE)
            probes.setdefault(p.device, []).append(flat[::step][:_PROBE].float())
    for name, sub in module.named_modules():
        state = tuple(repr(getattr(sub, a)) for a in ("merged_adapters", "active_adapters", "scaling",
                                                        "disable_adapters") if hasattr(sub, a))
        processor = getattr(sub, "processor", None)
        if state or processor is not None:
            parts.append((name, state, type(processor).__qualname__,
                          repr(getattr(processor, "_attention_backend", None))))
    probe = torch.cat([torch.cat(ps).cpu() for _, ps in sorted(probes.items(), key=lambda kv: str(kv[0]))]) \
        if probes else torch.zeros(0)
    return hashlib.sha256(repr(parts).encode()).hexdigest(), probe
