"""The ComfyUI wrappers the node adds to its clone: one run state per sampling run, or only the readout's marks.

OUTER_SAMPLE wraps a whole sampling run, DIFFUSION_MODEL one forward (`comfy.patcher_extension.WrappersMP`);
both are added under our key, so applying the node again replaces them. No ComfyUI import.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .patches import live_run
from .state import RUN_KEY, RunState
from .telemetry import tell

log = logging.getLogger(__name__)

WRAPPER_KEY = "kv_offload"
OUTER_SAMPLE, DIFFUSION_MODEL = "outer_sample", "diffusion_model"
SPEC_KEY = "kv_offload_spec"  # transformer_options key of the node's RunSpec (cached with the MODEL)


@dataclass
class RunSpec:
    """What the node decided, stored with the patched MODEL; turned into a `RunState` once per run.

    config: the validated `OffloadConfig`; host: `host(model_patcher) -> HostServices`, called once per run
    (patcher None when unknown); n_layers: attention layers of the diffusion model (a capture is complete when
    all were seen; sizes `expected_bytes`); family: the model family's `nodes.families.Family`.
    """

    config: Any
    host: Callable[[], Any]
    n_layers: int
    family: Any


def copy_nested_dicts(d: dict) -> dict:
    """ComfyUI's `create_model_options_clone`: dicts copied recursively, lists shallowly, values shared."""
    out = d.copy()
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = copy_nested_dicts(v)
        elif isinstance(v, list):
            out[k] = v.copy()
    return out


def remove_wrappers(m) -> None:
    """Remove the wrappers and the run spec an earlier KV Offload node added to `m`."""
    for kind in (OUTER_SAMPLE, DIFFUSION_MODEL):
        m.remove_wrappers_with_key(kind, WRAPPER_KEY)
    m.model_options.get("transformer_options", {}).pop(SPEC_KEY, None)


def add_cache_wrappers(m, spec: RunSpec, store_factory: Callable, telemetry) -> None:
    """Wrappers that give each sampling run of `m` a `RunState` made from `spec` (kept in `m`'s options)."""
    m.model_options.setdefault("transformer_options", {})[SPEC_KEY] = spec
    m.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _outer_wrapper(store_factory, telemetry))
    m.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper)


def add_readout_wrappers(m, telemetry) -> None:
    """Mode off: the readout still shows each run (its memory, no stores); nothing without a readout."""
    if telemetry is not None:
        m.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _readout_only(telemetry))
        m.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, _readout_step(telemetry))


def _transformer_options(args, kwargs) -> dict:
    to = kwargs.get("transformer_options")
    if isinstance(to, dict):
        return to
    for a in reversed(args):
        if isinstance(a, dict):
            return a
    return {}


def run_then(executor, args, kwargs, then: Callable[[bool], None]):
    """`executor(*args, **kwargs)`, then `then(ok)` in a `finally`: ok is False after an interrupt or an error."""
    ok = False
    try:
        out = executor(*args, **kwargs)
        ok = True
        return out
    finally:
        then(ok)


def diffusion_model_wrapper(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper: brackets one forward (per cond batch per step) for the run state."""
    run = live_run(_transformer_options(args, kwargs))
    if run is None:
        return executor(*args, **kwargs)
    run.step()
    return run_then(executor, args, kwargs, run.end_forward)  # a half-captured cond is dropped, never served


def _outer_wrapper(store_factory: Callable, telemetry):
    """OUTER_SAMPLE wrapper: one `RunState` per sampling run, closed in a `finally` (`_end_run`).

    The run goes into the run's copy of the options (ComfyUI's `create_model_options_clone`), never into the
    cached MODEL's own dict; the `finally` runs on normal completion, on `InterruptProcessingException` (a
    BaseException) and on any error.
    """

    def outer_sample_wrapper(executor, *args, **kwargs):
        guider = executor.class_obj
        orig = guider.model_options
        spec = orig.get("transformer_options", {}).get(SPEC_KEY)
        run = _new_run(spec, orig, getattr(guider, "model_patcher", None), store_factory, telemetry)
        if run is None:
            return executor(*args, **kwargs)
        guider.model_options = copy_nested_dicts(orig)
        to = guider.model_options.setdefault("transformer_options", {})
        to[RUN_KEY] = run
        spec.family.attach(run, to, spec.n_layers)
        tell(telemetry, "run_started", run.run_id)
        return run_then(executor, args, kwargs, lambda ok: _end_run(guider, orig, run, ok, telemetry))

    outer_sample_wrapper.kv_offload = True
    return outer_sample_wrapper


def _new_run(spec: Optional[RunSpec], model_options: dict, patcher, store_factory: Callable,
             telemetry) -> Optional[RunState]:
    """This run's state, or None: no spec, or the family stands down for the run."""
    config = spec.family.run_config(spec.config, model_options.get("transformer_options", {})) if spec else None
    if config is None:
        return None
    run = RunState(config, spec.host(patcher), spec.n_layers, store_factory, telemetry)
    run.devices = spec.family.devices  # whether it serves multi-GPU sampling's threads
    run.patcher = patcher  # prefix reuse keys by the weight-patch set this run samples with
    run.model_options = model_options  # ... and by the options that reach the forward
    return run


def _end_run(guider, orig: dict, run: RunState, ok: bool, telemetry) -> None:
    guider.model_options = orig
    try:
        run.close()
    except Exception:
        if ok:
            raise
        # an exception (an interrupt, a sampling error) is already on its way: it must reach ComfyUI
        log.warning("KV Offload: closing the cache after a failed run also failed", exc_info=True)
    finally:
        if run.pose_cache is not None:
            run.pose_cache.free()  # the stores are closed already: this logs the windows' summary
        tell(telemetry, "run_finished", run.run_id)


def _readout_only(telemetry):
    """OUTER_SAMPLE wrapper for mode `off`: brackets the run for the readout; no cache, no run state."""

    def outer_sample_wrapper(executor, *args, **kwargs):
        run_id = uuid.uuid4().hex[:12]
        tell(telemetry, "run_started", run_id)
        return run_then(executor, args, kwargs, lambda ok: tell(telemetry, "run_finished", run_id))

    outer_sample_wrapper.kv_offload = True
    return outer_sample_wrapper


def _readout_step(telemetry):
    """DIFFUSION_MODEL wrapper for mode `off`: a push before the forward and after it, as with a cache."""

    def diffusion_model_wrapper(executor, *args, **kwargs):
        tell(telemetry, "step")
        return run_then(executor, args, kwargs, lambda ok: tell(telemetry, "forward_done"))

    diffusion_model_wrapper.kv_offload = True
    return diffusion_model_wrapper
