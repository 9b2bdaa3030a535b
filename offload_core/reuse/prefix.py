"""What a prefix's K/V were computed from: `PrefixKey` (a header plus content tensors, hashed by an on-device
digest, compared in full on a hit). The part of a key every torch model shares is `fingerprint.model_state`.

Used by the prefix registry (`registry.py`); what else goes into a key is the adapter's decision.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Three fp32 numbers on `t`'s device: the plain sum and two sums weighted by fixed position patterns."""
    x = t.detach().reshape(-1).float()
    pos = torch.arange(x.numel(), device=x.device, dtype=torch.float32)
    return torch.stack([x.sum(), (x * torch.sin(pos * 1.6180339)).sum(), (x * torch.cos(pos * 0.7071068 + 0.3)).sum()])


@dataclass(frozen=True, eq=False)
class PrefixKey:
    """What a prefix's K/V were computed from. Build it with `PrefixKey.build`.

    header: the adapter's hashable tuple of everything that is not tensor content (model identity, scalars,
        options), as given to `build`. An adapter's header starts with the model that computes the prefix:
        `(family, id of the model object, (ModelState.identity, ModelState.digest), ...)`, read back as
        `scope`, `model_id` and `weights`.
    shapes: `(shape, dtype name)` of each content tensor, in order.
    digest: the header's and shapes' sha256, then the tensors' on-device digests (what the hash is made of).
    tensors: the content tensors (host copies once kept by the registry), compared in full on a hit.
    """

    header: tuple
    shapes: Tuple[Tuple[Tuple[int, ...], str], ...]
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
        return cls(header, shapes, head + digest, tuple(tensors))

    @property
    def scope(self) -> tuple:
        """`(family, id of the model object)`: which model computed the prefix."""
        return self.header[:2]

    @property
    def model_id(self) -> int:
        """`id()` of the model object that computed the prefix (its entries go when it is unloaded)."""
        return self.header[1]

    @property
    def weights(self) -> bytes:
        """The digest of that model's weights and module state (`fingerprint.ModelState.digest`)."""
        return self.header[2][1]

    def __hash__(self) -> int:
        return hash(self.digest)

    def matches(self, other: "PrefixKey") -> bool:
        """Full comparison: header and shapes, then every content tensor element by element."""
        if self.header != other.header or self.shapes != other.shapes or self.digest != other.digest:
            return False
        return all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(self.tensors, other.tensors))

    def on_host(self) -> "PrefixKey":
        """The same key with its content copied to host memory (what an entry keeps: no VRAM between requests)."""
        return PrefixKey(self.header, self.shapes, self.digest, tuple(t.to("cpu", copy=True) for t in self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
