"""Write a tiny random Causal-WAN (autoregressive Wan 2.1) diffusion model as safetensors, for the integration suite.

    python make_tiny_causal_wan.py COMFYUI_PATH OUT.safetensors [SEED]

Dim 64 (2 heads of 32), 3 blocks, FFN 128, in and out 16 channels, text dim 64. The keys are ComfyUI's own (its
CausalWanModel builds them); `causal_ar` makes ComfyUI load it as `WAN21_CausalAR`, and `num_heads` and `text_dim`
ride in the same `config` metadata (detection derives heads as dim // 128 and does not read the text dim).
"""

import json
import sys

import torch
from safetensors.torch import save_file

CONFIG = {"causal_ar": True, "num_heads": 2, "text_dim": 64}


def main(comfy_path: str, out: str, seed: int = 0) -> None:
    sys.path.insert(0, comfy_path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before model_management is imported: no device probing here
    import comfy.ops
    from comfy.ldm.wan.ar_model import CausalWanModel

    model = CausalWanModel(dim=64, ffn_dim=128, num_heads=2, num_layers=3, in_dim=16, out_dim=16, text_dim=64,
                           operations=comfy.ops.disable_weight_init, device="meta")
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.05).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, out, metadata={"config": json.dumps({"transformer": CONFIG})})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
