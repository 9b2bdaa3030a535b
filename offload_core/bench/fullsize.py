"""`bench --size full`: the built-in pipelines at their real widths, random weights made on the device.

The transformers take the configs of the released checkpoints (Qwen-Image 2.1: `Qwen/Qwen-Image-2.1`;
FLUX.2 [klein] 9B KV: `black-forest-labs/FLUX.2-klein-9b-kv`), so the KV cache has its real size per layer and
the compute per layer its real length; the text encoder and VAE stay tiny (they never touch the cache) but
emit the widths the transformer expects. Parameters are created directly in the model dtype on the device:
nothing is downloaded, and a float32 copy never exists. Before anything is allocated, `shortfall` compares
what the run needs with the free memory of the device.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..places import GiB
from . import models

QWEN21 = dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
              num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56))
FLUX2_KLEIN_9B = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=24, attention_head_dim=128,
                      num_attention_heads=32, joint_attention_dim=12288, timestep_guidance_channels=256,
                      mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False)
CONFIGS = {"qwen21": QWEN21, "flux2": FLUX2_KLEIN_9B}
# Their transformers' parameter counts (diffusers 0.42, counted on the meta device; a test keeps them true), so
# that a refusal needs no diffusers import.
PARAMETERS = {"qwen21": 7_115_124_736, "flux2": 9_078_581_248}
NAMES = {"qwen21": "Qwen-Image 2.1", "flux2": "FLUX.2 [klein] 9B KV"}
HEADROOM = 6 << 30  # activations at 1024x1024 (a block's hidden states and MLP), the tiny VAE and text encoder
TEXT_TOKENS = 64


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def parameter_count(pipeline: str) -> int:
    """Parameters of the full-width transformer, counted on the meta device (nothing allocated)."""
    import diffusers

    cls = diffusers.Flux2Transformer2DModel if pipeline == "flux2" else diffusers.QwenImage21Transformer2DModel
    with torch.device("meta"):
        model = cls(**CONFIGS[pipeline])
    return sum(p.numel() for p in model.parameters())


def kv_bytes(pipeline: str, dtype: torch.dtype, images: int, resolution: int) -> int:
    """One branch's prefix K/V: 2 x layers x (reference tokens + text) x hidden x bytes (DESIGN section 6)."""
    config = CONFIGS[pipeline]
    layers = config["num_layers"] + config.get("num_single_layers", 0)
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    tokens = images * (resolution // 16) ** 2 + TEXT_TOKENS
    return 2 * layers * tokens * hidden * torch.empty((), dtype=dtype).element_size()


def need_bytes(pipeline: str, dtype: torch.dtype, images: int, resolution: int) -> int:
    weights = PARAMETERS[pipeline] * torch.empty((), dtype=dtype).element_size()
    return weights + kv_bytes(pipeline, dtype, images, resolution) + HEADROOM


def _free_bytes(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)  # CPU, and MPS: one pool with host RAM


def shortfall(pipeline: str, device: torch.device, dtype: torch.dtype, images: int, resolution: int) -> Optional[str]:
    """None when the run fits in `device`'s free memory, else one line saying what it needs."""
    need = need_bytes(pipeline, dtype, images, resolution)
    free = _free_bytes(device)
    if free is None or free >= need:
        return None
    name = str(dtype).replace("torch.", "")
    return (f"bench --size full: {NAMES[pipeline]} at full width needs about {need / GiB:.1f} GiB on {device} "
            f"({PARAMETERS[pipeline] / 1e9:.2f}B parameters in {name}, a "
            f"{kv_bytes(pipeline, dtype, images, resolution) / GiB:.2f} GiB KV cache, "
            f"{HEADROOM >> 30} GiB for activations); {free / GiB:.1f} GiB are free. Run it on a larger device, "
            "or use --size tiny.")


def pipeline(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(pipe, description): the full-width built-in pipeline, its parameters made in `dtype` on `device`."""
    build = models.flux2_klein_kv_pipeline if name == "flux2" else models.qwen21_pipeline
    with _default_dtype(dtype), torch.device(device):
        pipe = build(seed=seed, config=CONFIGS[name], dtype=torch.get_default_dtype(), device=device)
    count = sum(p.numel() for p in pipe.transformer.parameters())
    return pipe, f"built-in {type(pipe).__name__} at full width ({NAMES[name]}), random weights, {count / 1e9:.2f}B"
