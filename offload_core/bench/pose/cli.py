"""`bench --pose`: its checks (before anything is allocated), its memory check, its table and JSON."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from typing import Optional

from ...cli import cliargs
from ...places import GiB, MiB

FRAMES = 81
MAX_WINDOWS = 16
WORKING = 6  # block-sized tensors beside the cache: the inputs, a block rebuilt, the joined take, norm, K, V
# What --pose does not take: option -> why (its value is refused when set, or when not the default)
NOT_FOR_POSE = {"model": "it builds its own pose cache", "modes": "it measures its own rows",
                "plot": "it writes no plot", "batch": "--batch is another family", "resolution": "it runs at 480x832",
                "images": "it has no condition images", "steps": "--runs sets the timed passes",
                "pipeline": "it runs Wan 14B's pose cache"}


def refuse_misplaced(args, parser: argparse.ArgumentParser) -> None:
    """Without --pose, --frames and --windows apply to nothing: one line, exit 2."""
    for name in ("frames", "windows"):
        if getattr(args, name) is not None:
            parser.error(f"--{name} applies to the pose cache benchmark only; add --pose, or drop --{name}.")


def check(args, parser: argparse.ArgumentParser) -> None:
    """Every option of `bench --pose`, before torch allocates anything; a bad one exits 2 with one line."""
    cliargs.output_file(parser, "--json", args.json)
    for name, why in NOT_FOR_POSE.items():
        value = getattr(args, name)
        if value not in (None, False, parser.get_default(name)):
            parser.error(f"--{name} does not apply to --pose ({why}); drop --{name}.")
    args.frames = FRAMES if args.frames is None else args.frames
    if not 1 <= args.frames <= 1001 or (args.frames - 1) % 4:
        parser.error(f"--frames must be 4k + 1 up to 1001 (1, 5, ..., 81: Wan's VAE keeps one latent frame in 4); "
                     f"got {args.frames}. Pick the nearest such length.")
    args.windows = 1 if args.windows is None else args.windows
    latent = (args.frames - 1) // 4 + 1
    if not 1 <= args.windows <= min(MAX_WINDOWS, latent):
        parser.error(f"--windows must be between 1 and {min(MAX_WINDOWS, latent)} (at most {MAX_WINDOWS}, and no "
                     f"more than the {latent} latent frames of {args.frames} frames); got {args.windows}.")
    cliargs.at_least(parser, "--runs", args.runs, 1, high=100)
    if args.threads is not None:
        cliargs.at_least(parser, "--threads", args.threads, 1, high=1024)
    args.device = cliargs.device(parser, args.device)  # imports torch
    import torch

    from .run import pose_sizes

    args.sizes = pose_sizes(args.size, args.frames, args.windows, getattr(torch, cliargs.DTYPES[args.dtype or "bf16"]))
    problem = shortfall(args.sizes, args.device, tempfile.gettempdir())
    if problem:
        parser.exit(2, problem + "\n")


def _free(device, folder: str) -> dict:
    import psutil
    import torch

    free = {"RAM": int(psutil.virtual_memory().available), "disk": shutil.disk_usage(folder).free}
    if device.type == "cuda":
        free["device"] = int(torch.cuda.mem_get_info(device)[0])
    return free


def shortfall(sizes, device, folder: str, free: Optional[dict] = None) -> Optional[str]:
    """None when each row fits (one row at a time: the cache in RAM, in files, and on the device for `gpu`,
    beside the block inputs and weights), else one line saying what is short and what to do."""
    cache = sizes.cache_bytes
    on_device = cache + WORKING * sizes.latent_frames * sizes.tokens_per_frame * sizes.dim * sizes.element_size
    need = {"RAM": cache if device.type == "cuda" else on_device, "disk": cache}
    if device.type == "cuda":
        need["device"] = on_device
    free = free or _free(device, folder)
    short = [f"{place} {need[place] / GiB:.2f} GiB ({free[place] / GiB:.2f} GiB free)"
             for place in need if free.get(place) is not None and free[place] < need[place]]
    if not short:
        return None
    return (f"bench --pose: a {cache / GiB:.2f} GiB pose cache ({sizes.frames} frames, width {sizes.dim}) needs "
            f"{', '.join(short)}; use fewer --frames, or --size tiny.")


def table(rows: list, compute_s: float, settings: str) -> str:
    head = ("row", "device MiB", "RAM MiB", "file MiB", "spill MiB", "fill s", "pass s", "exposed wait ms",
            "overhead s", "x ram_async", "exact")
    lines = [settings, f"compute alone (median over the rows): {compute_s:.3f} s per pass", " | ".join(head)]
    for r in rows:
        b = r["bytes"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(" | ".join((
            r["row"], f"{b['device'] / MiB:.1f}", f"{(b['host_pinned'] + b['host_pageable']) / MiB:.1f}",
            f"{b['file'] / MiB:.1f}", f"{r['spill_bytes'] / MiB:.1f}", f"{r['fill_s']:.3f}", f"{r['latency_s']:.3f}",
            f"{r['exposed_wait_s'] * 1e3:.1f}", f"{r['overhead_s']:.3f}", ratio, "yes" if r["exact"] else "NO")))
    return "\n".join(lines)


def settings_line(sizes, device, runs: int) -> str:
    dtype = str(sizes.dtype).replace("torch.", "")
    return (f"Wan Animate 2 pose cache, {sizes.frames} frames at 480x832 ({sizes.latent_frames} latent frames x "
            f"{sizes.tokens_per_frame} tokens), {sizes.blocks} blocks, width {sizes.dim}, {dtype}, {sizes.windows} "
            f"window(s), {sizes.cache_bytes / MiB:,.0f} MiB on {device}; median of {runs} passes after 1 warm-up")


def main(args, parser: argparse.ArgumentParser) -> int:
    """Checks, measures, prints the table (and writes `--json`). Exit 1 when a row's takes differ from the puts."""
    check(args, parser)
    import torch

    from . import run as pose

    threads = args.threads or (1 if args.device.type == "cpu" else None)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        rows, compute_s = pose.measure(args.sizes, args.device, args.runs)
    finally:
        torch.set_num_threads(previous)
    settings = settings_line(args.sizes, args.device, args.runs)
    print(table(rows, compute_s, settings))
    if args.json:
        s = args.sizes
        sizes = {"frames": s.frames, "latent_frames": s.latent_frames, "tokens_per_frame": s.tokens_per_frame,
                 "dim": s.dim, "blocks": s.blocks, "windows": s.windows, "dtype": str(s.dtype),
                 "cache_bytes": s.cache_bytes, "full_width_cache_bytes": pose.pose_sizes("full", s.frames).cache_bytes}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "device": str(args.device), "sizes": sizes, "compute_s": compute_s,
                       "pose_rows": rows}, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0 if all(r["exact"] for r in rows) else 1
