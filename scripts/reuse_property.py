"""The long property run of prefix reuse (issue: reuse that is never stale).

    .venv/bin/python scripts/reuse_property.py [--requests 500] [--seed 1]

Random requests on both built-in diffusers pipelines, each after a random change that may alter the prefix
(a weight edited through `.data`, hooks, diffusers' hook registry, processor and module state, the attention
backend, torch's matmul precision; with a scene of `tests/diffusers/valuechanges.py` in force, the values a
forward reads: defaults, partials, callable objects, bound methods, closure cells, globals, module attributes,
the environment) or a change of inputs, each output compared bit for bit with the same
request served without reuse; then the same on the in-process Qwen-Image 2.1 node model (storage, ComfyUI's
cache dtype, model options, weights). Prints the counts; exits 1 on any stale hit.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "diffusers"), str(ROOT / "tests" / "nodes")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500, help="requests per pipeline (default 500)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    import conftest  # noqa: F401  (loads the pack as `kv_offload_pack`, as the tests do)
    import torch
    from offload_core.bench import models
    from reuse_property import property_run
    from reuse_node_property import node_property_run

    torch.set_num_threads(1)
    images = models.condition_images(2)
    results = {}
    for scene in ("", "partials", "objects"):  # the plain pipeline, then each scene of value changes
        suffix = f" ({scene})" if scene else ""
        results["qwen_image_21" + suffix] = property_run(models.qwen21_pipeline(), images, args.requests, args.seed,
                                                         scene_name=scene)
        results["flux2_klein_kv" + suffix] = property_run(models.flux2_klein_kv_pipeline(), images, args.requests,
                                                          args.seed, scene_name=scene)
    results.update({
        "comfyui_node_qwen_image_21": node_property_run(args.requests, args.seed),
    })
    print(json.dumps(results, indent=1))
    return 1 if any(r["stale"] or r["wrong"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
