"""A tiny Wan Animate 2 and a sampler with context windows, driving the pose cache as ComfyUI does.

`TinyWanAnimate2._forward` mirrors the cache traffic of `WanAnimate2Model.forward_orig` in ComfyUI v0.33
(`comfy/ldm/wan/model_animate2.py`): with pose latents it reads `transformer_options["animate2_cache"]`,
calls `select(pose_latents)` then `filled(num_blocks)`; unfilled, under a context window, it first runs a
pose-only prepass that `put`s every block's input and then reads them all back; unfilled without a window
it `put`s block i's pose input and runs the pose block itself; filled, it `take`s block i's input,
`prefetch`es block i + 1 and reprojects K/V from it (`kv_from_input`), so the cached and uncached passes
compute the pose K/V with the same operations. The blocks are small random matmuls, not Wan's.

`ComfyPoseCache` is ComfyUI's own `PoseBranchCache` with `store_device="cpu"`, `dtype="default"` (the
`WanAnimate2Cache(cpu, default)` node), reduced to what decides its values: one slot per pose sequence keyed
on row 0, row 0 stored (`x_pose[:1]` copied to the CPU), repeated to the batch on read, least recently used
slots evicted while the free memory of its device is below 1.5x the largest slot.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from malloc_graph import model_prefetch
from nodes_tiny import Guider, _repeat, through_model_wrappers, through_outer_wrappers


class TinyWanAnimate2(torch.nn.Module):
    def __init__(self, hidden=32, heads=2, layers=3, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.blocks = [None] * layers  # what detection and the block count look at
        w = lambda: torch.randn(hidden, hidden, generator=g) * hidden ** -0.5  # noqa: E731
        self.pose_w = [(w(), w(), w(), w()) for _ in range(layers)]  # q, k, v, out of the pose pass
        self.gen_w = [(w(), w(), w(), w()) for _ in range(layers)]
        self.embed = w()
        self.fail_at = None  # (forward number, block): raise KeyboardInterrupt there, like an interrupt
        self.forwards = 0

    def rope_encode_pose(self, *args, **kwargs):  # present on the real model; detection looks for it
        return None

    def forward(self, img, pose, txt, transformer_options):
        return through_model_wrappers(self, img, pose, txt, transformer_options)

    def _attend(self, q, k, v):
        B, L, C = q.shape
        split = lambda t: t.view(B, t.shape[1], self.heads, -1).transpose(1, 2)  # noqa: E731
        return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(B, L, C)

    def kv_from_input(self, i, x_pose):
        _, wk, wv, _ = self.pose_w[i]
        return x_pose @ wk, x_pose @ wv

    def forward_pose(self, i, x_pose):
        wq, _, _, wo = self.pose_w[i]
        k, v = self.kv_from_input(i, x_pose)
        return x_pose.add_(torch.tanh(self._attend(x_pose @ wq, k, v) @ wo)), k, v  # in place

    def forward_gen(self, i, x, txt, k_pose, v_pose):
        wq, wk, wv, wo = self.gen_w[i]
        kv = torch.cat([txt, x], dim=1)
        k, v = kv @ wk, kv @ wv
        if k_pose is not None:
            k, v = torch.cat([k, k_pose], dim=1), torch.cat([v, v_pose], dim=1)
        return x.add_(torch.tanh(self._attend(x @ wq, k, v) @ wo))  # in place

    def _forward(self, x, pose_latents, txt, transformer_options):
        to = transformer_options
        self.forwards += 1
        apply_pose = pose_latents is not None
        cache = to.get("animate2_cache", None) if apply_pose else None
        if cache is not None:
            cache.select(pose_latents)
        cached = cache is not None and cache.filled(len(self.blocks))
        x_pose = (pose_latents @ self.embed).to(x.dtype) if apply_pose and not cached else None
        if cache is not None and not cached and "context_window" in to:  # the pose-only prepass
            for i in range(len(self.blocks)):
                cache.put(i, x_pose)
                x_pose = self.forward_pose(i, x_pose)[0]
            x_pose, cached = None, True
        # A graph around the blocks, one allocation scope each, as ComfyUI's compiler runs a model (see nodes_tiny)
        x = x.clone()
        mp = model_prefetch()
        mp.malloc_graph_begin(x.device)
        for i in range(len(self.blocks)):
            mp.prefetch_queue_pop(None, x.device, ("block", i), x.dtype, malloc_scope="block")
            if self.fail_at == (self.forwards, i):
                raise KeyboardInterrupt("interrupted mid-forward")
            self._block(i, x, x_pose, txt, cache if apply_pose else None, cached)
        mp.prefetch_queue_pop(None, x.device, None, malloc_scope="block")
        mp.malloc_graph_end()
        return x

    def _block(self, i, x, x_pose, txt, cache, cached):
        """Block i: `x` (and `x_pose` on a filling pass) updated in place."""
        if x_pose is None and not cached:  # no pose latents this step
            k_pose = v_pose = None
        elif cached:
            x_pose_in = cache.take(i, x.device, x.dtype, x.shape[0])
            cache.prefetch(i + 1, x.device, x.dtype)
            k_pose, v_pose = self.kv_from_input(i, x_pose_in)
        else:
            if cache is not None:
                cache.put(i, x_pose)
            _, k_pose, v_pose = self.forward_pose(i, x_pose)
        self.forward_gen(i, x, txt, k_pose, v_pose)


class ComfyPoseCache:
    """`PoseBranchCache(store_device="cpu", dtype="default")`; `free_memory()` is `get_free_memory(cpu)`."""

    def __init__(self, free_memory=lambda: 1 << 60):
        self.dtype = "default"
        self.free_memory = free_memory
        self.slots, self.slot = [], None
        self.evictions = 0

    def select(self, pose_latents):
        k = pose_latents[:1]
        for s in self.slots:
            if s["key"].shape == k.shape and torch.equal(s["key"], k.to(s["key"].device)):
                # upstream does `self.slots.remove(s)`, which compares the slot dicts (tensors) by value and
                # raises when the hit is not the first slot (windows with cond and uncond run apart): by identity
                self.slots = [o for o in self.slots if o is not s]
                self.slots.append(s)
                self.slot = s
                return
        est = max((sum(t.numel() * t.element_size() for t in s["blocks"].values()) for s in self.slots), default=0) * 1.5
        while self.slots and self.free_memory() < est:
            self.slots.pop(0)
            self.evictions += 1
        self.slot = {"key": k.clone().to("cpu"), "blocks": {}}
        self.slots.append(self.slot)

    def filled(self, num_blocks):
        return self.slot is not None and len(self.slot["blocks"]) == num_blocks

    def put(self, i, x_pose):
        self.slot["blocks"][i] = x_pose[:1].to("cpu", copy=True)

    def prefetch(self, i, device, dtype):
        pass

    def take(self, i, device, dtype, batch_size):
        return _repeat(self.slot["blocks"][i].to(device, dtype), batch_size)

    def free(self):
        self.slots, self.slot = [], None


def windows_of(frames: int, length: int, overlap: int) -> list:
    """Static windows over `frames` latent frames (ComfyUI's `standard_static`: the same windows every step)."""
    out, start = [], 0
    while True:
        end = min(start + length, frames)
        out.append(list(range(max(0, end - length), end)))
        if end == frames:
            return out
        start = end - overlap


def sample(model, model_options, noise, pose, txts, steps=3, cfg=None, batched=True, hw=4, windows=None,
           multigpu=False):
    """Euler-ish loop over (B, frames * hw, C) latents; `pose` like `noise`, `txts` per cond (cond, uncond).

    `windows`: lists of frame indices; each step runs the model once per window (per cond batch) on that
    window's latents and pose frames with `transformer_options["context_window"]` set, and averages the
    overlaps, as ComfyUI's context-window handler does. OUTER_SAMPLE wrappers run around the loop.
    `multigpu`: the cond batches of each window run concurrently, one persistent thread per device (`cpu:0`,
    `cpu:1`) with `multigpu_thread_device` set, as ComfyUI's `_calc_cond_batch_multigpu` does.
    """
    pools = []
    try:
        return _sample(model, model_options, noise, pose, txts, steps, cfg, batched, hw, windows, multigpu, pools)
    finally:
        for p in pools:
            p.shutdown()


def _sample(model, model_options, noise, pose, txts, steps, cfg, batched, hw, windows, multigpu, pools):
    guider = Guider(model_options)
    uuids = ["cond-uuid", "uncond-uuid"][: 2 if cfg is not None else 1]
    frames = noise.shape[1] // hw
    wins = windows or [list(range(frames))]

    def tokens(win):
        return torch.tensor([f * hw + j for f in win for j in range(hw)])

    def loop():
        x = noise.clone()
        for step in range(steps):
            to = dict(guider.model_options.get("transformer_options", {}))
            outs = {u: torch.zeros_like(x) for u in uuids}
            count = torch.zeros(1, x.shape[1], 1)
            for win in wins:
                idx_t = tokens(win)
                t = dict(to, context_window=win) if windows else dict(to)
                groups = [uuids] if batched else [[u] for u in uuids]

                def run_group(group, t=t, idx_t=idx_t, x=x):
                    idx = [uuids.index(u) for u in group]
                    g = dict(t, uuids=list(group), cond_or_uncond=idx)
                    if multigpu:
                        g["multigpu_thread_device"] = torch.device("cpu", groups.index(group))
                    n = len(group)
                    out = model.forward(torch.cat([x[:, idx_t]] * n), torch.cat([pose[:, idx_t]] * n),
                                        torch.cat([txts[i] for i in idx]), g)
                    for j, u in enumerate(group):
                        outs[u][:, idx_t] += out[j * x.shape[0]:(j + 1) * x.shape[0]]

                if multigpu:
                    pools.extend(ThreadPoolExecutor(1) for _ in groups[len(pools):])
                    for f in [pool.submit(run_group, g) for pool, g in zip(pools, groups)]:
                        f.result()
                else:
                    for group in groups:
                        run_group(group)
                count[:, idx_t] += 1
            outs = {u: o / count for u, o in outs.items()}
            d = outs[uuids[0]] if cfg is None else outs[uuids[1]] + cfg * (outs[uuids[0]] - outs[uuids[1]])
            x = x - 0.25 * d
        return x

    return through_outer_wrappers(model_options, guider, loop)
