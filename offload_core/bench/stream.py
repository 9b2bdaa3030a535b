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
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

from .. import KVStore, OffloadConfig
from ..tiers import fileio, fileowner
from . import rawio

GiB = float(1 << 30)
TIERS = ["ram_sync", "ram_async", "file_sync", "file_async"]
NOISY = 1.2  # raw passes further apart than this (highest / lowest): the table says the run cannot settle 10 %


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
    limits, rows = _combine(rounds)
    for row in rows:
        if row["tier"].startswith("file"):
            row["put_vs_raw"] = row["put_gib_s"] / limits["file"]["limit_write_gib_s"]
            row["get_vs_raw"] = row["get_gib_s"] / limits["file"]["limit_read_gib_s"]
            # The most conservative reading: the tier's best round against the best raw sample anywhere.
            row["best_put_vs_max_raw"] = row["best_put_gib_s"] / limits["file"]["max_write_gib_s"]
            row["best_get_vs_max_raw"] = row["best_get_gib_s"] / limits["file"]["max_read_gib_s"]
        else:
            raw = limits["cuda"]["h2d_gib_s"] if device.type == "cuda" else limits["ram_gib_s"]
            row["get_vs_raw"] = row["get_gib_s"] / raw
    fs = fileio.ram_backed(base)
    return {"device": str(device), "directory": base, "filesystem_in_ram": fs, "cache_bytes": total,
            "layer_bytes": layer_bytes, "io_depth": _io_depth(), "chunk_bytes": fileio.CHUNK,
            "prefetch_depth": args.prefetch_depth, "compute_ratio": args.compute_ratio, "rounds": args.rounds,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None, "torch": torch.__version__,
            "limits": limits, "rows": rows}


