"""`python -m offload_core bench`: the speed/memory table of every KV-cache mode on this machine."""

from __future__ import annotations

import argparse
import sys

import torch

from .. import cliargs
from . import hardware, report
from .rows import select_rows

# What the benchmark imports besides the engine (diffusers builds the pipelines, PIL the condition images).
EXTRA = ("diffusers", "transformers", "PIL")
INSTALL = 'pip install "comfyui-kv-offload[bench]"'

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(prog="python -m offload_core bench", description=__doc__)
    p.add_argument("--model", metavar="PATH", help="local diffusers folder of Qwen-Image 2.1 or FLUX.2 Klein KV "
                   "(default: a built-in Qwen-Image 2.1 with random weights, nothing downloaded)")
    p.add_argument("--device", help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="model dtype (default: bfloat16 on cuda, float32 else)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per request (default 8)")
    p.add_argument("--resolution", type=int,
                   help="output and condition-image side in pixels, a multiple of 32 (default 256; 1024 at full size)")
    p.add_argument("--runs", type=int, default=3, help="timed requests per row after one warm-up (default 3)")
    p.add_argument("--images", type=int, default=1, help="condition images per request (default 1)")
    p.add_argument("--modes", help="comma-separated rows: none, gpu_upstream, gpu, ram_sync, ram_async, "
                   "file_sync_warm, file_async_warm, file_sync_cold, file_async_cold, device_25, device_50, "
                   "device_75, host_50, gpu_fp8, gpu_int8, auto, rerun (a second request with a new seed, for "
                   "FLUX.2 a new prompt, served by prefix reuse); or the shorthands file_sync, file_async, warm, "
                   "cold, off, dial, lossy, reuse (ram_async + rerun) (default: all but auto, rerun)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: 1 on a CPU device, torch's default "
                   "otherwise; on a busy machine, OpenMP threads waiting for each other at every op can make a "
                   "multi-threaded CPU run 10-30x slower)")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny",
                   help="built-in model widths: tiny (default) or full, the real Qwen-Image 2.1 / FLUX.2 [klein] 9B "
                   "configs with random weights made on the device (refused up front when the memory is not there)")
    p.add_argument("--pipeline", choices=("qwen21", "flux2"), default="qwen21",
                   help="which built-in pipeline (default qwen21)")
    p.add_argument("--batch", action="store_true", help="instead of the mode table: a batch of 4 images from one "
                   "prompt against a batch of 1 in gpu, ram_async and file_async, with identical rows kept once and "
                   "not (bytes kept, moved per step, latency; see offload_core/bench/batch.py)")
    p.add_argument("--json", metavar="FILE", help="also write every row and column to this JSON file")
    p.add_argument("--plot", metavar="FILE", help="also save a PNG of latency against peak memory (matplotlib)")
    return p


def _check(args, parser: argparse.ArgumentParser) -> None:
    """Every option, before anything is imported, loaded or measured; a bad one exits 2 with one line."""
    cliargs.output_file(parser, "--json", args.json)  # first: a run must never end with nowhere to write
    cliargs.output_file(parser, "--plot", args.plot)
    if args.plot and cliargs.missing("matplotlib"):
        parser.error(f"--plot needs matplotlib, which is not installed; {INSTALL} (or pip install matplotlib).")
    if args.size == "full" and args.model is not None:
        parser.error("--size full builds a built-in pipeline at its real width; drop --model (a local folder is "
                     "benchmarked at its own size).")
    if args.resolution is None:
        args.resolution = 1024 if args.size == "full" else 256
    for name, low in (("steps", 2), ("runs", 1), ("images", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name} must be >= {low}; got {getattr(args, name)}.")
    if args.resolution < 32 or args.resolution % 32:
        parser.error(f"--resolution must be a multiple of 32 (>= 32); got {args.resolution}.")
    try:
        args.rows = select_rows(args.modes)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.rows:
        parser.error(f"--modes {args.modes!r} names no rows; give comma-separated row names, e.g. gpu,ram_async.")
    args.device = cliargs.device(parser, args.device)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1; got {args.threads}.")
    default_dtype = "bfloat16" if args.device.type == "cuda" else "float32"
    args.torch_dtype = _DTYPES[args.dtype or default_dtype]
    absent = cliargs.missing(*EXTRA)
    if absent:
        parser.exit(1, f"python -m offload_core bench needs the bench extra ({', '.join(absent)} missing): {INSTALL}\n")
    from . import fullsize, loading

    if args.size == "full":  # before anything is allocated
        problem = fullsize.shortfall(args.pipeline, args.device, args.torch_dtype, args.images, args.resolution)
        if problem:
            parser.exit(2, problem + "\n")
    if args.model is not None:
        try:
            loading.check_model_folder(args.model)
        except ValueError as exc:
            parser.error(str(exc))


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="request", file=sys.stderr, leave=False)


def run(args) -> tuple[list[dict], dict, str]:
    """Measure every selected row; returns (rows, hardware, settings line)."""
    from . import fullsize, loading, models
    from .measure import measure_rows

    if args.size == "full":
        pipe, description = fullsize.pipeline(args.pipeline, args.device, args.torch_dtype)
    elif args.pipeline == "flux2" and args.model is None:
        pipe = models.flux2_klein_kv_pipeline(loading.BENCH_SIZE, device=args.device, dtype=args.torch_dtype)
        description = f"built-in Flux2KleinKVPipeline, random weights ({loading.BENCH_SIZE.layers} double layers)"
    else:
        pipe, description = loading.load(args.model, args.device, args.torch_dtype)
    rows, skipped = args.rows, ""
    if not loading.supports_no_cache(pipe) and any(r.key == "none" for r in rows):
        rows = [r for r in rows if r.key != "none"]
        skipped = "; no 'no cache' row: FLUX.2 Klein KV has no uncached mode"
    call = loading.call_factory(pipe, builtin=args.model is None, steps=args.steps, resolution=args.resolution,
                                n_images=args.images)
    bar = _progress(len(rows) * (args.runs + 1))

    def started(row) -> None:
        if bar is not None:
            bar.set_description(row.label)

    try:
        results = measure_rows(pipe, rows, call, runs=args.runs, device=args.device, on_start=started,
                               on_done=lambda row: bar.update() if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    report.add_ratios(results)
    dtype = str(args.torch_dtype).replace("torch.", "")
    settings = (f"{description}; {args.steps} steps, {args.resolution}x{args.resolution}, {args.images} condition "
                f"image(s), {dtype}; median of {args.runs} after 1 warm-up; full pipeline incl. text encoder and "
                f"VAE, excl. loading{skipped}")
    return results, hardware.describe(args.device), settings


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    if args.batch and (args.modes or args.plot):
        parser.error("--batch measures its own rows (gpu, ram_async, file_async at batch 1 and 4); drop --modes "
                     "and --plot.")
    threads = args.threads or (1 if args.device.type == "cpu" else None)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if args.batch:
            from . import batch

            return batch.main(args)
        rows, hw, settings = run(args)
    finally:
        torch.set_num_threads(previous)
    print(report.table(rows, hardware.one_line(hw), settings))
    if args.json:
        report.write_json(args.json, rows, hw, {
            "text": settings, "steps": args.steps, "resolution": args.resolution, "runs": args.runs,
            "images": args.images, "model": args.model, "dtype": str(args.torch_dtype), "device": str(args.device),
            "threads": threads or previous})
        print(f"JSON written to {args.json}")
    if args.plot:
        error = report.write_plot(args.plot, rows, settings)
        print(error or f"Plot written to {args.plot}", file=sys.stderr if error else sys.stdout)
    return 0
