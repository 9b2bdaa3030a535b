"""A tiny Qwen-Image 2.1 with its own prefix cache, driven like the 2.1 model in newer ComfyUI, without ComfyUI."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from malloc_graph import model_prefetch
from nodes_tiny import TinyDiT, _repeat


class OwnPrefixCache:
    """The Qwen-Image 2.1 model's own prefix cache, reduced to its contract (a device dict per key)."""

    def __init__(self):
        self.slots, self.slot = [], None

    def select(self, key, create=True):
        for k, s in self.slots:
            if k.shape == key.shape and torch.equal(k, key):
                self.slot = s
                return True
        self.slot = None
        if not create:
            return False
        self.slot = {}
        self.slots.append((key.clone(), self.slot))

    def filled(self, n):
        return self.slot is not None and len(self.slot) == n

    def put(self, i, t):
        self.slot[i] = t.clone()

    def take(self, i, device, dtype, batch_size):
        return _repeat(self.slot[i].to(device, dtype), batch_size)

    def prefetch(self, i, device, dtype):
        pass

    def free(self):
        self.slots, self.slot = [], None


class Tiny21(torch.nn.Module):
    """Qwen-Image 2.1's prefix-cache seam (comfy/ldm/qwen_image21/model.py in newer ComfyUI), tiny.

    The prefix (text + reference tokens) attends only to itself, the target to everything; with a cache the
    prefix runs once and its K/V (stacked (B, 2, P, H, D)) go through `select_prefix_cache` / `put` /
    `take` / `prefetch`, and any attention or input patch makes the model skip its cache.
    """

    def __init__(self, hidden=32, heads=2, layers=3, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.transformer_blocks = [None] * layers
        self.qkv = [torch.randn(hidden, 3 * hidden, generator=g) * hidden ** -0.5 for _ in range(layers)]
        self.proj = [torch.randn(hidden, hidden, generator=g) * hidden ** -0.5 for _ in range(layers)]
        self.prefix_cache = None
        self.prefix_cache_enabled = True

    def to(self, *args, **kwargs):  # the weights are plain lists: moved by hand, as a module's would be
        self.qkv = [w.to(*args, **kwargs) for w in self.qkv]
        self.proj = [w.to(*args, **kwargs) for w in self.proj]
        return super().to(*args, **kwargs)

    def reset_prefix_cache(self, enabled=True):
        if self.prefix_cache is not None:
            self.prefix_cache.free()
        self.prefix_cache, self.prefix_cache_enabled = None, enabled

    def select_prefix_cache(self, key, cache_bytes, device, options):
        if options.get("device") == "off":
            return None, False
        if self.prefix_cache is None:
            self.prefix_cache = OwnPrefixCache()
        if self.prefix_cache.select(key, create=False):
            return self.prefix_cache, self.prefix_cache.filled(len(self.transformer_blocks))
        self.prefix_cache.select(key)
        return self.prefix_cache, False

    forward = TinyDiT.forward

    def _qkv(self, i, x):
        B, L, C = x.shape
        return (x @ self.qkv[i]).view(B, L, 3, self.heads, -1).unbind(2)  # (B, L, H, D) each

    def _attend(self, i, x, q, k, v):
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x.add_(torch.tanh(a.transpose(1, 2).reshape(x.shape) @ self.proj[i]))  # in place, as upstream's blocks

    def _forward(self, img, ref, txt, transformer_options):
        """The call sequence of the upstream model's `_forward`: the prefix cache selected, then a malloc graph
        around the block loop (one scope per block, the capture's prefix pass paused), each block's K/V taken
        before its compute and the next block's prefetched on cached passes."""
        to = transformer_options
        B, n_img = img.shape[0], img.shape[1]
        prefix = torch.cat([txt, ref], dim=1)
        patches = to.get("patches", {})
        hooked = patches.get("attn1_patch") or patches.get("post_input")
        cache, cached = None, False
        if self.prefix_cache_enabled and not hooked:
            key = torch.cat([prefix.flatten(1), torch.tensor([[float(n_img)]], device=prefix.device).expand(B, 1)], dim=1)
            cache, cached = self.select_prefix_cache(key, 0, img.device, to.get("qwen_image21_cache", {}))
        x = img.clone()  # updated in place by every block
        mp = model_prefetch()
        queue = mp.make_prefetch_queue(list(self.transformer_blocks), img.device, to)
        mp.malloc_graph_begin(img.device)
        for i in range(len(self.transformer_blocks)):
            mp.prefetch_queue_pop(queue, img.device, ("block", i), img.dtype, malloc_scope="block")
            self._block(i, x, prefix, cache, cached, mp)
        mp.prefetch_queue_pop(queue, img.device, None, malloc_scope="block")
        mp.malloc_graph_end()
        return x

    def _block(self, i, x, prefix, cache, cached, mp):
        B = x.shape[0]
        if cache is not None:
            if not cached:
                with mp.pause_malloc_graph():
                    pq, pk, pv = self._qkv(i, prefix)
                    cache.put(i, torch.stack([pk, pv], dim=1))
                    self._attend(i, prefix, pq, pk, pv)
            ck, cv = cache.take(i, x.device, x.dtype, B).unbind(1)
            if cached:
                cache.prefetch(i + 1, x.device, x.dtype)
            q, k, v = self._qkv(i, x)
            self._attend(i, x, q, torch.cat([ck, k], 1), torch.cat([cv, v], 1))
        else:
            pq, pk, pv = self._qkv(i, prefix)
            q, k, v = self._qkv(i, x)
            self._attend(i, x, q, torch.cat([pk, k], 1), torch.cat([pv, v], 1))
            self._attend(i, prefix, pq, pk, pv)
