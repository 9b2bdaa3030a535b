"""A tiny joint-attention DiT and sampler that drive the patches exactly as ComfyUI does, without ComfyUI.

`TinyDiT.forward` follows `comfy/ldm/flux/model.py`: the DIFFUSION_MODEL wrappers wrap the forward, the
`post_input` patches see `{"img", "txt", "img_ids", "txt_ids", "transformer_options"}` with the reference
tokens last in `img` and `reference_image_num_tokens` set, every block hands its joint q/k/v (B, H, L, D)
to the `attn1_patch`es with `block_type` / `block_index`, double blocks first, then single blocks.
`FluxKVCacheReference` is ComfyUI's `FluxKVCache` contract (one dict of GPU tensors per block), the
baseline mode `gpu` must match bit for bit.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from malloc_graph import model_prefetch


class TinyDiT(torch.nn.Module):
    def __init__(self, hidden=32, heads=2, double=2, single=2, seed=0, device="cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads = heads
        self.double_blocks, self.single_blocks = [None] * double, [None] * single  # what detection looks at
        self.default_ref_method = "index"
        self.blocks = [("double", i) for i in range(double)] + [("single", i) for i in range(single)]
        self.qkv = [(torch.randn(hidden, 3 * hidden, generator=g) * hidden ** -0.5).to(device) for _ in self.blocks]
        self.proj = [(torch.randn(hidden, hidden, generator=g) * hidden ** -0.5).to(device) for _ in self.blocks]

    def forward(self, img, ref, txt, transformer_options):
        return through_model_wrappers(self, img, ref, txt, transformer_options)

    def _forward(self, img, ref, txt, transformer_options):
        to = dict(transformer_options)
        n_img = img.shape[1]
        to["reference_image_num_tokens"] = [ref.shape[1]]
        x_img = torch.cat([img, ref], dim=1)
        for p in to.get("patches", {}).get("post_input", []):
            out = p({"img": x_img, "txt": txt, "img_ids": None, "txt_ids": None, "transformer_options": to})
            x_img, txt = out["img"], out["txt"]
        x = torch.cat([txt, x_img], dim=1)
        # The block loop as a model under ComfyUI's compiler runs it (Qwen-Image 2.1's, comfy/ldm/qwen_image21): a
        # graph around the blocks, one allocation scope per block, the hidden state updated in place.
        mp = model_prefetch()
        mp.malloc_graph_begin(x.device)
        for (btype, bidx), w_qkv, w_proj in zip(self.blocks, self.qkv, self.proj):
            mp.prefetch_queue_pop(None, x.device, (btype, bidx), x.dtype, malloc_scope="block")
            to["block_type"], to["block_index"] = btype, bidx
            self._block(x, w_qkv, w_proj, to)
        mp.prefetch_queue_pop(None, x.device, None, malloc_scope="block")
        mp.malloc_graph_end()
        return x[:, txt.shape[1]:txt.shape[1] + n_img]

    def _block(self, x, w_qkv, w_proj, to):
        B, L, C = x.shape
        q, k, v = (x @ w_qkv).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        extra = dict(to)
        for p in to.get("patches", {}).get("attn1_patch", []):
            out = p(q, k, v, pe=None, attn_mask=None, extra_options=extra)
            q, k, v = out.get("q", q), out.get("k", k), out.get("v", v)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, C)
        x.add_(torch.tanh(a @ w_proj))


class FluxKVCacheReference:
    """ComfyUI's `FluxKVCache` (comfy_extras/nodes_flux.py) as a contract: a GPU dict keyed by block."""

    def __init__(self):
        self.cache = {}

    def attn(self, q, k, v, extra_options, **kwargs):
        ref = sum(extra_options.get("reference_image_num_tokens", []))
        if ref == 0:
            return {}
        key = "{}_{}".format(extra_options["block_type"], extra_options["block_index"])
        if key in self.cache:
            kk, vv = self.cache[key]
            kk = _repeat(kk, k.shape[0])
            vv = _repeat(vv, v.shape[0])
            return {"q": q, "k": torch.cat((k, kk), dim=2), "v": torch.cat((v, vv), dim=2)}
        self.cache[key] = (k[:, :, -ref:].clone(), v[:, :, -ref:].clone())
        return {"q": q, "k": k, "v": v}

    def post_input(self, inputs):
        if self.cache:
            ref = sum(inputs["transformer_options"].get("reference_image_num_tokens", []))
            if ref > 0:
                inputs["img"] = inputs["img"][:, :-ref]
        return inputs

    def options(self):
        return {"patches": {"attn1_patch": [self.attn], "post_input": [self.post_input]}}


