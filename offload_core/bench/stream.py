"""`python -m offload_core stream`: how close each tier streams to this machine's limits, and how much it hides.

In one run, on one cache (default 1 GiB in 64 MiB layers) and one directory:

1. raw limits: the best `O_DIRECT` write and read throughput over queue depths in that directory, a RAM
   memcpy, and pinned host<->device copies on CUDA (see `rawio`);
2. per tier: the extraction writes (every `put`, until the last layer is stored — on disk for the file tiers)
   and the get loop (every layer in order, nothing else), each against its raw limit;
3. per async tier: the same loop with a synthetic compute of `--compute-ratio` x the tier's own per-layer read
   time after each `get` — `torch.cuda._sleep` on the consumer stream on CUDA (the device is busy, the host is
   free, as with a real kernel), `time.sleep` on a CPU — and the exposed wait (loop time minus compute time)
   as a share of the transfer time: what prefetching failed to hide.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Dict, List

import torch

from .. import KVStore, OffloadConfig
from ..tiers import fileio, fileowner
from . import rawio, streamreport
from .rawio import GiB

TIERS = ["ram_sync", "ram_async", "file_sync", "file_async"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m offload_core stream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="consuming device (default: cuda if available, else cpu)")
    p.add_argument("--cache-mib", type=int, default=1024, help="size of the whole cache in MiB (default 1024)")
    p.add_argument("--layer-mib", type=int, default=64, help="size of one layer (K and V) in MiB (default 64)")
    p.add_argument("--dir", help="directory for the file tiers and the raw file test (default: the temp dir)")
    p.add_argument("--depths", default="1,2,4,8,16", help="queue depths of the raw file sweep (default 1,2,4,8,16)")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated tiers (default {','.join(TIERS)})")
    p.add_argument("--prefetch-depth", type=int, default=2, help="prefetch depth of the async tiers (default 2)")
    p.add_argument("--compute-ratio", type=float, default=1.5,
                   help="synthetic compute per layer, as a multiple of the tier's per-layer read time (default 1.5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of raw limits and tiers, interleaved; each figure is the median round (default 3)")
    p.add_argument("--json", metavar="FILE", help="also write every figure to this JSON file")
    return p


def _check(args, parser) -> None:
    if args.layer_mib < 1 or args.cache_mib < args.layer_mib:
        parser.error(f"--layer-mib must be >= 1 and <= --cache-mib; got {args.layer_mib} and {args.cache_mib}.")
    if not 1 <= args.rounds <= 20:
        parser.error(f"--rounds must be between 1 and 20; got {args.rounds}.")
    if not 0 <= args.compute_ratio <= 100:
        parser.error(f"--compute-ratio must be between 0 and 100; got {args.compute_ratio}.")
    unknown = set(args.tiers.split(",")) - set(TIERS)
    if unknown:
        parser.error(f"--tiers: unknown {sorted(unknown)}; pick from {', '.join(TIERS)}.")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir!r} is not an existing directory; create it first.")
    try:
        args.depths = sorted({int(d) for d in args.depths.split(",")})
    except ValueError:
        parser.error(f"--depths must be comma-separated integers, e.g. 1,2,4,8; got {args.depths!r}.")
    if not args.depths or args.depths[0] < 1:
        parser.error(f"--depths must all be >= 1; got {args.depths}.")


def _layer(nbytes: int, device: torch.device):
    half = nbytes // 2 // 4  # float32 elements in each of K and V
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(half, generator=gen).to(device)
    return k, -k


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Compute:
    """A synthetic per-layer compute of `seconds` that leaves the host free, as a device kernel does."""

    def __init__(self, device: torch.device, seconds: float):
        self.device, self.seconds, self.cycles = device, seconds, 0
        if device.type == "cuda" and seconds > 0:
            torch.cuda._sleep(1000)
            _sync(device)
            start = time.perf_counter()
            torch.cuda._sleep(10_000_000)
            _sync(device)
            self.cycles = int(10_000_000 * seconds / (time.perf_counter() - start))

    def __call__(self) -> None:
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        elif self.seconds > 0:
            time.sleep(self.seconds)


def _pass(store: KVStore, layers: int, device: torch.device, compute=None) -> float:
    start = time.perf_counter()
    for key in range(layers):
        store.get(key)
        if compute is not None:
            compute()
    _sync(device)
    return time.perf_counter() - start


def measure_tier(mode: str, args, device: torch.device, directory: str, k, v) -> Dict[str, object]:
    layers, layer_bytes = args.cache_mib // args.layer_mib, args.layer_mib << 20
    fields = {"prefetch_depth": args.prefetch_depth} if mode.endswith("async") else {}
    if mode.startswith("file"):
        fields["file_dir"] = directory
    store = KVStore(OffloadConfig(mode=mode, **fields), device)
    try:
        _sync(device)
        start = time.perf_counter()
        for key in range(layers):
            store.put(key, k, v)
        store.flush()  # the file tiers: until the last layer is on disk
        _sync(device)
        put_s = time.perf_counter() - start
        read_s = min(_pass(store, layers, device) for _ in range(2))
        row = {"tier": mode, "put_gib_s": layers * layer_bytes / GiB / put_s, "get_gib_s": layers * layer_bytes / GiB / read_s,
               "read_ms_per_layer": 1000 * read_s / layers, "page_cache": store.stats()["page_cache"]}
        if mode.endswith("async"):
            compute = _Compute(device, args.compute_ratio * read_s / layers)
            # Untimed: in a step loop the step before ends with compute too, which the prefetch of the first
            # layers (queued by the last gets) hides behind; right after the passes above it would have none.
            compute()
            _sync(device)
            wait0 = store.stats()["exposed_wait_s"]
            loop_s = _pass(store, layers, device, compute)
            exposed = max(0.0, loop_s - compute.seconds * layers)
            row.update(compute_ms_per_layer=1000 * compute.seconds, loop_s=loop_s, exposed_s=exposed,
                       store_exposed_wait_s=store.stats()["exposed_wait_s"] - wait0,
                       hidden=1.0 - exposed / read_s)
        got = store.get(layers - 1)[0]
        row["exact"] = bool(torch.equal(got, k))
        return row
    finally:
        store.close()


def _raw_pass(directory: str, total: int, sweep) -> Dict[str, float]:
    """One raw write and read pass at the depths this round's sweep found best."""
    wd, rd = (max(sweep[f"{kind}_gib_s"], key=sweep[f"{kind}_gib_s"].get) for kind in ("write", "read"))
    raw = rawio.file_limits(directory, total, fileio.CHUNK, sorted({wd, rd}))
    return {"write": raw["write_gib_s"][wd], "read": raw["read_gib_s"][rd]}


