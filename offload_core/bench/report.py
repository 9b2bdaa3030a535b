"""Render the measured rows: the text table, the JSON file and the latency-vs-memory plot."""

from __future__ import annotations

import json
import textwrap

from .rows import BASELINE_KEY

DIAL_KEYS = ("ram_async", "device_25", "device_50", "device_75", "gpu")

JSON_VERSION = 1


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _kv_tiers(kv: dict) -> str:
    parts = [f"{name}={_mib(kv[tier])}" for tier, name in
             (("device", "dev"), ("host_pinned", "pin"), ("host_pageable", "ram"), ("file", "file")) if kv[tier]]
    return " ".join(parts) or "-"


def _error(r: dict) -> str:
    """K/V error of a lossy row (measured at put) and the final image's PSNR against exact storage."""
    err = r.get("kv_error")
    if not err:
        return "-"
    psnr = r.get("psnr_db")
    image = "" if psnr is None else (", PSNR inf" if psnr == float("inf") else f", PSNR {psnr:.1f} dB")
    return f"rel {err['relative'] * 100:.2f}%, max {err['max_abs']:.3g}{image}"


def add_ratios(rows: list[dict]) -> None:
    """Set each row's `ratio_to_gpu`: latency over the `gpu, upstream lifetime` row's (None if not measured)."""
    base = next((r["latency_s"] for r in rows if r["key"] == BASELINE_KEY), None)
    base = base or next((r["latency_s"] for r in rows if r["key"] == "gpu"), None)
    for row in rows:
        row["ratio_to_gpu"] = row["latency_s"] / base if base else None


def device_memory_column(rows: list[dict]) -> tuple[str, str]:
    """(field, header) of the device-memory column: allocator peak where CUDA measured it, else KV bytes."""
    if rows and all(r["peak_device_allocated"] is not None for r in rows):
        return "peak_device_allocated", "peak device MiB (max_memory_allocated)"
    return "peak_kv_device", "peak device-resident KV MiB (engine)"


def table(rows: list[dict], hardware_line: str, settings: str) -> str:
    field, device_header = device_memory_column(rows)
    headers = ["mode", "median s", "x gpu", device_header, "peak RSS MiB", "KV MiB per tier", "exposed wait s"]
    lossy = any(r.get("kv_error") for r in rows)
    if lossy:
        headers.append("K/V error, image vs exact")
    body = []
    for r in rows:
        ratio = "-" if r["ratio_to_gpu"] is None else f"{r['ratio_to_gpu']:.2f}"
        body.append([r["label"], f"{r['latency_s']:.3f}", ratio, _mib(r[field]), _mib(r["peak_rss"]),
                     _kv_tiers(r["kv_bytes"]), f"{r['exposed_wait_s']:.3f}", *([_error(r)] if lossy else [])])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) if i in (0, 5, 7) else c.rjust(w)  # noqa: E731
                                          for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [line(headers), "|" + "|".join(("-" * (w + 2)) for w in widths) + "|", *map(line, body)]
    notes = [f"Hardware: {hardware_line}", f"Settings: {settings}"]
    if field == "peak_kv_device":
        notes.append("No CUDA allocator here: the device column is the peak of K/V bytes resident on the compute "
                     "device (the engine's figure; for the unpatched rows, the pipeline's own cache).")
    fallbacks = sorted({reason for r in rows for reason in r["reasons"] if "→" in reason or "->" in reason})
    if fallbacks:
        notes.append("Tier fallbacks: " + "; ".join(fallbacks))
    unpinned = [r["label"] for r in rows if r.get("pinned_fallback")]
    if unpinned:
        notes.append(f"Pinned memory refused or over budget, pageable copies used instead: {', '.join(unpinned)}")
    cold = sorted({pc for r in rows if r["key"].endswith("_cold") for pc in r["page_cache"]})
    if cold:
        notes.append(f"Cold file rows bypass the page cache with: {', '.join(cold)}")
    if lossy:
        notes.append("K/V error: relative = ||x - x'|| / ||x|| and max |x - x'| over every layer put, measured by "
                     "the store; PSNR: the final image against the same request with exact storage.")
    if not all(r["peak_rss_exact"] for r in rows):
        notes.append("Peak RSS: sampled after each request (no kernel high-water mark here), a lower bound.")
    return "\n".join([*out, "", *notes])


def write_json(path: str, rows: list[dict], hardware: dict, settings: dict) -> None:
    field, header = device_memory_column(rows)
    payload = {"v": JSON_VERSION, "hardware": hardware, "settings": settings,
               "device_memory_column": {"field": field, "label": header}, "rows": rows}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def write_plot(path: str, rows: list[dict], title: str) -> str | None:
    """Save a PNG of latency against peak device memory, one point per row. Returns an error message or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib, which is not installed: `pip install matplotlib`. The plot was skipped."
    field, header = device_memory_column(rows)
    fig, ax = plt.subplots(figsize=(8.5, 5))
    markers = "osD^v<>Ph*X"
    for index, r in enumerate(rows):
        # Tiers often share a memory figure: a legend stays readable where point labels would overlap.
        ax.scatter([(r[field] or 0) / 2**20], [r["latency_s"]], s=60, alpha=0.8, marker=markers[index % len(markers)],
                   label=f"{r['label']} ({r['latency_s']:.2f} s)")
    dial = sorted((r for r in rows if r["key"] in DIAL_KEYS), key=lambda r: DIAL_KEYS.index(r["key"]))
    if len(dial) > 1:  # the device budget is a dial: its rows lie on one curve from streamed to resident
        ax.plot([(r[field] or 0) / 2**20 for r in dial], [r["latency_s"] for r in dial], ":", color="grey",
                linewidth=1, label="device budget dial")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_xlabel(header)
    ax.set_ylabel("median full-pipeline latency (s)")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
