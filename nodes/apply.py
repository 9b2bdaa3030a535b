"""Turn the node's inputs into an `OffloadConfig` and patch a clone of a ComfyUI MODEL with it.

Works on any object with ComfyUI's `ModelPatcher` methods (`clone`, `get_model_object`, `model_options`,
`set_model_attn1_patch`, `set_model_post_input_patch`, `add_object_patch`, `add_wrapper_with_key`,
`remove_wrappers_with_key`), so it runs in unit tests without ComfyUI.

FluxKVCache interplay (no double caching):
- `FluxKVCache` upstream of this node (its patches are already on the incoming MODEL): they are removed
  from our clone and our cache takes over, in whatever mode was picked (`off` included).
- `FluxKVCache` downstream (it patches our output): found when the run starts; ours stands down for that
  run with a warning and `FluxKVCache` caches on the GPU as it would alone.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Callable, Optional

from ..offload_core import Mode, OffloadConfig
from .patches import (RefKVAttention, diffusion_model_wrapper, is_flux_kv_cache_patch, is_ours,
                      make_outer_sample_wrapper, post_input_patch)
from .qwen21 import OPTIONS_KEY, has_prefix_cache, make_select_prefix_cache
from .state import RUN_KEY, SPEC_KEY, RunSpec, RunState

log = logging.getLogger(__name__)

WRAPPER_KEY = "kv_offload"
OUTER_SAMPLE, DIFFUSION_MODEL = "outer_sample", "diffusion_model"  # comfy.patcher_extension.WrappersMP
MODES = [m.value for m in Mode]
STORAGES = ["exact", "fp8", "int8"]
MIB = 1 << 20


def _mib(name: str, value, zero: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a whole number of MiB >= 0; got {value!r}. Use 0 to {zero}.")
    return value * MIB


def config_from_inputs(mode, prefetch_depth=None, bypass_page_cache=None, pin_budget_mb=None,
                       vram_budget_mb=None, storage=None) -> OffloadConfig:
    """The node's widgets -> a validated `OffloadConfig` (raises the engine's `ValueError`).

    A widget always holds a value, so options that do not apply to the picked mode are left out rather
    than rejected: prefetch depth and pin budget reach only the async tiers and `auto`, the page-cache
    switch only the file tiers and `auto`, the VRAM budget only the streaming modes and `auto`, the storage
    every mode but `off`. A pin budget or VRAM budget of 0 leaves it to ComfyUI / the mode.
    """
    m = Mode.parse(mode)
    fields = {"mode": m}
    if m.takes_async_options and prefetch_depth is not None:
        fields["prefetch_depth"] = prefetch_depth
    if m.takes_file_options and bypass_page_cache is not None:
        fields["bypass_page_cache"] = bypass_page_cache
    if m.takes_async_options and pin_budget_mb is not None:
        if _mib("pin_budget_mb", pin_budget_mb, "leave the budget to ComfyUI"):
            fields["pin_budget"] = pin_budget_mb * MIB
    if vram_budget_mb is not None:
        budget = _mib("vram_budget_mb", vram_budget_mb, "let the mode decide")
        if budget and m.takes_device_budget:
            fields["device_budget"] = budget
    if storage is not None and m.takes_storage:
        fields["storage"] = storage
    return OffloadConfig(**fields)


# ComfyUI's own Qwen-Image 2.1 cache options: dtype -> the nearest storage of ours.
QWEN21_DTYPES = {"default": None, "int8": "int8", "int4": "int8"}


def storage_for_qwen21(config: OffloadConfig, options: Optional[dict]) -> "tuple[OffloadConfig, Optional[str]]":
    """Honour `options["dtype"]` of ComfyUI's Qwen-Image 2.1 cache: the config to use, and what to tell the user.

    Our node's own `storage` (anything but exact) wins over it, said so; `int8` is ours; `int4` has no
    equivalent and maps to `int8` (twice int4's bytes, half of exact). An unknown value keeps exact, said so.
    """
    dtype = (options or {}).get("dtype")
    if dtype in (None, "default") or config.mode is Mode.OFF:
        return config, None
    if config.storage != "exact":
        return config, (f"KV Offload: Qwen-Image 2.1 cache dtype {dtype!r} is overridden by this node's storage "
                        f"{config.storage!r}.")
    mapped = QWEN21_DTYPES.get(dtype)
    if mapped is None:
        return config, (f"KV Offload: Qwen-Image 2.1 cache dtype {dtype!r} is not one KV Offload knows "
                        "(default, int8, int4); the cache stays exact. Set `storage` on the node instead.")
    note = "" if mapped == dtype else f" (the nearest KV Offload has: {dtype} is not available, int8 keeps twice its bytes)"
    return dataclasses.replace(config, storage=mapped), (
        f"KV Offload: Qwen-Image 2.1 cache dtype {dtype!r} -> storage {mapped!r}{note}.")


def validation_message(**inputs) -> "bool | str":
    """True, or the engine's message for the first bad value (what `validate_inputs` returns).

    A linked input reaches validation as None (its value exists only at execution, where `execute` checks
    it): None options are left out, and with no mode yet there is nothing to check against.
    """
    if inputs.get("mode") is None:
        return True
    try:
        config_from_inputs(**inputs)
    except ValueError as e:
        return str(e)
    return True


def detect_family(dm) -> Optional[str]:
    """"qwen_image21" (prefix-cache seam), "flux" (Flux / FLUX.2), "qwen_image" (Qwen-Image / -Edit) or None."""
    if has_prefix_cache(dm):
        return "qwen_image21"
    if hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks"):
        return "flux"
    if hasattr(dm, "transformer_blocks") and hasattr(dm, "default_ref_method"):
        return "qwen_image"
    return None


def count_layers(dm, family: str) -> int:
    if family == "flux":
        return len(dm.double_blocks) + len(dm.single_blocks)
    return len(dm.transformer_blocks)


def _strip_patches(model) -> list:
    """Remove FluxKVCache's and earlier KV Offload patches from the clone; return what was removed."""
    patches = model.model_options.get("transformer_options", {}).get("patches", {})
    removed = []
    for name in ("attn1_patch", "post_input"):
        kept = []
        for p in patches.get(name, []):
            (removed if is_flux_kv_cache_patch(p) or is_ours(p) else kept).append(p)
        if name in patches:
            if kept:
                patches[name] = kept
            else:
                del patches[name]
    for kind in (OUTER_SAMPLE, DIFFUSION_MODEL):
        model.remove_wrappers_with_key(kind, WRAPPER_KEY)
    return removed


def _set_ref_method(model, dm) -> None:
    # what FluxKVCache does: reference tokens modulated at t = 0, so their K/V do not depend on the step
    if hasattr(dm, "params") and hasattr(dm.params, "default_ref_method"):
        model.add_object_patch("diffusion_model.params.default_ref_method", "index_timestep_zero")
    else:
        model.add_object_patch("diffusion_model.default_ref_method", "index_timestep_zero")


def apply_offload(model, config: OffloadConfig, *, host: Callable, store_factory: Callable, telemetry=None,
                  reuse: bool = False):
    """Return `(patched clone, message)`; the input MODEL is never modified.

    host(model_patcher) -> HostServices, evaluated once per run. store_factory: `KVStore`. reuse: keep
    Qwen-Image 2.1 prefixes across runs (see `nodes/reuse.py`); off for the other families, whatever is asked.
    """
    m = model.clone()
    dm = m.get_model_object("diffusion_model")
    family = detect_family(dm)
    if family is None:  # before any patch is touched: an upstream FluxKVCache keeps working
        msg = (f"KV Offload: {type(dm).__name__} has no reference K/V seam this pack knows (FLUX.2 Klein KV, "
               "Qwen-Image, Qwen-Image-Edit, Qwen-Image 2.1 on ComfyUI versions that have it); model unchanged.")
        log.warning(msg)
        return m, msg
    _decided(family, reuse and config.mode is not Mode.OFF)
    removed = _strip_patches(m)
    if any(is_flux_kv_cache_patch(p) for p in removed):
        log.info("KV Offload: FluxKVCache found upstream; its GPU cache is replaced by mode %s.", config.mode)
    to = m.model_options.setdefault("transformer_options", {})
    notes = []
    if family == "qwen_image21":
        opts = dict(to.get(OPTIONS_KEY) or {})
        config, note = storage_for_qwen21(config, opts)  # ComfyUI's own cache node upstream of ours
        if note:
            log.warning(note)
            notes.append(note)
        if config.mode is Mode.OFF:
            opts["device"] = "off"
        else:
            if opts.get("device") == "off":  # an upstream "off" would stop the model asking for our cache
                del opts["device"]
            original = type(dm).select_prefix_cache.__get__(dm)  # the class's, not an earlier object patch
            m.add_object_patch("diffusion_model.select_prefix_cache",
                               make_select_prefix_cache(original, count_layers(dm, family),
                                                        _node_reuse(m) if reuse else None))
        to[OPTIONS_KEY] = opts
    else:
        _set_ref_method(m, dm)
        if config.mode is not Mode.OFF:
            m.set_model_attn1_patch(RefKVAttention())
            m.set_model_post_input_patch(post_input_patch)
    if config.mode is Mode.OFF:
        to.pop(SPEC_KEY, None)
        if telemetry is not None:  # the readout still shows the run (memory, no stores)
            m.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _readout_only(telemetry))
            m.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, _readout_step(telemetry))
        msg = f"KV Offload: mode off on {family}: the prefix is recomputed every step."
        log.info(msg)
        return m, msg
    to[SPEC_KEY] = RunSpec(config=config, host=host, n_layers=count_layers(dm, family), family=family)
    m.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _outer_wrapper(store_factory, telemetry))
    m.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper)
    msg = " ".join([f"KV Offload: mode {config.mode.value} on {family}.", *notes])
    log.info(msg)
    return m, msg