def _median_round(runs: List[dict], key: str) -> dict:
    """The round whose `key` is the median (the lower one of an even count)."""
    return sorted(runs, key=lambda x: x[key])[(len(runs) - 1) // 2]


def _combine(rounds):
    """Every figure as its median over the interleaved rounds, raw limits and tiers alike.

    The raw file limit (`limit_*_gib_s`) is the best queue depth measured again: the median of the raw passes
    that bracket the file tiers, each at the depth its round's sweep found best. Not the sweep's best median
    itself: picking the largest of several near-equal noisy medians and reading off that same sample
    overstates the disk (the winner's curse) by about its spread; a depth that is really better still wins
    the sweep, and its fresh passes still show it. Medians, since a best-of figure grows with the number of
    samples it is the best of. The sweep's figures and the best-of ones are kept too, and every round's."""
    files = [r[0]["file"] for r in rounds]
    limits = dict(rounds[0][0])
    best_file = dict(files[0])
    for kind in ("write", "read"):
        per_depth = {d: statistics.median([f[f"{kind}_gib_s"][d] for f in files]) for d in files[0][f"{kind}_gib_s"]}
        best_file[f"{kind}_gib_s"] = per_depth
        best_file[f"best_{kind}_depth"] = max(per_depth, key=per_depth.get)
        best_file[f"best_{kind}_gib_s"] = max(per_depth.values())
        best_file[f"max_{kind}_gib_s"] = max(max(f[f"{kind}_gib_s"].values()) for f in files)  # any depth, any round
    passes = [p for f in files for p in f.get("passes", [])]
    for kind in ("write", "read"):
        again = [p[kind] for p in passes]
        best_file[f"limit_{kind}_gib_s"] = statistics.median(again) if again else best_file[f"best_{kind}_gib_s"]
        best_file[f"limit_{kind}_range"] = [min(again), max(again)] if again else None  # how much the disk moved
    best_file["limit_passes"] = len(passes)
    limits["file"] = best_file
    limits["ram_gib_s"] = statistics.median([r[0]["ram_gib_s"] for r in rounds])
    if "cuda" in limits:
        limits["cuda"] = {key: statistics.median([r[0]["cuda"][key] for r in rounds]) for key in limits["cuda"]}
    limits["rounds"] = [r[0] for r in rounds]
    rows = []
    for index in range(len(rounds[0][1])):
        runs = [r[1][index] for r in rounds]
        row = dict(_median_round(runs, "get_gib_s"))
        row["put_gib_s"] = statistics.median([x["put_gib_s"] for x in runs])
        row["get_gib_s"] = statistics.median([x["get_gib_s"] for x in runs])
        row["best_put_gib_s"] = max(x["put_gib_s"] for x in runs)
        row["best_get_gib_s"] = max(x["get_gib_s"] for x in runs)
        if "exposed_s" in row:
            median = _median_round(runs, "hidden")
            for key in ("compute_ms_per_layer", "loop_s", "exposed_s", "store_exposed_wait_s", "hidden"):
                row[key] = median[key]
        if "paired_raw_write_gib_s" in row:  # the median of the per-round ratios, each against its adjacent raw pass
            for what, kind in (("put", "write"), ("get", "read")):
                ratios = [x[f"{what}_gib_s"] / x[f"paired_raw_{kind}_gib_s"] for x in runs]
                row[f"{what}_vs_paired"] = statistics.median(ratios)
                row[f"{what}_vs_paired_range"] = [min(ratios), max(ratios)]
        row["exact"] = all(x["exact"] for x in runs)
        row["rounds"] = runs
        rows.append(row)
    return limits, rows


def _io_depth() -> int:
    from ..tiers.file import IO_DEPTH

    return IO_DEPTH


def _span(pair, spec=".2f") -> str:
    return "" if not pair else f" ({format(pair[0], spec)}-{format(pair[1], spec)})"


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(result: Dict[str, object]) -> str:
    f = result["limits"]["file"]
    raw = " ".join(f"qd{d}={w:.2f}/{r:.2f}" for (d, w), r in zip(f["write_gib_s"].items(), f["read_gib_s"].values()))
    lines = [
        f"device {result['device']}, cache {result['cache_bytes'] / GiB:.2f} GiB in {result['layer_bytes'] >> 20} MiB "
        f"layers, directory {result['directory']}" + (f" (on {result['filesystem_in_ram']}: in RAM)"
                                                      if result["filesystem_in_ram"] else ""),
        f"raw files ({'O_DIRECT' if f['o_direct'] else 'buffered, pages dropped'}, {f['chunk_bytes'] >> 20} MiB "
        f"requests) write/read GiB/s: {raw}; best write {f['best_write_gib_s']:.2f} (qd{f['best_write_depth']}), "
        f"best read {f['best_read_gib_s']:.2f} (qd{f['best_read_depth']})",
        f"raw file limit: write {f['limit_write_gib_s']:.2f}{_span(f['limit_write_range'])}, read "
        f"{f['limit_read_gib_s']:.2f}{_span(f['limit_read_range'])} GiB/s (the best depth measured again: median of "
        f"the {f['limit_passes']} raw passes around the file tiers; lowest-highest pass in brackets)",
        f"raw RAM memcpy {result['limits']['ram_gib_s']:.2f} GiB/s" + (
            "; pinned H2D {h2d_gib_s:.2f} / D2H {d2h_gib_s:.2f} GiB/s".format(**result["limits"]["cuda"])
            if "cuda" in result["limits"] else ""),
        f"file tiers: {result['io_depth']} requests in flight per store; async tiers: prefetch depth "
        f"{result['prefetch_depth']}, compute {result['compute_ratio']}x the per-layer read time; every figure "
        f"is the median of {result['rounds']} interleaved rounds",
        "",
        "| tier       | put GiB/s | put / raw write | get GiB/s | get / raw read | read ms/layer | compute ms/layer "
        "| exposed ms | hidden | exact |",
        "|------------|-----------|-----------------|-----------|----------------|---------------|------------------"
        "|------------|--------|-------|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['tier']:<10} | {r['put_gib_s']:9.2f} | {_fmt(r.get('put_vs_raw'), '15.0%')} | {r['get_gib_s']:9.2f} "
            f"| {_fmt(r.get('get_vs_raw'), '14.0%')} | {r['read_ms_per_layer']:13.1f} "
            f"| {_fmt(r.get('compute_ms_per_layer'), '16.1f')} | "
            f"{_fmt(None if 'exposed_s' not in r else 1000 * r['exposed_s'], '10.1f')} "
            f"| {_fmt(r.get('hidden'), '6.0%')} | {str(r['exact']):<5} |")
    strict = [r for r in result["rows"] if "best_put_vs_max_raw" in r]
    if strict:
        lines += ["", "paired (each tier against the mean of the raw passes just before and after it, in every round; "
                      "median of the per-round ratios, lowest-highest round in brackets): " + "; ".join(
                          f"{r['tier']} put {r['put_vs_paired']:.0%}{_span(r['put_vs_paired_range'], '.0%')}, "
                          f"get {r['get_vs_paired']:.0%}{_span(r['get_vs_paired_range'], '.0%')}" for r in strict)]
        moved = [kind for kind in ("write", "read") if f[f"limit_{kind}_range"]
                 and f[f"limit_{kind}_range"][1] > NOISY * f[f"limit_{kind}_range"][0]]
        if moved:
            lines += ["", f"note: the disk's raw {' and '.join(moved)} throughput moved by more than "
                          f"{NOISY - 1:.0%} from pass to pass in this run (brackets above): a ratio nearer a target "
                          "than that is not settled by one run of this length; more --rounds narrow the medians."]
        lines += ["", f"best round against the best raw sample of any depth and round (raw write {f['max_write_gib_s']:.2f}, "
                      f"read {f['max_read_gib_s']:.2f} GiB/s): " + "; ".join(
                          f"{r['tier']} put {r['best_put_vs_max_raw']:.0%}, get {r['best_get_vs_max_raw']:.0%}" for r in strict)]
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    result = run(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(r["exact"] for r in result["rows"]) else 1
