"""What the reuse key costs at a real model's size on the CPU, beside the prefix pass a hit saves.

    .venv/bin/python scripts/reuse_key_cost.py [--double 1] [--single 1] [--tokens 1024] [--runs 3]

Builds FLUX.2 Klein 9B's transformer (hidden 4096, 32 heads, MLP ratio 3, text width 12288) with `--double`
double and `--single` single blocks of random bf16 weights, and measures on the CPU:

- the key's model part per request (`fingerprint.model_state`: every weight byte, the module tree, the code
  walk), the first request (a fresh walk) and the next ones (the kept walk checked), medians of `--runs`;
- the weight digest alone, in GiB/s;
- one forward of `--tokens` reference tokens (what a hit skips: their pass through every block).

Then extrapolates both to the whole model (8 double + 24 single blocks): the digest by bytes, the rest of the
key by modules, the pass by block parameters (its matmuls) times `4096 / --tokens` (a 1024x1024 reference).
Prints one JSON line.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KLEIN_9B = dict(in_channels=128, num_layers=8, num_single_layers=24, attention_head_dim=128,
                num_attention_heads=32, joint_attention_dim=12288, mlp_ratio=3.0, guidance_embeds=False,
                axes_dims_rope=(32, 32, 32, 32))
REFERENCE_TOKENS = 4096  # one 1024x1024 reference image


def _median(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _block_params(model) -> int:
    return sum(p.numel() for block in (*model.transformer_blocks, *model.single_transformer_blocks)
               for p in block.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--double", type=int, default=1)
    parser.add_argument("--single", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1024, help="reference tokens of the timed pass")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import torch
    from diffusers import Flux2Transformer2DModel

    from offload_core.reuse.contentdigest import content_digest
    from offload_core.reuse.fingerprint import model_state

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model = Flux2Transformer2DModel(**dict(KLEIN_9B, num_layers=args.double,
                                               num_single_layers=args.single)).to(torch.bfloat16).eval()
    tensors = [*model.parameters(), *model.buffers()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    began = time.perf_counter()
    model_state(model, cpu)
    first = time.perf_counter() - began
    key = _median(lambda: model_state(model, cpu), args.runs)
    digest = _median(lambda: content_digest(tensors), args.runs)

    n = args.tokens
    call = dict(hidden_states=torch.randn(1, n, 128, dtype=torch.bfloat16),
                encoder_hidden_states=torch.randn(1, 1, 12288, dtype=torch.bfloat16),
                timestep=torch.zeros(1, dtype=torch.bfloat16), img_ids=torch.zeros(n, 4, dtype=torch.int64),
                txt_ids=torch.zeros(1, 4, dtype=torch.int64), return_dict=False)
    call["img_ids"][:, 1] = torch.arange(n) // 32
    call["img_ids"][:, 2] = torch.arange(n) % 32
    with torch.no_grad():
        model(**call)  # warm-up
        prefix = _median(lambda: model(**call), max(1, args.runs - 1))

    double_p = sum(p.numel() for p in model.transformer_blocks[0].parameters())
    single_p = sum(p.numel() for p in model.single_transformer_blocks[0].parameters())
    full_block_p = KLEIN_9B["num_layers"] * double_p + KLEIN_9B["num_single_layers"] * single_p
    other_bytes = nbytes - 2 * _block_params(model)
    full_bytes = other_bytes + 2 * full_block_p
    blocks, full_blocks = args.double + args.single, KLEIN_9B["num_layers"] + KLEIN_9B["num_single_layers"]
    scale_pass = full_block_p / _block_params(model) * REFERENCE_TOKENS / n
    key_rest = max(key - digest, 0.0)
    out = {
        "cpu_threads": torch.get_num_threads(), "measured": {
            "blocks": [args.double, args.single], "weights_gib": nbytes / 2 ** 30, "key_first_s": first,
            "key_s": key, "digest_s": digest, "digest_gib_s": nbytes / 2 ** 30 / digest,
            "prefix_tokens": n, "prefix_pass_s": prefix},
        "whole_9b": {
            "weights_gib": full_bytes / 2 ** 30,
            "key_s": digest * full_bytes / nbytes + key_rest * full_blocks / blocks,
            "prefix_pass_s": prefix * scale_pass, "prefix_tokens": REFERENCE_TOKENS}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
