"""Write a tiny random Wan Animate 2 diffusion model as safetensors, for the integration suite.

    python make_tiny_wan_animate2.py COMFYUI_PATH OUT.safetensors [SEED]

Dim 256 (2 heads of 128, ComfyUI derives heads as dim // 128), 2 blocks, FFN 512, in 36 channels, out 16,
text dim 64. The keys are ComfyUI's own (its WanAnimate2Model builds them); `model_type` "animate2" and the
text dim ride in the file's `config` metadata, which ComfyUI's detection reads, so `UNETLoader` loads it.
"""

import json
import sys

import torch
from safetensors.torch import save_file

CONFIG = {"model_type": "animate2", "text_dim": 64}


def comfy_ops(comfy_path: str):
    """ComfyUI's `comfy.ops`, imported on the CPU (before model_management is: no device probing here)."""
    sys.path.insert(0, comfy_path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.ops

    return comfy.ops


def save_random(model, out: str, seed: int, config: dict) -> None:
    """`model`'s keys with small random weights, its `config` in the file's metadata, as ComfyUI's detection reads it."""
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.05).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, out, metadata={"config": json.dumps({"transformer": config})})


def main(comfy_path: str, out: str, seed: int = 0) -> None:
    ops = comfy_ops(comfy_path)
    from comfy.ldm.wan.model_animate2 import WanAnimate2Model

    model = WanAnimate2Model(dim=256, ffn_dim=512, num_heads=2, num_layers=2, in_dim=36, out_dim=16, text_dim=64,
                             operations=ops.disable_weight_init, device="meta")
    save_random(model, out, seed, CONFIG)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
