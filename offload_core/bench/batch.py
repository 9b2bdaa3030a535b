"""`bench --batch`: a batch of 4 images from one prompt against a batch of 1, with identical rows kept once.

For each mode (gpu, ram_async, file_async) three rows: batch 1; batch 4 with the check off (`dedup=False`, every
row kept, as before dedup); batch 4 with it on. Each row: the bytes the stores keep, the bytes they move per
step (transfer bytes over the steps, the offload at put counted in the first), the rows kept of the rows put,
the check's cost, the latency (median of `runs` after one warm-up), and whether the images match the batch-4 row
without dedup bit for bit. Prefix reuse is off, so every request extracts and puts its prefix.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List

import numpy as np
import torch

from ..places import MiB

BATCH = 4
MODES = ("gpu", "ram_async", "file_async")
VARIANTS = (("1", 1, None), (f"{BATCH}, dedup off", BATCH, False), (str(BATCH), BATCH, None))


def _request(pipe, call: Callable[[], dict], mode: str, batch: int, dedup, device: torch.device):
    from ..diffusers import disable_kv_offload, enable_kv_offload

    session = enable_kv_offload(pipe, mode, reuse=False, dedup=dedup)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = pipe(**call(), num_images_per_prompt=batch).images
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        latency = time.perf_counter() - start
    finally:
        disable_kv_offload(pipe)
    return latency, np.asarray(out), session.last_stats


def _row(mode: str, label: str, steps: int, latencies: List[float], stats: List[dict]) -> dict:
    dedup = [s["dedup"] for s in stats]
    return {"mode": mode, "batch": label, "latency_s": statistics.median(latencies),
            "kept_bytes": sum(sum(s["stored_bytes"].values()) for s in stats),
            "moved_bytes_per_step": sum(s["transfers"]["bytes"] for s in stats) / steps,
            "peak_device_bytes": sum(s["peak_device_bytes"] for s in stats),
            "rows_put": sum(d["rows_put"] for d in dedup), "rows_kept": sum(d["rows_kept"] for d in dedup),
            "check_s": sum(d["check_s"] for d in dedup)}


def measure(pipe, call: Callable[[], dict], *, steps: int, runs: int, device: torch.device,
            modes=MODES) -> List[dict]:
    """Every mode's three rows; `call()` gives fresh keyword arguments for one request (a new generator)."""
    rows = []
    for mode in modes:
        reference = None
        for label, batch, dedup in VARIANTS:
            latencies, images = [], []
            for i in range(runs + 1):  # the first is the warm-up
                latency, out, stats = _request(pipe, call, mode, batch, dedup, device)
                if i:
                    latencies.append(latency)
                    images.append(out)
            row = _row(mode, label, steps, latencies, stats)
            if dedup is False:
                reference = images[-1]
            row["exact"] = None if batch == 1 else bool(np.array_equal(images[-1], reference))
            rows.append(row)
    return rows


def table(rows: List[dict], settings: str) -> str:
    head = ("mode", "batch", "latency s", "kept MiB", "moved MiB/step", "peak dev MiB", "rows kept", "check ms",
            "exact")
    lines = [settings, " | ".join(head)]
    for r in rows:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        lines.append(" | ".join((r["mode"], r["batch"], f"{r['latency_s']:.3f}", f"{r['kept_bytes'] / MiB:.1f}",
                                 f"{r['moved_bytes_per_step'] / MiB:.1f}", f"{r['peak_device_bytes'] / MiB:.1f}",
                                 f"{r['rows_kept']}/{r['rows_put']}", f"{r['check_s'] * 1000:.2f}", exact)))
    return "\n".join(lines)


def main(args) -> int:
    """Runs after the CLI's checks: the pipeline `bench` would build, the table printed (and `--json` written).
    Exit status 1 when a batch-4 row's images differ from those of the batch-4 row without dedup."""
    import json

    from . import loading

    pipe, description = loading.pipeline(args)  # the pipeline `bench` would measure with these options
    call = loading.call_factory(pipe, builtin=args.model is None, steps=args.steps, resolution=args.resolution,
                                n_images=args.images)
    rows = measure(pipe, call, steps=args.steps, runs=args.runs, device=args.device)
    settings = (f"{description}; batch {BATCH} against 1, {args.steps} steps, {args.resolution}x{args.resolution}, "
                f"{args.images} condition image(s); median of {args.runs} after 1 warm-up; prefix reuse off")
    print(table(rows, settings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "batch_rows": rows}, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0 if all(r["exact"] is not False for r in rows) else 1