def _decided(family: str, reuse: bool) -> None:
    from .reuse import REUSE

    REUSE.decided(family, reuse)


def _node_reuse(m):
    """The process-wide `NodeReuse`; a model unload (`ModelPatcher.detach`) drops what it kept for this model."""
    from .reuse import ON_DETACH, REUSE

    if callable(getattr(m, "add_callback", None)):
        m.add_callback(ON_DETACH, REUSE.on_detach)
    return REUSE


def copy_nested_dicts(d: dict) -> dict:
    """ComfyUI's `create_model_options_clone`: dicts copied recursively, lists shallowly, values shared."""
    out = d.copy()
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = copy_nested_dicts(v)
        elif isinstance(v, list):
            out[k] = v.copy()
    return out


def _outer_wrapper(store_factory: Callable, telemetry):
    def new_run(spec: RunSpec, model_options: dict, patcher) -> Optional[RunState]:
        attn = model_options.get("transformer_options", {}).get("patches", {}).get("attn1_patch", [])
        if spec.family != "qwen_image21" and any(is_flux_kv_cache_patch(p) for p in attn):
            log.warning("KV Offload: FluxKVCache is applied after KV Offload Settings; it caches on the GPU and "
                        "KV Offload stands down for this run. Put FluxKVCache before the node, or remove it.")
            return None
        config = spec.config
        if spec.family == "qwen_image21":  # options set after our node (ComfyUI's cache node downstream)
            config, note = storage_for_qwen21(config, model_options.get("transformer_options", {}).get(OPTIONS_KEY))
            if note and config is not spec.config:
                log.warning(note)
        run = RunState(config, spec.host(patcher), spec.n_layers, store_factory, telemetry)
        run.patcher = patcher  # prefix reuse keys by the weight-patch set this run samples with
        run.model_options = model_options  # ... and by the options that reach the forward
        return run

    def attach(run: RunState, spec: RunSpec, to: dict) -> None:
        to[RUN_KEY] = run
        if spec.family == "qwen_image21":
            to[OPTIONS_KEY] = {**(to.get(OPTIONS_KEY) or {}), RUN_KEY: run}

    def on_start(run: RunState) -> None:
        if telemetry is not None:
            _safe(telemetry.run_started, run.run_id)

    def on_finish(run: RunState) -> None:
        if telemetry is not None:
            _safe(telemetry.run_finished, run.run_id)

    return make_outer_sample_wrapper(new_run, copy_nested_dicts, attach, on_start, on_finish)


def _readout_only(telemetry):
    """OUTER_SAMPLE wrapper for mode `off`: brackets the run for the readout; no cache, no run state."""

    def outer_sample_wrapper(executor, *args, **kwargs):
        run_id = uuid.uuid4().hex[:12]
        _safe(telemetry.run_started, run_id)
        try:
            return executor(*args, **kwargs)
        finally:
            _safe(telemetry.run_finished, run_id)

    outer_sample_wrapper.kv_offload = True
    return outer_sample_wrapper


def _readout_step(telemetry):
    def diffusion_model_wrapper(executor, *args, **kwargs):
        _safe(telemetry.step)
        try:
            return executor(*args, **kwargs)
        finally:  # a push after the forward too, as with a cache
            _safe(telemetry.forward_done)

    diffusion_model_wrapper.kv_offload = True
    return diffusion_model_wrapper


def _safe(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the readout must never break sampling
        log.debug("telemetry call failed", exc_info=True)
