"""`python -m offload_core stream`: how close each mode streams to this machine's limits, and how much it hides.

In one run, on one cache (default 1 GiB in 64 MiB layers) and one directory:

1. raw limits: the best `O_DIRECT` write and read throughput in that directory over the patterns a careful
   reader would try (request size, requests in flight, `fallocate` or not, a pre-touched destination ring of at
   least 4 requests), a RAM memcpy, and pinned host<->device copies on CUDA (see `rawio`); the best pattern is
   measured again around every file mode, over the whole cache, and the modes' ratios are taken against it;
2. per mode: the capture's writes (every `put`, until the last layer is stored — on disk for the file modes)
   and the get loop (every layer in order, nothing else), each against its raw limit;
3. per async mode: the same loop with a synthetic compute of `--compute-ratio` x the mode's own per-layer read
   time after each `get` — `torch.cuda._sleep` on the consumer stream on CUDA (the device is busy, the host is
   free, as with a real kernel), `time.sleep` on a CPU — and the exposed wait (loop time minus compute time)
   as a share of the transfer time: what prefetching failed to hide.
"""

# Parsing and every check that needs no device run before torch is imported, so `--help` and a bad option
# answer at once; `--device` is checked next, and only then is anything allocated or written (in `stream`).

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import List

from ...cli import cliargs

MODES = ["ram_sync", "ram_async", "file_sync", "file_async"]
MAX_RING_MIB = 256  # the raw patterns' largest ring (rawio.RING_CAP; a test keeps them equal)
MAX_PREFETCH_DEPTH = 8  # the engine's limit (offload_core.config.MAX_PREFETCH_DEPTH; a test keeps them equal)


def build_parser() -> cliargs.Parser:
    p = cliargs.Parser(prog="python -m offload_core stream", description=__doc__,
                       formatter_class=cliargs.argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="consuming device (default: cuda if available, else cpu)")
    p.add_argument("--cache-mib", type=int, default=1024, help="size of the whole cache in MiB (default 1024)")
    p.add_argument("--layer-mib", type=int, default=64, help="size of one layer (K and V) in MiB (default 64)")
    p.add_argument("--dir", help="directory for the file modes and the raw file test (default: the temp dir)")
    p.add_argument("--depths", default="1,2,4,8,16",
                   help="requests in flight the raw file sweep tries (default 1,2,4,8,16)")
    p.add_argument("--requests", default="4,8,16,32", help="request sizes in MiB the raw sweep tries (default 4,8,16,32)")
    p.add_argument("--ring-mib", type=int, default=0,
                   help="size of the raw patterns' destination ring, MiB (default: max(4, in flight) requests)")
    p.add_argument("--sweep-mib", type=int, default=256,
                   help="file size of each raw sweep pattern, MiB (default 256; at most the cache's size)")
    modes = p.add_mutually_exclusive_group()  # --tiers is --modes by its old name: not both
    modes.add_argument("--modes", default=",".join(MODES), help=f"comma-separated modes (default {','.join(MODES)})")
    cliargs.deprecated_alias(modes, "--tiers", "--modes")
    p.add_argument("--prefetch-depth", type=int, default=2,
                   help=f"prefetch depth of the async modes, 1 to {MAX_PREFETCH_DEPTH} (default 2)")
    p.add_argument("--compute-ratio", type=float, default=1.5,
                   help="synthetic compute per layer, as a multiple of the mode's per-layer read time (default 1.5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of raw limits and modes, interleaved; each figure is the median round (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write every figure to this JSON file")
    return p


def check(args, parser) -> None:
    """Every option, before anything is allocated or written; a bad one exits 2 with one line."""
    cliargs.output_file(parser, "--json", args.json)  # first: a run must never end with nowhere to write
    cliargs.at_least(parser, "--cache-mib", args.cache_mib, 1)
    if args.layer_mib < 1 or args.cache_mib < args.layer_mib:
        parser.error(f"--layer-mib must be >= 1 and <= --cache-mib; got {args.layer_mib} and {args.cache_mib}.")
    if not 1 <= args.sweep_mib <= 1 << 16:
        parser.error(f"--sweep-mib must be between 1 and 65536; got {args.sweep_mib}.")
    if not 1 <= args.rounds <= 20:
        parser.error(f"--rounds must be between 1 and 20; got {args.rounds}.")
    if not 0 <= args.compute_ratio <= 100:
        parser.error(f"--compute-ratio must be between 0 and 100; got {args.compute_ratio}.")
    if not 1 <= args.prefetch_depth <= MAX_PREFETCH_DEPTH:
        parser.error(f"--prefetch-depth must be between 1 and {MAX_PREFETCH_DEPTH}; got {args.prefetch_depth}. "
                     "1 hides a transfer behind one layer of compute; deeper holds more of the cache on the device.")
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; pick from {', '.join(MODES)}.")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir!r} is not an existing directory; create it first.")
    cliargs.output_folder(parser, "--dir", args.dir or tempfile.gettempdir())
    cache, sweep = args.cache_mib << 20, min(args.sweep_mib, args.cache_mib) << 20  # the sweep stops at the cache's size
    # The RAM modes hold the cache and its source layers at once; the file modes and the raw sweep write theirs.
    cliargs.room(parser, f"--cache-mib {args.cache_mib}", cache, ram=2 * cache, disk_in=args.dir or tempfile.gettempdir(),
                 disk=cache + sweep)
    args.depths = _integers(parser, "--depths", args.depths, 1, 64, "1,2,4,8")
    args.requests = [mib << 20 for mib in _integers(parser, "--requests", args.requests, 1, 256, "4,8,16")]
    if not 0 <= args.ring_mib <= MAX_RING_MIB:
        parser.error(f"--ring-mib must be between 1 and {MAX_RING_MIB} (0: max(4, in flight) requests); "
                     f"got {args.ring_mib}.")
    if max(args.requests) > args.cache_mib << 20:
        parser.error(f"--requests: {max(args.requests) >> 20} MiB is larger than the cache ({args.cache_mib} MiB); "
                     "pick smaller requests or a larger --cache-mib.")
    args.device = cliargs.device(parser, args.device)


def _integers(parser, option: str, text: str, low: int, high: int, example: str) -> List[int]:
    try:
        values = sorted({int(x) for x in text.split(",")})
    except ValueError:
        parser.error(f"{option} must be comma-separated integers, e.g. {example}; got {text!r}.")
    if not values or values[0] < low or values[-1] > high:
        parser.error(f"{option} must all be between {low} and {high}; got {values}.")
    return values


def main(argv: List[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(args, parser)
    from . import run as stream, report as streamreport

    result = stream.run(args)
    print(streamreport.table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["exact"] for r in result["rows"]) else 1