def _repeat(t, batch):
    if t.shape[0] == batch:
        return t
    return t.repeat([-(-batch // t.shape[0])] + [1] * (t.ndim - 1))[:batch]


class Executor:
    """Stands in for ComfyUI's WrapperExecutor: `class_obj` is the guider (OUTER_SAMPLE) or the diffusion model
    (DIFFUSION_MODEL)."""

    def __init__(self, guider, fn):
        self.class_obj = guider
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Guider:
    def __init__(self, model_options):
        self.model_options = model_options
        self.model_patcher = None


def sample(model: TinyDiT, model_options: dict, noise, refs, txts, steps=4, cfg=None, batched=True, fail_at=None,
           multigpu=False):
    """Euler-ish loop; `refs` / `txts` are per cond (cond first, uncond second when cfg is set).

    Runs the OUTER_SAMPLE wrappers around the loop like `CFGGuider.outer_sample`. `fail_at=(step, uuid)`
    raises KeyboardInterrupt (a BaseException, like ComfyUI's InterruptProcessingException) inside that
    forward, after its first block. `multigpu`: like `_calc_cond_batch_multigpu`, the cond batches of a step
    run concurrently in threads, each with `multigpu_thread_device` in its options: True labels them `cpu:0`,
    `cpu:1` on the one model; a list of devices runs a copy of the model on each (inputs moved there, outputs
    back), as on real GPUs.
    """
    guider = Guider(model_options)
    uuids = ["cond-uuid", "uncond-uuid"][: 2 if cfg is not None else 1]

    devices = multigpu if isinstance(multigpu, (list, tuple)) else None
    copies = [copy.deepcopy(model).to(d) for d in devices] if devices else []

    def loop():
        pools = []
        try:
            return steps_of(pools)
        finally:
            for pool in pools:
                pool.shutdown()

    def steps_of(pools):
        x = noise.clone()
        for step in range(steps):
            to = dict(guider.model_options.get("transformer_options", {}))
            to["sigmas"] = torch.tensor([1.0 - step / steps])
            groups = [uuids] if batched else [[u] for u in uuids]
            outs = {}

            def run_group(group, x=x, to=to, step=step):
                idx = [uuids.index(u) for u in group]
                t = dict(to, uuids=list(group), cond_or_uncond=idx)
                where, on = model, x.device
                if multigpu:  # one device per cond batch, as the scheduler spreads them: cpu:0, cpu:1
                    i = groups.index(group)
                    t["multigpu_thread_device"] = devices[i] if devices else torch.device("cpu", i)
                    where, on = (copies[i], devices[i]) if devices else (model, x.device)
                if fail_at is not None and fail_at[0] == step and fail_at[1] in group:
                    t["patches"] = _failing(t.get("patches", {}))
                out = where.forward(torch.cat([x] * len(group)).to(on), torch.cat([refs[i] for i in idx]).to(on),
                                    torch.cat([txts[i] for i in idx]).to(on), t).to(x.device)
                for j, u in enumerate(group):
                    outs[u] = out[j * x.shape[0]:(j + 1) * x.shape[0]]

            if multigpu:  # one thread per device for the whole run, as ComfyUI's MultiGPUThreadPool keeps
                if not pools:
                    pools.extend(ThreadPoolExecutor(1) for _ in groups)
                for f in [pool.submit(run_group, g) for pool, g in zip(pools, groups)]:
                    f.result()
            else:
                for group in groups:
                    run_group(group)
            d = outs[uuids[0]] if cfg is None else outs[uuids[1]] + cfg * (outs[uuids[0]] - outs[uuids[1]])
            x = x - 0.25 * d
        return x

    return through_outer_wrappers(model_options, guider, loop)


def through_model_wrappers(model, *args):
    """`model._forward(*args)` inside every DIFFUSION_MODEL wrapper of its options (`args[-1]`), first registered
    outermost, each handed an executor whose `class_obj` is the model (ComfyUI's `WrapperExecutor`)."""
    fns = [w for ws in args[-1].get("wrappers", {}).get("diffusion_model", {}).values() for w in ws]

    def call(i, *a):
        if i == len(fns):
            return model._forward(*a)
        return fns[i](Executor(model, lambda *b, **k: call(i + 1, *b)), *a)

    return call(0, *args)


def through_outer_wrappers(model_options: dict, guider, loop):
    """Runs `loop` inside every OUTER_SAMPLE wrapper of `model_options`, first registered outermost (ComfyUI's
    `WrapperExecutor` chain)."""
    wrappers = [w for ws in model_options.get("transformer_options", {}).get("wrappers", {})
                .get("outer_sample", {}).values() for w in ws]

    def call(i):
        if i == len(wrappers):
            return loop()
        return wrappers[i](Executor(guider, lambda: call(i + 1)))

    return call(0)


def _failing(patches):
    def boom(q, k, v, extra_options, **kwargs):
        if extra_options["block_index"] == 1:
            raise KeyboardInterrupt("interrupted mid-forward")
        return {}

    out = {k: list(v) for k, v in patches.items()}
    out["attn1_patch"] = out.get("attn1_patch", []) + [boom]
    return out


class FakePatcher:
    """The slice of ComfyUI's `ModelPatcher` that `apply_offload` uses; `options()` is what sampling sees."""

    def __init__(self, dm, model_options=None):
        self.dm = dm
        self.model_options = model_options or {"transformer_options": {}}
        self.wrappers = {}
        self.object_patches = {}
        self.load_device = None  # ComfyUI's names where sampling computes; None: a stand-in that does not say

    def clone(self):
        from kv_offload_pack.nodes.run.wrappers import copy_nested_dicts

        n = FakePatcher(self.dm, copy_nested_dicts(self.model_options))
        n.wrappers = {t: {k: list(v) for k, v in d.items()} for t, d in self.wrappers.items()}
        n.object_patches = dict(self.object_patches)
        n.load_device = self.load_device  # as ComfyUI's clone keeps it
        return n

    def get_model_object(self, name):
        assert name == "diffusion_model"
        return self.dm

    def _set_patch(self, patch, name):
        to = self.model_options.setdefault("transformer_options", {})
        to.setdefault("patches", {})
        to["patches"][name] = to["patches"].get(name, []) + [patch]

    def set_model_attn1_patch(self, patch):
        self._set_patch(patch, "attn1_patch")

    def set_model_post_input_patch(self, patch):
        self._set_patch(patch, "post_input")

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def add_wrapper_with_key(self, kind, key, fn):
        self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_wrappers_with_key(self, kind, key):
        self.wrappers.get(kind, {}).pop(key, None)

    def options(self):
        from kv_offload_pack.nodes.run.wrappers import copy_nested_dicts

        mo = copy_nested_dicts(self.model_options)
        mo.setdefault("transformer_options", {})["wrappers"] = self.wrappers
        return mo