def _round(modes: List[str], args, device, directory: str, k, v, total: int, sweep) -> tuple:
    """One round of tiers, in the order given; every file tier is bracketed by raw passes at the sweep's best
    depths, one just before it and one just after (shared with the next file tier), so each gets a limit
    measured seconds around it (`paired_raw_*`: the mean of the two), and a drift of the disk during the round
    cancels instead of favouring whichever of raw and tier runs later. Returns (rows by tier, raw passes)."""
    rows, passes = {}, []
    for mode in modes:
        if not mode.startswith("file"):
            rows[mode] = measure_tier(mode, args, device, directory, k, v)
            continue
        if not passes:
            passes.append(_raw_pass(directory, total, sweep))
        row = measure_tier(mode, args, device, directory, k, v)
        passes.append(_raw_pass(directory, total, sweep))
        before, after = passes[-2:]
        row.update({f"paired_raw_{kind}_gib_s": (before[kind] + after[kind]) / 2 for kind in ("write", "read")})
        rows[mode] = row
    return rows, passes


def run(args) -> Dict[str, object]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layer_bytes = args.layer_mib << 20
    total = (args.cache_mib // args.layer_mib) * layer_bytes
    base = args.dir or tempfile.gettempdir()
    directory = tempfile.mkdtemp(prefix=".kv_offload-stream-", dir=base)
    k, v = _layer(layer_bytes, device)
    modes = args.tiers.split(",")
    rounds = []
    try:
        for index in range(args.rounds):  # raw and tiers alternate, so a load change on the machine hits both
            limits = {"file": rawio.file_limits(directory, total, fileio.CHUNK, args.depths),
                      "ram_gib_s": rawio.ram_limit(layer_bytes)}
            if device.type == "cuda":
                limits["cuda"] = rawio.cuda_limits(layer_bytes, device)
            # Every other round in reverse, so no tier always runs right after the same thing (the sweep, or
            # another tier's deleted files).
            order = modes if index % 2 == 0 else modes[::-1]
            rows, limits["file"]["passes"] = _round(order, args, device, directory, k, v, total, limits["file"])
            rounds.append((limits, [rows[mode] for mode in modes]))
    finally:
        fileowner.remove_tree(directory)
    limits, rows = streamreport.combine(rounds, device)
    fs = fileio.ram_backed(base)
    return {"device": str(device), "directory": base, "filesystem_in_ram": fs, "cache_bytes": total,
            "layer_bytes": layer_bytes, "io_depth": _io_depth(), "chunk_bytes": fileio.CHUNK,
            "prefetch_depth": args.prefetch_depth, "compute_ratio": args.compute_ratio, "rounds": args.rounds,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None, "torch": torch.__version__,
            "limits": limits, "rows": rows}


def _io_depth() -> int:
    from ..tiers.file import IO_DEPTH

    return IO_DEPTH


def main(argv: List[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    result = run(args)
    print(streamreport.table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["exact"] for r in result["rows"]) else 1
