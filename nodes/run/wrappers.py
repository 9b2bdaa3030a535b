"""The ComfyUI wrappers the node adds to its clone: one run state per sampling run, or only the readout's marks.

OUTER_SAMPLE wraps a whole sampling run, DIFFUSION_MODEL one forward (`comfy.patcher_extension.WrappersMP`);
both are added under our key, so applying the node again replaces them. No ComfyUI import.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .compiler import compiler_for_run
from ..keys import RUN_KEY, TRANSFORMER_OPTIONS, WRAPPER_KEY
from ..keys import MULTI_GPU_KEY
from .state import live_run
from ..readout.protocol import Readout, safe
from .reuse import ALWAYS, REUSE
from .state import RunState

log = logging.getLogger(__name__)

OUTER_SAMPLE, DIFFUSION_MODEL, APPLY_MODEL = "outer_sample", "diffusion_model", "apply_model"


@dataclass(frozen=True)
class RunSpec:
    """What the node decided, held by the patched MODEL's outer-sample wrapper; a `RunState` once per run.

    config: the validated `OffloadConfig`; host: `host(model_patcher) -> HostServices`, called once per run
    (patcher None when unknown); n_layers: attention layers of the diffusion model (a capture is complete when
    all were seen; sizes `expected_bytes`); family: the model family's `nodes.families.Family`; telemetry: the
    readout the runs report to; store_factory: None for `KVStore` (tests pass a stand-in); reuse: prefixes are
    kept across runs (Qwen-Image 2.1): True (reuse turns itself off where it does not pay), "always", or False.
    """

    config: Any
    host: Callable[[Any], Any]
    n_layers: int
    family: Any
    telemetry: Readout
    store_factory: Optional[Callable] = None
    reuse: Any = False

    def run_config(self, to: dict):
        """This run's config: the node's, as the family adjusts it to the run's options `to`; None: stand down."""
        return self.family.run_config(self.config, to)


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
    """Remove the wrappers (and so the run spec) an earlier KV Offload node added to `m`."""
    for kind in (OUTER_SAMPLE, DIFFUSION_MODEL, APPLY_MODEL):
        m.remove_wrappers_with_key(kind, WRAPPER_KEY)


def add_cache_wrappers(m, spec: RunSpec) -> None:
    """Wrappers that give each sampling run of `m` a `RunState` made from `spec` (held by the outer wrapper)."""
    m.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, outer_wrapper(spec))
    m.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, diffusion_model_wrapper)


def add_readout_wrappers(m, telemetry) -> None:
    """Mode off: the readout still shows each run (its memory, no stores); nothing without a readout."""
    if telemetry is not None:
        readout = safe(telemetry)
        m.add_wrapper_with_key(OUTER_SAMPLE, WRAPPER_KEY, _readout_only(readout))
        m.add_wrapper_with_key(DIFFUSION_MODEL, WRAPPER_KEY, _readout_step(readout))


def transformer_options_of(args, kwargs) -> dict:
    to = kwargs.get(TRANSFORMER_OPTIONS)
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
    to = transformer_options_of(args, kwargs)
    run = live_run(to)
    if run is not None and capturing():
        run.stand_down("the forward runs under CUDA graph capture, which replays recorded kernels and cannot "
                       "wait for a layer's copy; turn off the CUDA graphs (e.g. torch.compile's reduce-overhead "
                       "mode) to offload the cache")
        run = None
    if run is None:
        return executor(*args, **kwargs)
    run.bind_thread(to.get(MULTI_GPU_KEY), getattr(executor, "class_obj", None))  # ComfyUI's executor: the model
    run.step(_device(args))
    return run_then(executor, args, kwargs, run.end_forward)  # a half-captured cond is dropped, never served


def capturing() -> bool:
    """True inside a CUDA graph capture (torch's `is_current_stream_capturing` raises where CUDA is absent)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _device(args) -> Optional[torch.device]:
    """Where a forward computes: the device of its first tensor argument (the latent), None without one."""
    return next((a.device for a in args if isinstance(a, torch.Tensor)), None)


def outer_wrapper(spec: RunSpec):
    """OUTER_SAMPLE wrapper: one `RunState` of `spec` per sampling run, closed in a `finally` (`_end_run`).

    The run goes into the run's copy of the options (ComfyUI's `create_model_options_clone`), never into the
    cached MODEL's own dict; the `finally` runs on normal completion, on `InterruptProcessingException` (a
    BaseException) and on any error.
    """

    def outer_sample_wrapper(executor, *args, **kwargs):
        guider = executor.class_obj
        orig = guider.model_options
        run = new_run(spec, orig, getattr(guider, "model_patcher", None))
        if run is None:
            return executor(*args, **kwargs)
        guider.model_options = copy_nested_dicts(orig)
        to = guider.model_options.setdefault(TRANSFORMER_OPTIONS, {})
        to[RUN_KEY] = run
        spec.family.attach(run, to, spec.n_layers)
        run.telemetry.run_started(run.run_id)
        with compiler_for_run(run.telemetry.note):
            return run_then(executor, args, kwargs, lambda ok: _end_run(guider, orig, run, ok))

    outer_sample_wrapper.kv_offload = True
    outer_sample_wrapper.spec = spec  # what a reader (or a test) of the patched MODEL finds the node decided
    return outer_sample_wrapper


def new_run(spec: RunSpec, model_options: dict, patcher) -> Optional[RunState]:
    """This run's state, or None when the family stands down for the run.

    patcher and model_options: what prefix reuse keys by (the weight-patch set this run samples with, and the
    options that reach the forward)."""
    config = spec.run_config(model_options.get(TRANSFORMER_OPTIONS, {}))
    if config is None:
        return None
    run = RunState(config, spec.host(patcher), spec.n_layers, telemetry=spec.telemetry,
                   store_factory=spec.store_factory, devices=spec.family.devices, patcher=patcher,
                   model_options=model_options)
    if spec.reuse:
        REUSE.measure(run, always=spec.reuse == ALWAYS)
    return run


def _end_run(guider, orig: dict, run: RunState, ok: bool) -> None:
    guider.model_options = orig
    try:
        run.close()
    except Exception:
        if ok:
            raise
        # an exception (an interrupt, a sampling error) is already on its way: it must reach ComfyUI
        log.warning("KV Offload: closing the cache after a failed run also failed", exc_info=True)
    finally:
        run.close_extensions()  # the stores are closed already: e.g. the pose cache logs its windows' summary
        run.telemetry.run_finished(run.run_id)


def _readout_only(readout: Readout):
    """OUTER_SAMPLE wrapper for mode `off`: brackets the run for the readout; no cache, no run state."""

    def outer_sample_wrapper(executor, *args, **kwargs):
        run_id = uuid.uuid4().hex[:12]
        readout.run_started(run_id)
        return run_then(executor, args, kwargs, lambda ok: readout.run_finished(run_id))

    outer_sample_wrapper.kv_offload = True
    return outer_sample_wrapper


def _readout_step(readout: Readout):
    """DIFFUSION_MODEL wrapper for mode `off`: a push before the forward and after it, as with a cache."""

    def diffusion_model_wrapper(executor, *args, **kwargs):
        readout.step()
        return run_then(executor, args, kwargs, lambda ok: readout.forward_done())

    diffusion_model_wrapper.kv_offload = True
    return diffusion_model_wrapper
