"""The model patches for FLUX.2 (Klein KV) and Qwen-Image / Qwen-Image-Edit reference K/V.

The contract is the one of ComfyUI's own `FluxKVCache` (comfy_extras/nodes_flux.py): an `attn1_patch`
sees each block's joint q/k/v (B, H, L, D) before RoPE, with the reference tokens last; on the first step
their K/V are captured, on later steps a `post_input` patch drops the reference tokens from the sequence
(RoPE still covers them: `img_ids` are kept) and the attention patch appends the cached K/V again. Where
`FluxKVCache` keeps one GPU dict per block, we keep one engine `KVStore` per cond, in the chosen mode.

Every function here is stateless: the per-run `RunState` is read from `transformer_options[RUN_KEY]`,
which only the outer-sample wrapper of a run puts there. No ComfyUI import.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...offload_core import Mode
from ..run.branch import CACHED, CAPTURE
from ..keys import COND_OR_UNCOND, MULTI_GPU_KEY, TRANSFORMER_OPTIONS, UUIDS, WRAPPER_KEY
from ..run.branch import repeat_to_batch_size
from ..run.state import live_run

log = logging.getLogger(__name__)


def branch_keys(to: dict) -> list:
    """The branches of this forward's conds: their uuids, with the thread's device under multi-GPU sampling (a
    cond moved to another device is captured there anew: a store serves one thread)."""
    uuids = list(to.get(UUIDS) or [])
    device = to.get(MULTI_GPU_KEY)
    return uuids if device is None else [(str(device), u) for u in uuids]


class RefKVAttention:
    """`attn1_patch`: captures the reference K/V on the capture forward, feeds it back afterwards."""

    kv_offload = True  # marks our patches, so re-applying the node replaces rather than stacks them

    def __call__(self, q, k, v, extra_options=None, **kwargs):
        run = live_run(extra_options or {})
        fwd = run.forward if run is not None else None
        if fwd is None or fwd.phase not in (CAPTURE, CACHED):
            return {}
        layer = (extra_options.get("block_type"), extra_options.get("block_index"))
        rows, ref = fwd.rows, fwd.ref_tokens
        if fwd.seq_len is not None and k.shape[2] != fwd.seq_len:
            # another patch added or removed tokens after ours: the reference tokens may not be the last ones
            why = (f"the joint sequence at layer {layer} has {k.shape[2]} tokens where {fwd.seq_len} were "
                   "expected: another patch changed the sequence after KV Offload's post-input patch")
            if fwd.phase == CACHED:  # the reference tokens are already gone from this forward: refuse it
                raise RuntimeError(f"KV Offload: {why}. Place the other node before KV Offload Settings, or "
                                   "use mode 'off' with it.")
            run.stand_down(why + ", so the reference tokens cannot be located")
            return {}
        if fwd.phase == CAPTURE:
            kinds = extra_options.get(COND_OR_UNCOND) or []
            for i, u in enumerate(fwd.uuids):
                if u in fwd.capture:
                    rs = slice(i * rows, (i + 1) * rows)
                    label = "uncond" if i < len(kinds) and kinds[i] == 1 else "cond"
                    if isinstance(u, tuple):  # multi-GPU: the readout names the device of each store
                        label = f"{label} on {u[0]}"
                    run.put(u, layer, k[rs, :, -ref:], v[rs, :, -ref:], label=label)
            return {}
        ks, vs = [], []
        for u in fwd.uuids:
            kk, vv = run.get(u, layer)
            # torch.cat copies: the store's buffers may be reused by its next get()
            ks.append(repeat_to_batch_size(kk, rows))
            vs.append(repeat_to_batch_size(vv, rows))
        kk = ks[0] if len(ks) == 1 else torch.cat(ks, dim=0)
        vv = vs[0] if len(vs) == 1 else torch.cat(vs, dim=0)
        kk = repeat_to_batch_size(kk, k.shape[0])
        vv = repeat_to_batch_size(vv, v.shape[0])
        return {"q": q, "k": torch.cat((k, kk), dim=2), "v": torch.cat((v, vv), dim=2)}


def post_input_patch(inputs: dict) -> dict:
    """`post_input`: decides the phase of this forward and drops the reference tokens when cached."""
    to = inputs.get(TRANSFORMER_OPTIONS) or {}
    run = live_run(to)
    if run is None:
        return inputs
    ref = sum(to.get("reference_image_num_tokens", None) or [])
    img, txt = inputs["img"], inputs.get("txt")
    fwd = run.begin_forward(branch_keys(to), ref, img.shape[0])
    if fwd.phase == CACHED:
        inputs["img"] = img = img[:, :-ref]
    # the joint length every attention layer of this forward must see (text first, then image)
    fwd.seq_len = img.shape[1] + txt.shape[1] if isinstance(txt, torch.Tensor) else None
    return inputs


post_input_patch.kv_offload = True


def is_flux_kv_cache_patch(p) -> bool:
    """True for the patches ComfyUI's `FluxKVCache` node installs (its attention class or its input closure)."""
    if type(p).__name__ == "KV_Attn_Input":
        return True
    qual = getattr(p, "__qualname__", "")
    return qual.startswith("FluxKVCache.")


def is_ours(p) -> bool:
    return bool(getattr(p, WRAPPER_KEY, False))


# --- the FLUX.2 Klein KV and Qwen-Image(-Edit) families --------------------------------------------------------

def patch_reference_kv(m, dm, config, to: dict, reuse: bool) -> "tuple[Any, list]":
    """Patch the clone `m` the way `FluxKVCache` does, with our stores behind it; `(config, notes)` unchanged.

    The reference tokens are modulated at t = 0 (FluxKVCache's `index_timestep_zero`), so their K/V do not
    depend on the step; mode off keeps that and adds no attention patch. `to` and `reuse` are not used here.
    """
    params = hasattr(getattr(dm, "params", None), "default_ref_method")  # FLUX.2 keeps it in its params
    m.add_object_patch(f"diffusion_model{'.params' if params else ''}.default_ref_method", "index_timestep_zero")
    if config.mode is not Mode.OFF:
        m.set_model_attn1_patch(RefKVAttention())
        m.set_model_post_input_patch(post_input_patch)
    return config, []


def unless_flux_kv_cache_after(config, to: dict):
    """The run's config, or None (stand down) when `FluxKVCache` patched the model after our node."""
    if any(is_flux_kv_cache_patch(p) for p in to.get("patches", {}).get("attn1_patch", [])):
        log.warning("KV Offload: FluxKVCache is applied after KV Offload Settings; it caches on the GPU and "
                    "KV Offload stands down for this run. Put FluxKVCache before the node, or remove it.")
        return None
    return config
