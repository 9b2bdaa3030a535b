"""`python -m offload_core arvideo`: the AR video cache (Causal-WAN) at real layer shapes, on the engine alone.

A video is made block by block as ComfyUI's AR sampler makes it: per block `--steps` denoising forwards and one
clean forward at sigma 0 that commits the block; every forward views each layer (its committed prefix), writes
the block's synthetic K/V after it (on the compute device), runs a stand-in compute of `--compute-ms` per layer
(a device kernel that leaves the host free, on CUDA; a sleep on the CPU) and the clean forward commits. Per
mode it prints the cache's peak bytes on the device (and its share of the all-on-device cache), the bytes moved
per forward, the bytes written to files, the exposed wait and the step time against `gpu` (the all-on-device
baseline). Every mode's cache is checked token for token against what was written once the video is done.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Dict, List

from ..places import GiB, MiB

MODELS = {"1.3b": (30, 12, 128), "14b": (40, 40, 128)}  # layers, heads, head dim (dim = heads x head dim)
MODES = ["gpu", "ram_sync", "ram_async", "file_sync", "file_async"]


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m offload_core arvideo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="1.3b", help="Wan 2.1 layer shapes (default 1.3b)")
    p.add_argument("--frames", type=int, default=81, help="video frames, 4k + 1 (default 81: 21 latent frames)")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--width", type=int, default=832)
    p.add_argument("--block", type=int, default=3, help="latent frames per block (default 3)")
    p.add_argument("--steps", type=int, default=4, help="denoising forwards per block before the clean one (default 4)")
    p.add_argument("--compute-ms", type=float, default=4.0, help="stand-in compute per layer and forward (default 4)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated (default {','.join(MODES)})")
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--file-dir", default=None, help="where the file modes keep their files (default: temp dir)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.frames < 1 or (args.frames - 1) % 4:
        p.error(f"--frames must be 4k + 1 (Wan's VAE keeps one latent frame in 4); got {args.frames}.")
    for name in ("block", "steps", "prefetch_depth"):
        if getattr(args, name) < (1 if name != "steps" else 0):
            p.error(f"--{name.replace('_', '-')} must be at least {1 if name != 'steps' else 0}; got {getattr(args, name)}.")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in (*MODES, "auto")]
    if bad:
        p.error(f"--modes: unknown {', '.join(bad)}; pick from {', '.join((*MODES, 'auto'))}.")
    return args


def measure(args, mode: str, device, compute) -> Dict[str, object]:
    import torch

    from .. import OffloadConfig
    from ..growing import GrowingKVStore, GrowingShape
    from .stream.run import _sync

    layers, heads, head_dim = MODELS[args.model]
    frame = -(-args.height // 16) * -(-args.width // 16)
    lat_t = (args.frames - 1) // 4 + 1
    shape = GrowingShape(1, lat_t * frame, heads, head_dim, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(1, args.block * frame, heads, head_dim, generator=g).to(torch.bfloat16).to(device)
    neg = src.neg()
    fields = {"mode": mode}
    if mode != "gpu":
        fields["prefetch_depth"] = args.prefetch_depth if mode in ("ram_async", "file_async", "auto") else None
    if mode.startswith("file") or mode == "auto":
        fields["file_dir"] = args.file_dir
    config = OffloadConfig(**{k: v for k, v in fields.items() if v is not None})
    forwards = 0
    with GrowingKVStore(config, device, shape=shape, layers=layers, name=mode) as store:
        for layer in range(layers):  # as upstream's init_kv_caches (zeros): every working buffer made and touched
            for t in store.view(layer):
                t.zero_()
        _sync(device)
        at, start_s = 0, time.perf_counter()
        while at < shape.capacity:
            n = min(args.block * frame, shape.capacity - at)
            for step in range(args.steps + 1):
                for layer in range(layers):
                    k, v = store.view(layer)
                    k[:, at:at + n] = src[:, :n]
                    v[:, at:at + n] = neg[:, :n]
                    compute()
                    if step == args.steps:
                        store.commit(layer, at, at + n)
                store.step()
                forwards += 1
            at += n
        _sync(device)
        loop_s = time.perf_counter() - start_s
        store.flush()
        stats = store.stats()
        exact = all(_check(store, layer, src, args.block * frame) for layer in range(layers))
    cache = shape.bytes(shape.capacity) * layers
    grow = stats["growing"]
    return {"mode": mode, "in_effect": stats["mode"], "model": args.model, "frames": args.frames, "tokens": shape.capacity,
            "cache_bytes": cache, "peak_device_bytes": stats["peak_device_bytes"],
            "peak_device_share": stats["peak_device_bytes"] / cache, "forwards": forwards,
            "moved_per_forward_bytes": stats["transfers"]["bytes"] / forwards, "peak_step_bytes": grow["peak_step_bytes"],
            "file_bytes": stats["bytes"]["file"], "files_hold_the_cache": stats["bytes"]["file"] == cache,
            "appended_bytes": grow["appended"]["bytes"],
            "exposed_wait_s": stats["exposed_wait_s"], "step_s": loop_s / forwards, "loop_s": loop_s, "exact": exact}


def _check(store, layer: int, src, block: int) -> bool:
    """The layer's whole prefix is what the consumer wrote, block after block (read back through the store)."""
    k, v = store.view(layer)
    n = store.committed(layer)
    for at in range(0, n, block):
        m = min(block, n - at)
        if not (k[:, at:at + m].equal(src[:, :m]) and v[:, at:at + m].equal(src[:, :m].neg())):
            return False
    return True


def table(rows: List[Dict[str, object]]) -> str:
    base = next((r["step_s"] for r in rows if r["mode"] == "gpu"), None)
    lines = ["| mode | peak on device | share of cache | moved / forward | written to files | exposed wait | "
             "step | vs gpu | exact |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = f"{r['step_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['mode']} ({r['in_effect']}) | {r['peak_device_bytes'] / GiB:.2f} GiB | "
                     f"{100 * r['peak_device_share']:.1f} % | {r['moved_per_forward_bytes'] / MiB:.0f} MiB | "
                     f"{r['file_bytes'] / GiB:.2f} GiB | {r['exposed_wait_s']:.2f} s | {1000 * r['step_s']:.0f} ms | "
                     f"{vs} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import torch

    from .stream.run import _Compute

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    compute = _Compute(device, args.compute_ms / 1000)
    layers, heads, head_dim = MODELS[args.model]
    frame = -(-args.height // 16) * -(-args.width // 16)
    tokens = ((args.frames - 1) // 4 + 1) * frame
    print(f"AR video cache: Wan 2.1 {args.model} ({layers} layers, dim {heads * head_dim}), {args.frames} frames at "
          f"{args.width}x{args.height} ({tokens} tokens, {2 * layers * tokens * heads * head_dim * 2 / GiB:.2f} GiB "
          f"bf16), blocks of {args.block} latent frames, {args.steps} + 1 forwards a block, {args.compute_ms} ms "
          f"stand-in compute a layer, on {device}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.file_dir = args.file_dir or tmp
        for mode in args.modes:
            rows.append(measure(args, mode, device, compute))
            print(f"  {mode}: {rows[-1]['loop_s']:.1f} s", flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["exact"] for r in rows) else 1
