"""`python -m offload_core demo`: a round trip through every tier with synthetic K/V, checked, then timed.

Not the benchmark (that runs a real pipeline); a quick check that each tier works on this machine. Each row
says whether every layer came back bit-identical and whether the cache really lived in that tier; the command
exits 1 when any row fails either check.
"""

from __future__ import annotations

import sys
import time

import torch

from . import cliargs
from .config import Mode, OffloadConfig
from .store import KVStore

# Where each mode keeps the cache between gets: the `bytes` entries of `KVStore.stats()` that must hold it all.
PLACES = {Mode.GPU: ("device",), Mode.RAM_SYNC: ("host_pageable", "host_pinned"),
          Mode.RAM_ASYNC: ("host_pageable", "host_pinned"), Mode.FILE_SYNC: ("file",), Mode.FILE_ASYNC: ("file",)}


def build_parser() -> cliargs.Parser:
    p = cliargs.Parser(prog="python -m offload_core demo", description=__doc__)
    p.add_argument("--device", help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--layers", type=int, default=16, help="layers to put and get (default 16, at least 1)")
    p.add_argument("--mib", type=float, default=8.0, help="size of K (and of V) per layer, MiB (default 8)")
    return p


def _check(args, parser) -> None:
    if args.layers < 1:
        parser.error(f"--layers must be >= 1; got {args.layers}. A round trip of no layers checks nothing.")
    if not args.mib * 2**20 >= 2:  # one bfloat16 element (also refuses nan)
        parser.error(f"--mib must be at least one bfloat16 element (2 bytes); got {args.mib}.")
    args.device = cliargs.device(parser, args.device)


def round_trip(mode: Mode, layers, device: torch.device) -> dict:
    """Puts every layer, gets them all back once; the timings and what was checked."""
    with KVStore(OffloadConfig(mode=mode), device, name="demo") as store:
        start = time.perf_counter()
        for i, (k, v) in enumerate(layers):
            store.put(i, k, v)
        put_s = time.perf_counter() - start
        exact, start = True, time.perf_counter()
        for i, (k, v) in enumerate(layers):
            k2, v2 = store.get(i)
            exact &= bool(torch.equal(k2, k) and torch.equal(v2, v))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        get_s = time.perf_counter() - start
        stats = store.stats()
    total = sum(k.nbytes + v.nbytes for k, v in layers)
    tier = Mode(stats["tier"])
    held = sum(stats["bytes"][place] for place in PLACES[tier])
    return {"tier": tier.value, "reason": stats["reason"], "exact": exact and stats["gets"] == len(layers),
            "held": held >= total, "put_s": put_s, "get_s": get_s, "wait_ms": stats["exposed_wait_s"] * 1000}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    numel = max(1, int(args.mib * 2**20) // 2)
    layers = [(torch.randn(numel, device=args.device).to(torch.bfloat16),
               torch.randn(numel, device=args.device).to(torch.bfloat16)) for _ in range(args.layers)]
    print(f"{args.layers} layers of 2 x {numel * 2 / 2**20:.3f} MiB (bfloat16) on {args.device}")
    print(f"{'mode':<11} {'tier':<11} {'exact':<6} {'held':<5} {'put s':>7} {'get pass s':>11} {'exposed wait ms':>16}")
    failed = []
    for mode in PLACES:
        r = round_trip(mode, layers, args.device)
        print(f"{mode.value:<11} {r['tier']:<11} {'yes' if r['exact'] else 'NO':<6} {'yes' if r['held'] else 'NO':<5} "
              f"{r['put_s']:>7.3f} {r['get_s']:>11.3f} {r['wait_ms']:>16.1f}")
        if r["tier"] != mode.value:
            print(f"  ({mode.value} ran as {r['tier']}: {r['reason']})")
        if not (r["exact"] and r["held"]):
            failed.append(mode.value)
    if failed:
        print(f"FAILED: {', '.join(failed)}: a layer did not come back bit-identical, or the cache was not held in "
              "its tier (column 'held').", file=sys.stderr)
        return 1
    print("every tier returned every layer bit-identical")
    return 0
