"""`bench --pose`: Wan Animate 2's pose cache in RAM, in files, and in RAM under a budget that spills.

The engine alone replays the calls the Settings node's pose cache makes (`nodes/families/wan.py`, which the engine may
not import): one `KVStore` per context window, opened with the window's size as `expected_bytes`; while
filling, per block in order, one `put` of the block's pose input (batch row 0, (1, L, dim), split along its
tokens into the store's two tensors); on every cached pass, per window and block in order, a `get`, the two
halves joined (`torch.cat`, as `take` does) and the K/V reprojection the cached forward runs on them (layer
norm and two dim x dim projections with random weights, one pair shared by the blocks). That reprojection is
the least compute the model does between two takes (the generation block's attention and MLP are left out), so
the exposed wait measured is the most a real run would show.

Sizes (`pose_sizes`): 480x832, `frames` video frames (81: 21 latent frames of 30x52 = 1,560 pose tokens each),
40 blocks as in Wan 14B, bf16. At full size the width is Wan 14B's 5,120: 12.5 GiB for 81 frames, the figure
ComfyUI's WanAnimate2Cache gives. The tiny size keeps the tokens and blocks at 1/40 of the width (320 MiB).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import List, Optional

import torch

from ... import KVStore, OffloadConfig
from ...places import HOST_PLACES, PLACES

WAN_14B = {"dim": 5120, "num_layers": 40}  # ComfyUI's Wan 14B config (Wan Animate 2 is one)
TINY_DIM = WAN_14B["dim"] // 40
HEIGHT, WIDTH = 480, 832
VAE_STRIDE, PATCH = (4, 8), 2  # Wan's VAE: 4 frames and 8x8 pixels a latent; patches of 2x2 latents
REFERENCE = "ram_async"  # ComfyUI's `cpu` place: pinned RAM, copied ahead on a side stream
BUDGET_SHARE = 0.5
# (row, mode, share of the cache the RAM budget allows; None: no budget)
ROWS = (("gpu", "gpu", None), ("ram_sync", "ram_sync", None), (REFERENCE, REFERENCE, None),
        ("file_sync", "file_sync", None), ("file_async", "file_async", None),
        (f"ram budget {BUDGET_SHARE:.0%}", REFERENCE, BUDGET_SHARE))


@dataclasses.dataclass(frozen=True)
class PoseSizes:
    frames: int
    dim: int
    windows: int = 1
    blocks: int = WAN_14B["num_layers"]
    dtype: torch.dtype = torch.bfloat16

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // VAE_STRIDE[0] + 1

    @property
    def tokens_per_frame(self) -> int:
        side = VAE_STRIDE[1] * PATCH
        return (HEIGHT // side) * (WIDTH // side)

    def window_tokens(self) -> List[int]:
        """Pose tokens of each window: the latent frames shared out as evenly as they go, windows apart."""
        each, extra = divmod(self.latent_frames, self.windows)
        return [(each + (w < extra)) * self.tokens_per_frame for w in range(self.windows)]

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def cache_bytes(self) -> int:
        """The whole pose cache as kept: every window's blocks, row 0 only."""
        return self.latent_frames * self.tokens_per_frame * self.dim * self.element_size * self.blocks


