"""`python -m offload_core bench`: the speed/memory table of the KV-cache modes on this machine, and the one to use."""

from __future__ import annotations

import argparse
import os
import sys

from ..cli import cliargs
from ..places import DEVICE, FILE, PAGEABLE, PINNED, GiB
from .pose import cli as posecli
from .folder import check_model_folder
from .rows import VERDICT_KEYS, select_rows

# What the benchmark imports besides the engine (diffusers builds the pipelines, PIL the condition images).
EXTRA = ("diffusers", "transformers", "PIL")
INSTALL = 'pip install "comfyui-kv-offload[bench]"'


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.Parser(prog="python -m offload_core bench", description=__doc__)
    p.add_argument("--model", metavar="PATH", help="local diffusers folder of Qwen-Image 2.1 or FLUX.2 Klein KV "
                   "(default: a built-in Qwen-Image 2.1 with random weights, nothing downloaded)")
    p.add_argument("--device", help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(cliargs.DTYPES), help="model dtype (default: bfloat16 on cuda, float32 else)")
    p.add_argument("--steps", type=int, default=8, help="denoising steps per request (default 8)")
    p.add_argument("--resolution", type=int,
                   help="output and condition-image side in pixels, a multiple of 32 (default 256; 1024 at full size)")
    p.add_argument("--runs", type=int, default=3, help="timed requests per row after one warm-up (default 3)")
    p.add_argument("--images", type=int, default=1, help="condition images per request (default 1)")
    p.add_argument("--modes", help="comma-separated rows: none, gpu_upstream, gpu, ram_sync, ram_async, "
                   "file_sync_warm, file_async_warm, file_sync_cold, file_async_cold, device_25, device_50, "
                   "device_75, host_50, gpu_fp8, gpu_int8, auto, rerun (a second request with a new seed, for "
                   "FLUX.2 a new prompt, served by prefix reuse); or the shorthands file_sync, file_async, warm, "
                   "cold, off, dial, lossy, reuse (ram_async + rerun); all: the 15 rows but auto and rerun (default: the "
                   f"rows the recommendation needs, {','.join(VERDICT_KEYS)})")
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
    p.add_argument("--pose", action="store_true", help="instead of the mode table: Wan Animate 2's pose cache "
                   "(Wan 14B's 40 blocks at 480x832, bf16; width 128, or 5120 with --size full) in gpu, RAM, files "
                   "and RAM under a budget that spills to files (see offload_core/bench/pose/run.py)")
    p.add_argument("--overhead", action="store_true", help="instead of the mode table: the engine's own time per get "
                   "outside its copy, in gpu, ram_sync and ram_async, tiny layers (see offload_core/bench/overhead.py)")
    p.add_argument("--frames", type=int, help="--pose: video frames, 4k + 1 (default 81)")
    p.add_argument("--windows", type=int, help="--pose: context windows, one store each (default 1)")
    p.add_argument("--json", metavar="FILE", help="also write every row and column to this JSON file")
    p.add_argument("--plot", metavar="FILE", help="where to save the PNG of latency against peak memory, headed by "
                   "the recommendation and its reasons (matplotlib; default: beside --json, else bench-out/bench.png)")
    p.add_argument("--no-plot", action="store_true", help="save no plot")
    return p


