"""The measuring behind `python -m offload_core stream` (its options and checks: `streamcli`)."""

from __future__ import annotations

import os
import platform
import tempfile
import time
from typing import Dict, List

import torch

from ... import KVStore, OffloadConfig
from ...host.hostmem import HUGE_PAGES
from ...places import GiB
from ...tiers.file import fileio, fileowner
from . import rawio, report as streamreport


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


def measure_mode(mode: str, args, device: torch.device, directory: str, k, v) -> Dict[str, object]:
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
        store.flush()  # the file modes: until the last layer is on disk
        _sync(device)
        put_s = time.perf_counter() - start
        read_s = min(_pass(store, layers, device) for _ in range(2))
        row = {"mode": mode, "put_gib_s": layers * layer_bytes / GiB / put_s, "get_gib_s": layers * layer_bytes / GiB / read_s,
               "read_ms_per_layer": 1000 * read_s / layers, "page_cache": store.stats()["page_cache"],
               "file_io": store.stats()["file_io"]}  # the request size and depth the file tier chose, and why
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
    """One raw write and read pass, over the whole cache's size, in the patterns this round's sweep found best,
    and the read again verifying every request's checksum (what the file tiers' checks cost on this disk)."""
    wp, rp = (max(sweep[f"{kind}_gib_s"], key=sweep[f"{kind}_gib_s"].get) for kind in ("write", "read"))
    raw = rawio.file_limits(directory, total, [rawio.parse(label) for label in dict.fromkeys([wp, rp])], verified=[rp])
    return {"write": raw["write_gib_s"][wp], "read": raw["read_gib_s"][rp],
            "verified_read": raw["verified_read_gib_s"][rp]}


def _round(modes: List[str], args, device, directory: str, k, v, total: int, sweep) -> tuple:
    """One round of modes, in the order given; every file mode is bracketed by raw passes at the sweep's best
    depths, one just before it and one just after (shared with the next file mode), so each gets a limit
    measured seconds around it (`paired_raw_*`: the mean of the two), and a drift of the disk during the round
    cancels instead of favouring whichever of raw and mode runs later. Returns (rows by mode, raw passes)."""
    rows, passes = {}, []
    for mode in modes:
        if not mode.startswith("file"):
            rows[mode] = measure_mode(mode, args, device, directory, k, v)
            continue
        if not passes:
            passes.append(_raw_pass(directory, total, sweep))
        row = measure_mode(mode, args, device, directory, k, v)
        passes.append(_raw_pass(directory, total, sweep))
        before, after = passes[-2:]
        row.update({f"paired_raw_{kind}_gib_s": (before[kind] + after[kind]) / 2 for kind in before})
        rows[mode] = row
    return rows, passes


def run(args) -> Dict[str, object]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layer_bytes = args.layer_mib << 20
    total = (args.cache_mib // args.layer_mib) * layer_bytes
    base = args.dir or tempfile.gettempdir()
    k, v = _layer(layer_bytes, device)
    modes = args.modes.split(",")
    tried = rawio.patterns(args.requests, args.depths, ring_bytes=args.ring_mib << 20)
    sweep_bytes = max(min(total, args.sweep_mib << 20) // max(args.requests) * max(args.requests), max(args.requests))
    rounds, directory = [], None
    try:  # from the folder's birth on: an interrupt (Ctrl-C, SIGTERM) anywhere after it still deletes it
        directory = tempfile.mkdtemp(prefix=".kv_offload-stream-", dir=base)
        for index in range(args.rounds):  # raw and modes alternate, so a load change on the machine hits both
            limits = {"file": rawio.file_limits(directory, sweep_bytes, tried),
                      "ram_gib_s": rawio.ram_limit(layer_bytes)}
            if HUGE_PAGES:
                limits["file"]["small_pages"] = rawio.small_pages(directory, sweep_bytes, limits["file"])
            if device.type == "cuda":
                limits["cuda"] = rawio.cuda_limits(layer_bytes, device)
            # Every other round in reverse, so no mode always runs right after the same thing (the sweep, or
            # another mode's deleted files).
            order = modes if index % 2 == 0 else modes[::-1]
            rows, limits["file"]["passes"] = _round(order, args, device, directory, k, v, total, limits["file"])
            rounds.append((limits, [rows[mode] for mode in modes]))
    finally:
        if directory is not None:
            fileowner.remove_tree(directory)
    limits, rows = streamreport.combine(rounds, device)
    fs = fileio.ram_backed(base)
    return {"device": str(device), "directory": base, "filesystem_in_ram": fs, "cache_bytes": total,
            "layer_bytes": layer_bytes, "sweep_bytes": sweep_bytes, "ring_bytes": args.ring_mib << 20,
            "ring_pages": "huge" if HUGE_PAGES else "4k",
            "prefetch_depth": args.prefetch_depth, "compute_ratio": args.compute_ratio, "rounds": args.rounds,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None, "torch": torch.__version__,
            "limits": limits, "rows": rows}

