"""Render the measured rows: the text table, the JSON file and the latency-vs-memory plot."""

from __future__ import annotations

import json

from ..places import DEVICE, FILE, PAGEABLE, PINNED, MiB
from .rows import BASELINE_KEY
from .verdict import SPREAD_LIMIT

JSON_VERSION = 2  # 2: each row's range, the machine's load and free memory, the recommendation


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def _kv_places(kv: dict) -> str:
    parts = [f"{name}={_mib(kv[place])}" for place, name in
             ((DEVICE, "dev"), (PINNED, "pin"), (PAGEABLE, "ram"), (FILE, "file")) if kv[place]]
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
    """Set each row's `ratio_to_gpu`: latency over the ratio base's (None if neither base row ran)."""
    base = ratio_base(rows)
    for row in rows:
        row["ratio_to_gpu"] = row["latency_s"] / base["latency_s"] if base and base["latency_s"] else None


def ratio_base(rows: list[dict]) -> dict | None:
    """The row the `x gpu` column divides by: `gpu, upstream lifetime` where it ran, else `gpu, pre-VAE cleanup`
    (the default rows run only the latter)."""
    return next((r for r in rows if r["key"] == BASELINE_KEY), None) or next(
        (r for r in rows if r["key"] == "gpu"), None)


def device_memory_column(rows: list[dict]) -> tuple[str, str]:
    """(field, header) of the device-memory column: allocator peak where CUDA measured it, else KV bytes."""
    if rows and all(r["peak_device_allocated"] is not None for r in rows):
        return "peak_device_allocated", "peak device MiB (max_memory_allocated)"
    return "peak_kv_device", "peak KV MiB on the device (engine)"


def is_unified(device: str) -> bool:
    """A CPU or MPS device computes from host RAM (an integrated CUDA part too, which only `hardware.free` knows)."""
    return device.startswith(("cpu", "mps"))


def device_memory(rows: list[dict], unified: bool) -> list[int]:
    """Each row's bytes in the compute device's memory: the device-memory column's figure, and on a unified device
    (whose memory is the RAM) its K/V in RAM too. A RAM mode's copy there sits in the same memory as the ring's
    slots on the device, so it frees nothing (the reason the recommendation picks no RAM mode on such a device)."""
    field, _ = device_memory_column(rows)
    return [(r[field] or 0) + (r["kv_bytes"][PINNED] + r["kv_bytes"][PAGEABLE] if unified else 0) for r in rows]


def memory_axis(rows: list[dict], device: str, unified: bool | None = None) -> str:
    """The `device_memory` figure named for what it is on `device` (on a CPU the compute device's memory is RAM)."""
    unified = is_unified(device) if unified is None else unified
    field, _ = device_memory_column(rows)
    ram = " + K/V in RAM (the same memory)" if unified else ""
    if field == "peak_device_allocated":
        return f"peak VRAM allocated by torch (MiB, max_memory_allocated){ram}"
    if not unified:
        # "on the device", not "resident": the figure counts the ring's slots too (docs/glossary.md)
        return f"peak K/V on the device ({device}), MiB (engine figure)"
    where = "a CPU: its RAM" if device.startswith("cpu") else f"{device}: the RAM"
    return f"K/V in the device's memory ({where}): peak on the device + in RAM, MiB (engine figures)"


def _range(r: dict) -> str:
    return f"{r['latency_min_s']:.2f}-{r['latency_max_s']:.2f}" + (" !" if r.get("noisy") else "")


def verdict_lines(verdict: dict, cautions: list[str]) -> list[str]:
    """The recommendation and what this run cannot settle, as the lines under the table."""
    lines = [f"Recommendation: {verdict['headline']} ({verdict['call']}).",
             *(f"  - {reason}." for reason in verdict["why"])]
    return lines + [f"Note: {caution}" for caution in cautions]


def table(rows: list[dict], hardware_line: str, settings: str, verdict: dict | None = None,
          cautions: tuple = ()) -> str:
    field, device_header = device_memory_column(rows)
    headers = ["row", "median s", "range s", "x gpu", device_header, "peak RSS MiB", "KV MiB per place",
               "exposed wait s"]
    lossy = any(r.get("kv_error") for r in rows)
    if lossy:
        headers.append("K/V error, image vs exact")
    body = []
    for r in rows:
        ratio = "-" if r["ratio_to_gpu"] is None else f"{r['ratio_to_gpu']:.2f}"
        body.append([r["label"], f"{r['latency_s']:.3f}", _range(r), ratio, _mib(r[field]), _mib(r["peak_rss"]),
                     _kv_places(r["kv_bytes"]), f"{r['exposed_wait_s']:.3f}", *([_error(r)] if lossy else [])])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) if i in (0, 6, 8) else c.rjust(w)  # noqa: E731
                                          for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [line(headers), "|" + "|".join(("-" * (w + 2)) for w in widths) + "|", *map(line, body)]
    notes = [f"Hardware: {hardware_line}", f"Settings: {settings}",
             "Range: the fastest and slowest timed request of the row; ! where they differ by more than "
             f"{SPREAD_LIMIT:.0%} of the median."]
    base = ratio_base(rows)
    if base:
        notes.append(f"x gpu: latency over the '{base['label']}' row's.")
    if field == "peak_kv_device":
        notes.append("No CUDA allocator here: the device column is the peak of K/V bytes on the compute "
                     "device (the engine's figure; for the unpatched rows, the pipeline's own cache).")
    fallbacks = sorted({reason for r in rows for reason in r["reasons"] if "→" in reason or "->" in reason})
    if fallbacks:
        notes.append("Mode fallbacks: " + "; ".join(fallbacks))
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
    tail = ["", *verdict_lines(verdict, list(cautions))] if verdict else []
    return "\n".join([*out, "", *notes, *tail])


def write_json(path: str, rows: list[dict], hardware: dict, settings: dict, verdict: dict | None = None,
               cautions: tuple = ()) -> None:
    field, header = device_memory_column(rows)
    payload = {"v": JSON_VERSION, "hardware": hardware, "settings": settings,
               "device_memory_column": {"field": field, "label": header}, "verdict": verdict,
               "cautions": list(cautions), "rows": rows}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
