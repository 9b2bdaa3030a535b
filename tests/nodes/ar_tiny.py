"""A tiny causal (autoregressive) Wan and ComfyUI's AR video sampler loop, driving the KV caches as ComfyUI does.

`TinyCausalWan.forward_block` mirrors the cache traffic of `CausalWanSelfAttention.forward` in ComfyUI v0.33
(`comfy/ldm/wan/ar_model.py`): per layer `end = kv_cache["end"]`, `kv_cache["k"][:, end:new_end] = k` (and v),
`kv_cache["end"] = new_end`, attention over `kv_cache["k"][:, :new_end].view(b, new_end, n * d)`; its caches come
from `init_kv_caches(batch, max_seq_len, device, dtype)` as upstream's (zeros). The block loop runs in a malloc
graph with a scope per block, as models under ComfyUI's compiler do. `sample_ar` follows `sample_ar_video`
(`comfy/k_diffusion/sampling.py`): the optional I2V pass at sigma 0, per block the denoising steps with a rewind
of every cache's `end` after each step that re-noises, the rewind before the clean pass at sigma 0. Each model call
goes through the APPLY_MODEL wrappers, the whole loop through the OUTER_SAMPLE ones, and the object patches are
set on the model while it samples (ModelPatcher.patch_model). The layers are small random matmuls, not Wan's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from malloc_graph import model_prefetch
from nodes_tiny import Executor, Guider, through_outer_wrappers

C, PATCH = 4, 2


class TinyCausalWan(torch.nn.Module):
    def __init__(self, dim=16, heads=2, layers=3, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_layers, self.dim = heads, layers, dim
        self.blocks = [None] * layers
        w = lambda a, b: torch.randn(a, b, generator=g) * a ** -0.5  # noqa: E731
        self.w_in, self.w_out, self.w_t = w(C * PATCH * PATCH, dim), w(dim, C * PATCH * PATCH), w(1, dim)
        self.layers = [(w(dim, dim), w(dim, dim), w(dim, dim), w(dim, dim)) for _ in range(layers)]
        self.fail_at = None  # (model call number, layer): raise there, inside the attention
        self.calls = 0

    @property
    def head_dim(self):
        return self.dim // self.num_heads

    def init_kv_caches(self, batch_size, max_seq_len, device, dtype):
        return [{"k": torch.zeros(batch_size, max_seq_len, self.num_heads, self.head_dim, device=device, dtype=dtype),
                 "v": torch.zeros(batch_size, max_seq_len, self.num_heads, self.head_dim, device=device, dtype=dtype),
                 "end": 0} for _ in range(self.num_layers)]

    def forward_block(self, x, timestep, start_frame, kv_caches):
        b, c, t, h, w = x.shape
        tokens = x.reshape(b, c, t, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 3, 5, 1, 4, 6)
        tokens = tokens.reshape(b, t * (h // PATCH) * (w // PATCH), c * PATCH * PATCH)
        s = tokens.shape[1]
        frame = (h // PATCH) * (w // PATCH)
        pos = torch.arange(start_frame * frame, start_frame * frame + s, dtype=x.dtype)[None, :, None]
        hidden = tokens @ self.w_in + timestep.reshape(b, 1, 1) * self.w_t + torch.sin(pos / 7.0)
        mp = model_prefetch()
        mp.malloc_graph_begin(x.device)
        for i, weights in enumerate(self.layers):
            mp.prefetch_queue_pop(None, x.device, i, x.dtype, malloc_scope="block")
            hidden.add_(self._attention(i, hidden, pos, weights, kv_caches[i]))  # in place, as upstream keeps it
        mp.prefetch_queue_pop(None, x.device, None, malloc_scope="block")
        mp.malloc_graph_end()
        out = (hidden @ self.w_out).reshape(b, t, h // PATCH, w // PATCH, c, PATCH, PATCH)
        return out.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, t, h, w)

    def _attention(self, i, x, pos, weights, kv_cache):
        wq, wk, wv, wo = weights
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = (x @ wq + torch.cos(pos / 5.0)).view(b, s, n, d)
        k = (x @ wk + torch.cos(pos / 5.0)).view(b, s, n, d)  # "roped": depends on the absolute position
        v = (x @ wv).view(b, s, n, d)
        if self.fail_at == (self.calls, i):
            raise KeyboardInterrupt("interrupted mid-forward")
        end = kv_cache["end"]
        new_end = end + s
        kv_cache["k"][:, end:new_end] = k
        kv_cache["v"][:, end:new_end] = v
        kv_cache["end"] = new_end
        keys = kv_cache["k"][:, :new_end].view(b, new_end, n * d)
        values = kv_cache["v"][:, :new_end].view(b, new_end, n * d)
        split = lambda t_: t_.view(b, t_.shape[1], n, d).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(q.view(b, s, n * d)), split(keys), split(values))
        return torch.tanh(a.transpose(1, 2).reshape(b, s, n * d) @ wo)


def apply_model(dm, x, sigma, transformer_options):
    """`BaseModel.apply_model`: the APPLY_MODEL wrappers around the model call (first registered outermost)."""
    fns = [w for ws in transformer_options.get("wrappers", {}).get("apply_model", {}).values() for w in ws]

    def inner(x, t, c_concat, c_crossattn, control, to, **kwargs):
        dm.calls += 1
        ar = to["ar_state"]
        flow = dm.forward_block(x, t.expand(x.shape[0]), ar["start_frame"], ar["kv_caches"])
        return x - t.reshape(-1, 1, 1, 1, 1) * flow  # flow matching: the denoised latent

    def call(i, *a, **k):
        if i == len(fns):
            return inner(*a, **k)
        return fns[i](Executor(dm, lambda *b, **kk: call(i + 1, *b, **kk)), *a, **k)

    return call(0, x, sigma, None, None, None, transformer_options)


def sample_ar(dm, model_options, x, sigmas, num_frame_per_block=1, initial_latent=None, object_patches=None, seed=0,
              clean_sigma=0.0):
    """`sample_ar_video` with `dm` as the causal model; returns the video latent. `clean_sigma`: the sigma of the
    clean pass (0 upstream; another value models a sampler that commits its blocks otherwise)."""
    guider = Guider(model_options)
    saved = {}
    for name, obj in (object_patches or {}).items():  # ModelPatcher.patch_model: set while sampling
        attr = name.split(".", 1)[1]
        saved[attr] = dm.__dict__.get(attr)
        setattr(dm, attr, obj)

    def loop():
        to = guider.model_options.setdefault("transformer_options", {})
        bs, _, lat_t, lat_h, lat_w = x.shape
        frame_seq_len = -(-lat_h // 2) * -(-lat_w // 2)
        num_blocks = -(-lat_t // num_frame_per_block)
        kv_caches = dm.init_kv_caches(bs, lat_t * frame_seq_len, x.device, x.dtype)
        output = torch.zeros_like(x)
        s_in = x.new_ones([bs])
        start = 0

        def model(inp, sigma):
            return apply_model(dm, inp, sigma, dict(to))

        if initial_latent is not None:
            n_init = initial_latent.shape[2]
            output[:, :, :n_init] = initial_latent
            to["ar_state"] = {"start_frame": 0, "kv_caches": kv_caches}
            model(initial_latent, sigmas.new_zeros([1]) * s_in)
            start = n_init
            num_blocks = -(-(lat_t - n_init) // num_frame_per_block)
        try:
            for block in range(num_blocks):
                bf = min(num_frame_per_block, lat_t - start)
                noisy = x[:, :, start:start + bf]
                to["ar_state"] = {"start_frame": start, "kv_caches": kv_caches}
                for i in range(len(sigmas) - 1):
                    denoised = model(noisy, sigmas[i] * s_in)
                    if sigmas[i + 1] == 0:
                        noisy = denoised
                    else:
                        g = torch.Generator().manual_seed(seed + block * 1000 + i)
                        noisy = (1.0 - sigmas[i + 1]) * denoised + sigmas[i + 1] * torch.randn(denoised.shape, generator=g)
                        for cache in kv_caches:
                            cache["end"] -= bf * frame_seq_len
                output[:, :, start:start + bf] = noisy
                for cache in kv_caches:
                    cache["end"] -= bf * frame_seq_len
                model(noisy, (sigmas.new_zeros([1]) + clean_sigma) * s_in)
                start += bf
        finally:
            to.pop("ar_state", None)
        return output

    try:
        return through_outer_wrappers(model_options, guider, loop)
    finally:
        for attr, old in saved.items():
            if old is None:
                delattr(dm, attr)
            else:
                setattr(dm, attr, old)
