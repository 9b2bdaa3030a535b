"""The model patches for FLUX.2 (Klein KV) and Qwen-Image / Qwen-Image-Edit reference K/V.

The contract is the one of ComfyUI's own `FluxKVCache` (comfy_extras/nodes_flux.py): an `attn1_patch`
sees each block's joint q/k/v (B, H, L, D) before RoPE, with the reference tokens last; on the first step
their K/V are captured, on later steps a `post_input` patch drops the reference tokens from the sequence
(RoPE still covers them: `img_ids` are kept) and the attention patch appends the cached K/V again. Where
`FluxKVCache` keeps one GPU dict per block, we keep one engine `KVStore` per cond, of the chosen tier.

Every function here is stateless: the per-run `RunState` is read from `transformer_options[RUN_KEY]`,
which only the outer-sample wrapper of a run puts there. No ComfyUI import.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from .state import CACHED, EXTRACT, RUN_KEY, SPEC_KEY, RunState

log = logging.getLogger(__name__)


def repeat_to_batch_size(t: torch.Tensor, batch: int) -> torch.Tensor:
    """ComfyUI's `comfy.utils.repeat_to_batch_size` (batch dim 0), without importing ComfyUI."""
    if t.shape[0] > batch:
        return t[:batch]
    if t.shape[0] < batch:
        reps = -(-batch // t.shape[0])
        return t.repeat([reps] + [1] * (t.ndim - 1))[:batch]
    return t


MULTI_GPU_KEY = "multigpu_thread_device"  # set by ComfyUI's _calc_cond_batch_multigpu in each thread's options


def live_run(to: dict) -> Optional[RunState]:
    """The run in `to`, or None when there is none or it has stood down.

    Multi-GPU sampling runs the forwards of one step concurrently in threads that share this run's state;
    one forward-in-progress per run cannot describe that, so the run stands down at the first such forward
    (before any state is touched), and every thread passes through.
    """
    run: Optional[RunState] = to.get(RUN_KEY) if isinstance(to, dict) else None
    if run is None:
        return None
    if MULTI_GPU_KEY in to:
        run.stand_down("multi-GPU sampling runs cond batches in parallel threads, which KV Offload does not "
                       "support; it stands down for this run")
    return None if run.stood_down else run


def _transformer_options(args, kwargs) -> dict:
    to = kwargs.get("transformer_options")
    if isinstance(to, dict):
        return to
    for a in reversed(args):
        if isinstance(a, dict):
            return a
    return {}


class RefKVAttention:
    """`attn1_patch`: captures the reference K/V on the extraction forward, feeds it back afterwards."""

    kv_offload = True  # marks our patches, so re-applying the node replaces rather than stacks them

    def __call__(self, q, k, v, extra_options=None, **kwargs):
        run = live_run(extra_options or {})
        fwd = run.forward if run is not None else None
        if fwd is None or fwd.phase not in (EXTRACT, CACHED):
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
        if fwd.phase == EXTRACT:
            kinds = extra_options.get("cond_or_uncond") or []
            for i, u in enumerate(fwd.uuids):
                if u in fwd.capture:
                    rs = slice(i * rows, (i + 1) * rows)
                    label = "uncond" if i < len(kinds) and kinds[i] == 1 else "cond"
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
    to = inputs.get("transformer_options") or {}
    run = live_run(to)
    if run is None:
        return inputs
    ref = sum(to.get("reference_image_num_tokens", None) or [])
    img, txt = inputs["img"], inputs.get("txt")
    fwd = run.begin_forward(to.get("uuids"), ref, img.shape[0])
    if fwd.phase == CACHED:
        inputs["img"] = img = img[:, :-ref]
    # the joint length every attention layer of this forward must see (text first, then image)
    fwd.seq_len = img.shape[1] + txt.shape[1] if isinstance(txt, torch.Tensor) else None
    return inputs


post_input_patch.kv_offload = True


def diffusion_model_wrapper(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper: brackets one forward (per cond batch per step) for the run state."""
    run = live_run(_transformer_options(args, kwargs))
    if run is None:
        return executor(*args, **kwargs)
    run.step()
    ok = False
    try:
        out = executor(*args, **kwargs)
        ok = True
        return out
    finally:
        # on an interrupt mid-forward the half-captured conds are dropped, never served
        run.end_forward(ok)


def make_outer_sample_wrapper(new_run: Callable, clone_options: Callable[[dict], dict], attach: Callable,
                              on_start: Callable = lambda run: None, on_finish: Callable = lambda run: None):
    """OUTER_SAMPLE wrapper factory: one run state per sampling run, closed in `finally`.

    new_run(spec, model_options, model_patcher) -> RunState or None (None: stand down for this run).
    clone_options is ComfyUI's `create_model_options_clone`: attach(run, spec, transformer_options) puts the
    run into the run's copy of the options, never into the cached MODEL's own dict. The `finally` runs on
    normal completion, on `InterruptProcessingException` (a BaseException) and on any error.
    """

    def outer_sample_wrapper(executor, *args, **kwargs):
        guider = executor.class_obj
        orig = guider.model_options
        spec = orig.get("transformer_options", {}).get(SPEC_KEY)
        run = new_run(spec, orig, getattr(guider, "model_patcher", None)) if spec is not None else None
        if run is None:
            return executor(*args, **kwargs)
        guider.model_options = clone_options(orig)
        attach(run, spec, guider.model_options.setdefault("transformer_options", {}))
        on_start(run)
        ok = False
        try:
            out = executor(*args, **kwargs)
            ok = True
            return out
        finally:
            guider.model_options = orig
            try:
                run.close()
            except Exception:
                if ok:
                    raise
                # an exception (an interrupt, a sampling error) is already on its way: it must reach ComfyUI
                log.warning("KV Offload: closing the cache after a failed run also failed", exc_info=True)
            finally:
                on_finish(run)

    outer_sample_wrapper.kv_offload = True
    return outer_sample_wrapper


def is_flux_kv_cache_patch(p) -> bool:
    """True for the patches ComfyUI's `FluxKVCache` node installs (its attention class or its input closure)."""
    if type(p).__name__ == "KV_Attn_Input":
        return True
    qual = getattr(p, "__qualname__", "")
    return qual.startswith("FluxKVCache.")


def is_ours(p) -> bool:
    return bool(getattr(p, "kv_offload", False))
