"""Write a tiny random FLUX.2 (Klein-shaped) diffusion model as safetensors, for the integration suite.

    python make_tiny_flux2.py COMFYUI_PATH OUT.safetensors [SEED]

Hidden 256, 2 heads of 128, 2 double + 2 single blocks, 128 latent channels, context 64; the keys are
ComfyUI's own (its Flux class builds them), so `UNETLoader` detects the file as FLUX.2.
"""

import sys

import torch
from safetensors.torch import save_file


def main(comfy_path: str, out: str, seed: int = 0) -> None:
    sys.path.insert(0, comfy_path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before model_management is imported: no device probing here
    import comfy.ops
    from comfy.ldm.flux.model import Flux

    model = Flux(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None, context_in_dim=64,
                 hidden_size=256, mlp_ratio=3.0, num_heads=2, depth=2, depth_single_blocks=2,
                 axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False, guidance_embed=False,
                 txt_ids_dims=[3], global_modulation=True, mlp_silu_act=True, ops_bias=False,
                 default_ref_method="index", ref_index_scale=10.0,
                 operations=comfy.ops.disable_weight_init, device="meta")
    g = torch.Generator().manual_seed(seed)
    sd = {k: (torch.randn(v.shape, generator=g) * 0.05).contiguous()
          for k, v in model.state_dict().items()}
    save_file(sd, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