def pose_sizes(size: str, frames: int, windows: int = 1, dtype: torch.dtype = torch.bfloat16) -> PoseSizes:
    return PoseSizes(frames, WAN_14B["dim"] if size == "full" else TINY_DIM, windows, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def block_input(base: torch.Tensor, tokens: int, block: int) -> torch.Tensor:
    """Block `block`'s pose input of a window of `tokens` tokens: distinct per block, rebuilt bit for bit."""
    return base[:, :tokens].roll(7 * block, dims=1)


class Reprojection:
    """The cached forward's per-block compute on the taken input: layer norm, then its K and V projections."""

    def __init__(self, sizes: PoseSizes, device: torch.device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.wk, self.wv = (torch.randn(sizes.dim, sizes.dim, generator=g).mul_(sizes.dim ** -0.5)
                            .to(device, sizes.dtype) for _ in range(2))

    def __call__(self, x: torch.Tensor):
        n = torch.nn.functional.layer_norm(x, x.shape[-1:])
        return n @ self.wk, n @ self.wv


def _held_in_ram(stores: List[KVStore]) -> int:
    return sum(s.stats()["bytes"][p] for s in stores for p in HOST_PLACES)


def fill(config: OffloadConfig, sizes: PoseSizes, base: torch.Tensor, budget: Optional[int]) -> List[KVStore]:
    """One store per window, every block put; a window's RAM budget is what the windows before it left."""
    stores: List[KVStore] = []
    try:
        for w, tokens in enumerate(sizes.window_tokens()):
            cfg = config if budget is None else dataclasses.replace(
                config, host_budget=max(0, budget - _held_in_ram(stores)))
            store = KVStore(cfg, base.device, name=f"pose {w + 1}",
                            expected_bytes=tokens * sizes.dim * sizes.element_size * sizes.blocks)
            stores.append(store)
            half = (tokens + 1) // 2
            for i in range(sizes.blocks):
                t = block_input(base, tokens, i)
                store.put(i, t[:, :half], t[:, half:])
    except BaseException:
        for store in stores:
            store.close()
        raise
    return stores


def cached_pass(stores: List[KVStore], sizes: PoseSizes, compute, base=None) -> tuple:
    """(seconds, exact): every window's blocks taken in order, each reprojected; `base`: check every take."""
    device, exact = stores[0].device, True
    _sync(device)
    start = time.perf_counter()
    for store, tokens in zip(stores, sizes.window_tokens()):
        for i in range(sizes.blocks):
            k, v = store.get(i)
            x = torch.cat([k, v], dim=1)
            if base is not None:
                exact = exact and torch.equal(x, block_input(base, tokens, i))
            compute(x)
    _sync(device)
    return time.perf_counter() - start, exact


def compute_pass(sizes: PoseSizes, compute, base: torch.Tensor) -> float:
    """The same pass's compute alone, on inputs already on the device: what a pass costs with no cache traffic."""
    _sync(base.device)
    start = time.perf_counter()
    for tokens in sizes.window_tokens():
        x = base[:, :tokens]
        for _ in range(sizes.blocks):
            compute(x)
    _sync(base.device)
    return time.perf_counter() - start


def measure_row(label: str, mode: str, share: Optional[float], sizes: PoseSizes, base: torch.Tensor, compute,
                runs: int) -> dict:
    budget = None if share is None else int(sizes.cache_bytes * share)
    start = time.perf_counter()
    stores = fill(OffloadConfig(mode=mode), sizes, base, budget)
    try:
        _sync(base.device)
        fill_s = time.perf_counter() - start
        _, exact = cached_pass(stores, sizes, compute, base)  # the warm-up: every take checked bit for bit
        waited = sum(s.stats()["exposed_wait_s"] for s in stores)
        latencies, computes = [], []
        for _ in range(runs):  # each pass beside the compute alone: a load change on the machine hits both
            latencies.append(cached_pass(stores, sizes, compute)[0])
            computes.append(compute_pass(sizes, compute, base))
        stats = [s.stats() for s in stores]
    finally:
        for store in stores:
            store.close()
    places = {p: sum(s["bytes"][p] for s in stats) for p in PLACES}
    return {"row": label, "mode": mode, "host_budget": budget, "windows": sizes.windows, "bytes": places,
            "spill_bytes": places["file"] if budget is not None else 0, "fill_s": fill_s,
            "latency_s": statistics.median(latencies), "latency_min_s": min(latencies),
            "latency_max_s": max(latencies), "compute_s": statistics.median(computes),
            "overhead_s": statistics.median(latencies) - statistics.median(computes),
            "exposed_wait_s": (sum(s["exposed_wait_s"] for s in stats) - waited) / runs,
            "peak_device_bytes": max(s["peak_device_bytes"] for s in stats), "mode_in_effect": stats[0]["mode"],
            "pinned_fallback": any(s["pinned_fallback"] for s in stats), "exact": bool(exact)}


def measure(sizes: PoseSizes, device: torch.device, runs: int, rows=ROWS, seed: int = 0) -> tuple:
    """(rows, compute_s): each row filled, warmed up once (every take checked), then `runs` timed passes, each
    followed by the compute alone; `overhead_s` is the row's median pass less its median compute, `ratio` its
    median pass over the RAM row's; `compute_s` the median of the rows' compute alone."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, max(sizes.window_tokens()), sizes.dim, generator=g).to(device, sizes.dtype)
    compute = Reprojection(sizes, device, seed)
    compute_pass(sizes, compute, base)  # warm-up: kernels chosen, weights touched
    out = [measure_row(label, mode, share, sizes, base, compute, runs) for label, mode, share in rows]
    ref = next((r["latency_s"] for r in out if r["row"] == REFERENCE), None)
    for r in out:
        r["ratio"] = r["latency_s"] / ref if ref else None
    return out, statistics.median(r["compute_s"] for r in out)
