"""Random stores for the engine's property tests: layer shapes, dtypes, sizes, modes, budgets and orders.

A case is drawn from one seed (`draw_case(seed)`), so a failure names its seed and is replayed exactly. Sizes
are drawn by class, so every store mixes what real models put with what unit tests put: a few bytes, a few KiB,
just below and just above a whole number of 2 MiB (a huge page, where host buffers change how they are laid
out), and real layers of 8 to 64 MiB with odd token counts. Batch rows are drawn equal (a batch from one prompt,
kept as one row) or different.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from offload_core import HostServices, OffloadConfig

MiB = 1 << 20
HUGE = 2 * MiB
MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async", "auto"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The file tiers' patterns (`KV_OFFLOAD_IO_REQUEST_MIB`, `KV_OFFLOAD_IO_DEPTH`), and requests far smaller than
# any layer's chunk count would be otherwise (many chunks a layer).
IO_REQUESTS = [64 << 10, MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
IO_DEPTHS = [1, 2, 4, 8, 16]
BIG_LIMIT = 64 * MiB  # one K (or V) at most; a store holds at most one layer that large
STORE_LIMIT = 160 * MiB  # K and V of every layer of one store together, as put


@dataclass(frozen=True)
class LayerSpec:
    k_shape: Tuple[int, ...]
    v_shape: Tuple[int, ...]
    dtype: torch.dtype
    same_rows: bool  # every batch row a copy of row 0 (a batch from one prompt)

    @property
    def k_bytes(self) -> int:
        return _numel(self.k_shape) * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return (_numel(self.k_shape) + _numel(self.v_shape)) * torch.empty(0, dtype=self.dtype).element_size()


@dataclass
class Case:
    seed: int
    fields: Dict[str, object]  # OffloadConfig's, file_dir excepted
    free: Optional[Tuple[int, int]]  # auto: (free device, free host) bytes the host reports
    discrete: bool  # auto: plan as if the device had memory of its own beside the host's (else the CPU's one pool)
    specs: Dict[Hashable, LayerSpec]
    passes: List[List[Hashable]]  # the keys got, pass by pass
    io: Tuple[int, int] = (8 * MiB, 4)  # the file tiers' request bytes and requests in flight (what a probe may pick)

    @cached_property
    def layers(self) -> Dict[Hashable, Tuple[torch.Tensor, torch.Tensor]]:
        """The layers put, made from the seed (only when a test puts them: a 64 MiB draw takes a while)."""
        gen = torch.Generator().manual_seed(self.seed)
        return {key: (_random(gen, s.k_shape, s.dtype, s.same_rows), _random(gen, s.v_shape, s.dtype, s.same_rows))
                for key, s in self.specs.items()}

    def config(self, file_dir: str) -> OffloadConfig:
        return OffloadConfig(**self.fields, **({"file_dir": file_dir} if self._files else {}))

    def host(self, temp_dir: str) -> HostServices:
        if self.free is None:
            return HostServices(temp_dir=lambda: temp_dir)
        device, host = self.free
        return HostServices(free_device_memory=lambda d: device, free_host_memory=lambda: host,
                            temp_dir=lambda: temp_dir)

    @property
    def _files(self) -> bool:
        mode = self.fields["mode"]
        return mode.startswith("file") or mode == "auto" or "host_budget" in self.fields

    def describe(self) -> str:
        sizes = ", ".join(f"{s.k_shape} {str(s.dtype)[6:]}" for s in self.specs.values())
        return (f"seed {self.seed}: {self.fields} free={self.free} discrete={self.discrete} io={self.io} "
                f"layers [{sizes}]")


def tensor_bytes(rng: random.Random, big_left: bool) -> int:
    """The bytes of one K, by size class."""
    roll = rng.random()
    if roll < 0.2:
        return rng.randint(2, 4096)
    if roll < 0.45:
        return rng.randint(4097, HUGE - 1)
    if roll < 0.8:  # within a few elements of a whole number of huge pages, on either side or on it
        return max(2, rng.randint(1, 4) * HUGE + rng.choice([-1, 1, 0]) * rng.randint(1, 8192))
    if big_left:
        return rng.randint(8 * MiB, BIG_LIMIT)
    return rng.randint(4097, 6 * MiB)


def draw_shape(rng: random.Random, nbytes: int, size: int, rows: int) -> Tuple[int, ...]:
    """A (B, tokens, heads, head_dim) shape of about `nbytes` (tokens odd where it can be), or a smaller rank."""
    if nbytes < 256 and rng.random() < 0.5:
        return (rows, max(1, nbytes // (size * rows)))
    heads, dim = rng.choice([(1, 16), (2, 32), (8, 64), (24, 128), (3, 40)])
    tokens = max(1, nbytes // (size * rows * heads * dim))
    return (rows, tokens | 1 if tokens > 2 else tokens, heads, dim)


def draw_layers(rng: random.Random) -> Dict[Hashable, LayerSpec]:
    count, total, big_left = rng.randint(2, 7), 0, True
    specs = {}
    for i in range(count):
        dtype = rng.choice(DTYPES)
        size = torch.empty(0, dtype=dtype).element_size()
        rows = rng.choice([1, 1, 1, 2, 3])
        nbytes = tensor_bytes(rng, big_left)
        if 2 * nbytes + total > STORE_LIMIT:
            nbytes = rng.randint(2, 4096)
        big_left = big_left and nbytes < 8 * MiB
        shape = draw_shape(rng, nbytes, size, rows)
        v_shape = shape if rng.random() < 0.85 else (*shape[:-1], max(1, shape[-1] // 2))  # V of other width
        spec = LayerSpec(shape, v_shape, dtype, rows > 1 and rng.random() < 0.6)
        total += spec.nbytes
        specs[rng.choice([i, ("double", i), f"layer.{i}"])] = spec
    return specs


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _random(gen: torch.Generator, shape, dtype, same_rows: bool) -> torch.Tensor:
    if same_rows:
        row = torch.randn((1, *shape[1:]), generator=gen).to(dtype)
        return row.expand(shape).contiguous()
    return torch.randn(shape, generator=gen).to(dtype)


def draw_passes(rng: random.Random, keys: List[Hashable]) -> List[List[Hashable]]:
    """Two to three passes of gets: the put order, another fixed order (learned), a skipped layer, a repeat."""
    order = list(keys)
    if rng.random() < 0.4:
        rng.shuffle(order)
    passes = []
    for _ in range(rng.randint(2, 3)):
        one = list(order)
        if len(one) > 2 and rng.random() < 0.3:
            one.pop(rng.randrange(len(one)))  # a block this step skips
        if rng.random() < 0.2:
            at = rng.randrange(len(one))
            one.insert(at, one[at])  # the same layer asked for twice in a row
        passes.append(one)
    return passes


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    mode = rng.choice(MODES)
    storage = rng.choice(["exact", "exact", "fp8", "int8"])
    specs = draw_layers(rng)
    total = sum(s.nbytes for s in specs.values())
    fields: Dict[str, object] = {"mode": mode, "storage": storage, "dedup": rng.random() < 0.7}
    if mode in ("ram_async", "file_async", "auto"):
        fields["prefetch_depth"] = rng.randint(1, 3)
    if mode != "gpu" and rng.random() < 0.6:  # whole layers resident up to it, the rest streamed
        fields["device_budget"] = int(total * rng.random())
    if mode in ("ram_sync", "ram_async") and rng.random() < 0.6:  # the rest spills to files
        fields["host_budget"] = int(total * rng.random())
    free = None
    if mode == "auto":
        free = (int(total * 3 * rng.random()), int(total * 2 * rng.random()))
    discrete = mode == "auto" and rng.random() < 0.7
    passes = draw_passes(rng, list(specs))
    io = (rng.choice(IO_REQUESTS), rng.choice(IO_DEPTHS))  # drawn last: the draws above keep their seeds' values
    return Case(seed, fields, free, discrete, specs, passes, io)
