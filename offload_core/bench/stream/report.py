"""`python -m offload_core stream`'s figures from its rounds (`combine`) and its table (`table`).

Every figure is a median over the interleaved rounds; the ratios divide by limits measured in the same run.
"""

from __future__ import annotations

import statistics
from typing import Dict, List

import torch

from ...places import GiB
from . import rawio

NOISY = 1.2  # raw passes further apart than this (highest / lowest): the table says the run cannot settle 10 %


def _median_round(runs: List[dict], key: str) -> dict:
    """The round whose `key` is the median (the lower one of an even count)."""
    return sorted(runs, key=lambda x: x[key])[(len(runs) - 1) // 2]


def combine(rounds, device: torch.device):
    """Every figure as its median over the interleaved rounds, raw limits and modes alike.

    Each row also gets its ratios: a file mode's against the raw file limit, a RAM mode's against the memcpy
    (CPU) or pinned H2D (CUDA) figure. The raw file limit (`limit_*_gib_s`) is the best pattern measured
    again: the median of the raw passes that bracket the file modes, each in the pattern its round's sweep
    found best. Not the sweep's best median itself: picking the largest of several near-equal noisy medians and
    reading off that same sample overstates the disk (the winner's curse) by about its spread; a pattern that is
    really better still wins the sweep, and its fresh passes still show it. Medians, since a best-of figure
    grows with the number of samples it is the best of. The sweep's figures and the best-of ones are kept
    too, and every round's."""
    files = [r[0]["file"] for r in rounds]
    limits = dict(rounds[0][0])
    best_file = dict(files[0])
    for kind in ("write", "read"):
        per = {p: statistics.median([f[f"{kind}_gib_s"][p] for f in files]) for p in files[0][f"{kind}_gib_s"]}
        best_file[f"{kind}_gib_s"] = per
        best_file[f"best_{kind}_pattern"] = max(per, key=per.get)
        best_file[f"best_{kind}_gib_s"] = max(per.values())
        best_file[f"max_{kind}_gib_s"] = max(max(f[f"{kind}_gib_s"].values()) for f in files)  # any pattern, round
    passes = [p for f in files for p in f.get("passes", [])]
    for kind in ("write", "read"):
        again = [p[kind] for p in passes]
        best_file[f"limit_{kind}_gib_s"] = statistics.median(again) if again else best_file[f"best_{kind}_gib_s"]
        best_file[f"limit_{kind}_range"] = [min(again), max(again)] if again else None  # how much the disk moved
    best_file["limit_passes"] = len(passes)
    verified = [p["verified_read"] for p in passes if "verified_read" in p]
    if verified:  # the same read, checking every request as the file tiers do
        best_file["limit_verified_read_gib_s"] = statistics.median(verified)
        best_file["limit_verified_read_range"] = [min(verified), max(verified)]
    if "small_pages" in files[0]:  # the median of the per-round ratios
        best_file["small_pages"] = {kind: statistics.median([f["small_pages"][kind] for f in files])
                                    for kind in ("write", "read")}
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
        if "paired_raw_verified_read_gib_s" in row:
            ratios = [x["get_gib_s"] / x["paired_raw_verified_read_gib_s"] for x in runs]
            row["get_vs_paired_verified"] = statistics.median(ratios)
            row["get_vs_paired_verified_range"] = [min(ratios), max(ratios)]
        row["exact"] = all(x["exact"] for x in runs)
        row["rounds"] = runs
        rows.append(row)
    for row in rows:
        if row["mode"].startswith("file"):
            row["put_vs_raw"] = row["put_gib_s"] / limits["file"]["limit_write_gib_s"]
            row["get_vs_raw"] = row["get_gib_s"] / limits["file"]["limit_read_gib_s"]
            if "limit_verified_read_gib_s" in limits["file"]:
                row["get_vs_verified"] = row["get_gib_s"] / limits["file"]["limit_verified_read_gib_s"]
            # The most conservative reading: the mode's best round against the best raw sample anywhere.
            row["best_put_vs_max_raw"] = row["best_put_gib_s"] / limits["file"]["max_write_gib_s"]
            row["best_get_vs_max_raw"] = row["best_get_gib_s"] / limits["file"]["max_read_gib_s"]
        else:
            raw = limits["cuda"]["h2d_gib_s"] if device.type == "cuda" else limits["ram_gib_s"]
            row["get_vs_raw"] = row["get_gib_s"] / raw
    return limits, rows


def _span(pair, spec=".2f") -> str:
    return "" if not pair else f" ({format(pair[0], spec)}-{format(pair[1], spec)})"


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ring(result: Dict[str, object]) -> str:
    ring = result.get("ring_bytes") or 0
    return f"{ring >> 20} MiB" if ring else "max(4, in flight) requests"


def _pattern(io) -> str:
    """A file mode's request size x requests in flight (`stats()["file_io"]`)."""
    return "-" if not io else io["pattern"]


def sweep_lines(f: dict) -> List[str]:
    """The raw sweep as a grid: a line per request size, a column per count in flight, each cell write/read
    GiB/s with `fallocate` and, in brackets, the write without it."""
    cells: Dict[tuple, dict] = {}
    for label in f["write_gib_s"]:
        p = rawio.parse(label)
        cells.setdefault((p.request, p.inflight), {})[p.fallocate] = (f["write_gib_s"][label], f["read_gib_s"][label])
    requests = sorted({r for r, _ in cells})
    inflights = sorted({n for _, n in cells})
    lines = ["request | " + " | ".join(f"{'x' + str(n):<16}" for n in inflights)]
    for r in requests:
        row = []
        for n in inflights:
            c = cells.get((r, n))
            if not c:
                row.append(f"{'-':<16}")
                continue
            w, rd = c.get(True, c.get(False))
            row.append(f"{w:.2f}/{rd:.2f}" + (f" ({c[False][0]:.2f})" if True in c and False in c else "      "))
        lines.append(f"{r >> 20:>3} MiB | " + " | ".join(f"{x:<16}" for x in row))
    return lines


def table(result: Dict[str, object]) -> str:
    f = result["limits"]["file"]
    kind = "O_DIRECT" if f["o_direct"] else "buffered, pages dropped"
    lines = [
        f"device {result['device']}, cache {result['cache_bytes'] / GiB:.2f} GiB in {result['layer_bytes'] >> 20} MiB "
        f"layers, directory {result['directory']}" + (f" (on {result['filesystem_in_ram']}: in RAM)"
                                                      if result["filesystem_in_ram"] else ""),
        f"raw file patterns ({kind}, a {result.get('sweep_bytes', 0) >> 20} MiB file each, a pre-touched ring of "
        f"{_ring(result)}{' in huge pages' if result.get('ring_pages') == 'huge' else ''}; write/read "
        "GiB/s, write without fallocate in brackets; medians of the rounds):",
        *sweep_lines(f),
        *([f"the best patterns with the ring in 4 KiB pages instead: write {f['small_pages']['write']:.0%}, read "
           f"{f['small_pages']['read']:.0%} of the same pattern in huge pages (median of the rounds)"]
          if "small_pages" in f else []),
        f"best raw pattern: write {f['best_write_gib_s']:.2f} ({f['best_write_pattern']}), read "
        f"{f['best_read_gib_s']:.2f} ({f['best_read_pattern']}); each file mode's own pattern is in the table "
        "(request size x requests in flight, and how it was chosen)",
        f"raw file limit: write {f['limit_write_gib_s']:.2f}{_span(f['limit_write_range'])}, read "
        f"{f['limit_read_gib_s']:.2f}{_span(f['limit_read_range'])} GiB/s (the best pattern measured again over the "
        f"whole cache: median of the {f['limit_passes']} raw passes around the file modes; lowest-highest in brackets)",
        *([f"a raw reader that verifies what it reads (each request's xxh3 taken by its thread as it lands, as the "
           f"file tiers check every chunk), same pattern, in the same passes: {f['limit_verified_read_gib_s']:.2f}"
           f"{_span(f['limit_verified_read_range'])} GiB/s, {f['limit_verified_read_gib_s'] / f['limit_read_gib_s']:.0%} "
           "of the raw read"] if "limit_verified_read_gib_s" in f else []),
        f"raw RAM memcpy {result['limits']['ram_gib_s']:.2f} GiB/s" + (
            "; pinned H2D {h2d_gib_s:.2f} / D2H {d2h_gib_s:.2f} GiB/s".format(**result["limits"]["cuda"])
            if "cuda" in result["limits"] else ""),
        "async modes: prefetch depth "
        f"{result['prefetch_depth']}, compute {result['compute_ratio']}x the per-layer read time; every figure "
        f"is the median of {result['rounds']} interleaved rounds",
        "",
        "| mode       | pattern            | put GiB/s | put / raw write | get GiB/s | get / raw read | read ms/layer "
        "| compute ms/layer | exposed ms | hidden | exact |",
        "|------------|--------------------|-----------|-----------------|-----------|----------------|---------------"
        "|------------------|------------|--------|-------|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']:<10} | {_pattern(r.get('file_io')):<18} | {r['put_gib_s']:9.2f} | {_fmt(r.get('put_vs_raw'), '15.0%')} | {r['get_gib_s']:9.2f} "
            f"| {_fmt(r.get('get_vs_raw'), '14.0%')} | {r['read_ms_per_layer']:13.1f} "
            f"| {_fmt(r.get('compute_ms_per_layer'), '16.1f')} | "
            f"{_fmt(None if 'exposed_s' not in r else 1000 * r['exposed_s'], '10.1f')} "
            f"| {_fmt(r.get('hidden'), '6.0%')} | {str(r['exact']):<5} |")
    strict = [r for r in result["rows"] if "best_put_vs_max_raw" in r]
    if strict:
        lines += ["", "paired (each mode against the mean of the raw passes just before and after it, in every round; "
                      "median of the per-round ratios, lowest-highest round in brackets): " + "; ".join(
                          f"{r['mode']} put {r['put_vs_paired']:.0%}{_span(r['put_vs_paired_range'], '.0%')}, "
                          f"get {r['get_vs_paired']:.0%}{_span(r['get_vs_paired_range'], '.0%')}" + (
                              f", {r['get_vs_paired_verified']:.0%} of the verifying reader"
                              f"{_span(r['get_vs_paired_verified_range'], '.0%')}"
                              if "get_vs_paired_verified" in r else "") for r in strict)]
        moved = [kind for kind in ("write", "read") if f[f"limit_{kind}_range"]
                 and f[f"limit_{kind}_range"][1] > NOISY * f[f"limit_{kind}_range"][0]]
        if moved:
            lines += ["", f"note: the disk's raw {' and '.join(moved)} throughput moved by more than "
                          f"{NOISY - 1:.0%} from pass to pass in this run (brackets above): a ratio nearer a target "
                          "than that is not settled by one run of this length; more --rounds narrow the medians."]
        lines += ["", f"best round against the best raw sample of any pattern and round (raw write {f['max_write_gib_s']:.2f}, "
                      f"read {f['max_read_gib_s']:.2f} GiB/s): " + "; ".join(
                          f"{r['mode']} put {r['best_put_vs_max_raw']:.0%}, get {r['best_get_vs_max_raw']:.0%}" for r in strict)]
    return "\n".join(lines)
