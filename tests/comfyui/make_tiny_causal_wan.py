"""Write a tiny random Causal-WAN (autoregressive Wan 2.1) diffusion model as safetensors, for the integration suite.

    python make_tiny_causal_wan.py COMFYUI_PATH OUT.safetensors [SEED]

Dim 64 (2 heads of 32), 3 blocks, FFN 128, in and out 16 channels, text dim 64. The keys are ComfyUI's own (its
CausalWanModel builds them); `causal_ar` makes ComfyUI load it as `WAN21_CausalAR`, and `num_heads` and `text_dim`
ride in the same `config` metadata (detection derives heads as dim // 128 and does not read the text dim).
"""

import sys

from make_tiny_wan_animate2 import comfy_ops, save_random

CONFIG = {"causal_ar": True, "num_heads": 2, "text_dim": 64}


def main(comfy_path: str, out: str, seed: int = 0) -> None:
    ops = comfy_ops(comfy_path)
    from comfy.ldm.wan.ar_model import CausalWanModel

    model = CausalWanModel(dim=64, ffn_dim=128, num_heads=2, num_layers=3, in_dim=16, out_dim=16, text_dim=64,
                           operations=ops.disable_weight_init, device="meta")
    save_random(model, out, seed, CONFIG)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