def _check(args, parser: argparse.ArgumentParser) -> None:
    """Every option, before anything is loaded or measured; a bad one exits 2 with one line. The checks that need
    no torch run first, so a usage error answers at once; `--device` and the model's size come after."""
    cliargs.output_file(parser, "--json", args.json)  # first: a run must never end with nowhere to write
    cliargs.output_file(parser, "--plot", args.plot)
    posecli.refuse_misplaced(args, parser)
    if args.plot and cliargs.missing("matplotlib"):
        parser.error(f"--plot needs matplotlib, which is not installed; {INSTALL} (or pip install matplotlib).")
    if args.size == "full" and args.model is not None:
        parser.error("--size full builds a built-in pipeline at its real width; drop --model (a local folder is "
                     "benchmarked at its own size).")
    if args.resolution is None:
        args.resolution = 1024 if args.size == "full" else 256
    for name, low, high in (("steps", 2, 1000), ("runs", 1, 100), ("images", 1, 16)):
        cliargs.at_least(parser, f"--{name}", getattr(args, name), low, high=high)
    if not 32 <= args.resolution <= 4096 or args.resolution % 32:
        parser.error(f"--resolution must be a multiple of 32 from 32 to 4096; got {args.resolution}.")
    try:
        args.rows = select_rows(args.modes)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.rows:
        parser.error(f"--modes {args.modes!r} names no rows; give comma-separated row names, e.g. gpu,ram_async.")
    if args.threads is not None:
        cliargs.at_least(parser, "--threads", args.threads, 1, high=1024)
    if args.model is not None:
        try:
            check_model_folder(args.model)
        except ValueError as exc:
            parser.error(str(exc))
    absent = cliargs.missing(*EXTRA)
    if absent:
        parser.exit(1, f"python -m offload_core bench needs the bench extra ({', '.join(absent)} missing): {INSTALL}\n")
    args.device = cliargs.device(parser, args.device)  # imports torch
    import torch

    args.torch_dtype = getattr(torch, cliargs.DTYPES[args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")])
    if args.size == "full":  # before anything is allocated
        from . import fullsize

        problem = fullsize.shortfall(args.pipeline, args.device, args.torch_dtype, args.images, args.resolution)
        if problem:
            parser.exit(2, problem + "\n")
def default_plot(args, parser) -> str | None:
    """The plot's path when none is given: beside the JSON (its name with .png), else bench-out/bench.png; its
    folder made and the file proven writable now, after every other option passed. None without matplotlib
    (said once: the table and the JSON are what matter)."""
    if cliargs.missing("matplotlib"):
        print("note: no plot (matplotlib is not installed; pip install matplotlib)", file=sys.stderr)
        return None
    path = os.path.splitext(args.json)[0] + ".png" if args.json else os.path.join("bench-out", "bench.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cliargs.output_file(parser, "--plot", path)
    return path


def _progress(total: int):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench", unit="request", file=sys.stderr, leave=False)


def _kv_held(kv: dict) -> int:
    """The K/V of one request as a row holds it, counted once. A row that streams keeps every layer in RAM or
    files, and its device bytes are the ring's slots (copies in transit) plus any resident layers; a row that
    does not stream keeps it all on the device. The larger of the two is exact for both, and less for a row that
    keeps layers resident (the maximum over the rows is then another row's)."""
    return max(kv[DEVICE], kv[PINNED] + kv[PAGEABLE] + kv[FILE])


def workload(args, rows: list[dict]) -> dict:
    """The request the recommendation is for: the benchmarked model itself when it has its real width; for the
    tiny built-in one, the real pipeline it stands for at 1024x1024 (its weights, then not loaded, counted), a
    projection (`projected`) from sizes that the rows did not run. `request` names it in the headline."""
    import torch

    from . import fullsize

    measured = max((_kv_held(r["kv_bytes"]) for r in rows), default=0)  # every row holds the same K/V
    if args.model is not None or args.size == "full":
        what = f"this model ({args.resolution}x{args.resolution}, {args.images} condition image(s))"
        return {"cache_bytes": measured, "other_device_bytes": fullsize.HEADROOM, "what": what,
                "request": f"this model's {args.resolution}x{args.resolution} request", "projected": False,
                "measured_cache_bytes": measured, "can_skip_cache": args.can_skip_cache}
    branches = 2 if args.pipeline == "qwen21" else 1  # Qwen-Image 2.1 runs true CFG; FLUX.2 [klein] is distilled
    cache = branches * fullsize.kv_bytes(args.pipeline, torch.bfloat16, args.images, 1024)
    weights = fullsize.PARAMETERS[args.pipeline] * 2
    what = (f"a real {fullsize.NAMES[args.pipeline]} request (1024x1024, {args.images} condition image(s), bf16"
            f"{', true CFG' if branches == 2 else ''}, beside its {weights / GiB:.0f} GiB of weights)")
    return {"cache_bytes": cache, "other_device_bytes": weights + fullsize.HEADROOM, "what": what,
            "request": f"a real 1024x1024 {fullsize.NAMES[args.pipeline]} request", "projected": True,
            "measured_cache_bytes": measured, "can_skip_cache": args.can_skip_cache}


def run(args) -> tuple[list[dict], dict, str]:
    """Measure every selected row; returns (rows, hardware, settings line). The hardware dict holds the
    machine's load before and after the rows, and the free memory after them."""
    import tempfile

    from . import hardware, loading, report
    from .measure import measure_rows
    from .verdict import add_spread

    load = {"before": hardware.load()}
    pipe, description = loading.pipeline(args)
    rows, skipped = args.rows, ""
    args.can_skip_cache = loading.supports_no_cache(pipe)
    if not args.can_skip_cache and any(r.key == "none" for r in rows):
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
    load["after"] = hardware.load()
    report.add_ratios(results)
    add_spread(results)
    dtype = str(args.torch_dtype).replace("torch.", "")
    settings = (f"{description}; {args.steps} steps, {args.resolution}x{args.resolution}, {args.images} condition "
                f"image(s), {dtype}; median of {args.runs} after 1 warm-up; full pipeline incl. text encoder and "
                f"VAE, excl. loading{skipped}")
    hw = hardware.describe(args.device)
    hw.update(load=load, free=hardware.free(args.device, tempfile.gettempdir()))
    return results, hw, settings


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.overhead and (args.pose or args.batch or args.modes or args.plot or args.model):
        parser.error("--overhead measures its own rows (gpu, ram_sync, ram_async on tiny layers); drop --pose, "
                     "--batch, --modes, --plot and --model.")
    if args.pose:
        from .pose import cli as posecli

        return posecli.main(args, parser)
    _check(args, parser)
    if args.batch and (args.modes or args.plot):
        parser.error("--batch measures its own rows (gpu, ram_async, file_async at batch 1 and 4); drop --modes "
                     "and --plot.")
    if args.plot and args.no_plot:
        parser.error("--plot and --no-plot contradict each other; drop one.")
    if not (args.batch or args.overhead or args.no_plot or args.plot):
        args.plot = default_plot(args, parser)
    import torch

    from . import hardware, report
    from .verdict import recommend, reliability

    threads = args.threads or (1 if args.device.type == "cpu" else None)
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if args.batch:
            from . import batch

            return batch.main(args)
        if args.overhead:
            from . import overhead

            return overhead.main(args)
        rows, hw, settings = run(args)
    finally:
        torch.set_num_threads(previous)
    verdict = recommend(rows, hw["free"], workload(args, rows))
    cautions = reliability(rows, hw["load"], threads or previous)
    print(report.table(rows, hardware.one_line(hw), settings, verdict, cautions))
    if args.json:
        report.write_json(args.json, rows, hw, {
            "text": settings, "steps": args.steps, "resolution": args.resolution, "runs": args.runs,
            "images": args.images, "model": args.model, "dtype": str(args.torch_dtype), "device": str(args.device),
            "threads": threads or previous}, verdict, cautions)
        print(f"JSON written to {args.json}")
    if args.plot:
        from .plot import write_plot

        error = write_plot(args.plot, rows, verdict["headline"], str(args.device), footer=settings,
                           recommended=verdict["evidence"], cautions=cautions, reasons=verdict["why"],
                           unified=hw["free"]["unified"])
        print(error or f"Plot written to {args.plot}", file=sys.stderr if error else sys.stdout)
    return 0
