"""The model families the node knows, each as what sets it apart: how to tell it, patch it, serve a run.

FLUX.2 Klein KV and Qwen-Image(-Edit) take the reference K/V at the attention (`nodes/families/flux.py`),
Qwen-Image 2.1 through the model's own prefix-cache seam (`nodes/families/qwen21.py`), Wan Animate 2 through its
pose cache (`nodes/families/wan.py`), autoregressive video (Causal-WAN) through its KV caches (`nodes/families/arvideo.py`). No ComfyUI import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .arvideo import attach as attach_ar, has_ar_cache, patch_ar
from .flux import patch_reference_kv, unless_flux_kv_cache_after
from .qwen21 import attach_qwen21, has_prefix_cache, patch_qwen21, qwen21_run_config
from .wan import attach_cache, take_over_pose_cache, has_pose_cache


def _nothing_to_attach(run, to: dict, n_layers: int) -> None:
    """The attention patches find the run under `RUN_KEY`, which every family gets."""


@dataclass(frozen=True)
class Family:
    """One model family.

    matches(dm): is the diffusion model one of this family. layers(dm): its layers with a cached prefix.
    patch(m, dm, config, to, reuse) -> (config, notes): patch the clone `m` (`to`: its transformer options) for
    `config`, and what to tell the user. run_config(config, to) -> the run's config, or None to stand down for
    the run (`to`: that run's options). attach(run, to, n_layers): put the run where the model will read it.
    devices: serves ComfyUI's multi-GPU sampling (one store per device and cond, each device's thread its own);
    a family without it stands down for such a run. off: what mode `off` does, in the node's message.
    """

    name: str
    matches: Callable[[Any], bool]
    layers: Callable[[Any], int]
    patch: Callable[..., "tuple[Any, list]"]
    run_config: Callable[[Any, dict], Any] = unless_flux_kv_cache_after
    attach: Callable[[Any, dict, int], None] = _nothing_to_attach
    devices: bool = False
    off: str = "the prefix is recomputed every step"  # what mode `off` does for the family


def _transformer_blocks(dm) -> int:
    return len(dm.transformer_blocks)


# Tried in this order: Qwen-Image 2.1 has `transformer_blocks` too, and only its seam tells it apart.
FAMILIES = (
    Family("ar_video", has_ar_cache, lambda dm: int(dm.num_layers), patch_ar, attach=attach_ar,
           off="ComfyUI's own AR video cache stays on the device (it cannot be recomputed)"),
    Family("qwen_image21", has_prefix_cache, _transformer_blocks, patch_qwen21, qwen21_run_config, attach_qwen21,
           devices=True),
    Family("wan_animate2", has_pose_cache, lambda dm: len(dm.blocks), take_over_pose_cache, attach=attach_cache,
           devices=True),
    Family("flux", lambda dm: hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks"),
           lambda dm: len(dm.double_blocks) + len(dm.single_blocks), patch_reference_kv, devices=True),
    Family("qwen_image", lambda dm: hasattr(dm, "transformer_blocks") and hasattr(dm, "default_ref_method"),
           _transformer_blocks, patch_reference_kv, devices=True),
)


def detect_family(dm) -> Optional[Family]:
    """The family of diffusion model `dm`, or None when the pack knows no reference K/V seam of it."""
    return next((f for f in FAMILIES if f.matches(dm)), None)
