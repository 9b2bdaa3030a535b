"""`python -m offload_core bench --overhead`: the engine's own time per `get`, outside the copy it makes.

A denoising step calls `get` once per layer and branch (60 x 2 for a real model); on a GPU every microsecond of
Python on that path is one the side stream cannot hide. Tiny layers make the copy cost next to nothing, so what
is left is the engine: the time of a get in `gpu` (no copy at all), and in the RAM modes a get's time above a
plain copy of the same bytes into a buffer. Measured under `torch.no_grad()` (a diffusers pipeline's call) and
under `torch.inference_mode()` (ComfyUI's), the minimum over `rounds` passes of `layers` gets each.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Dict, List

import torch

from ..config import OffloadConfig
from ..store.kvstore import KVStore

MODES = ("gpu", "ram_sync", "ram_async")
TARGET_US = {"gpu": 5.0, "ram_sync": 15.0, "ram_async": 15.0}  # issue 33's bounds, on the bench's CPU
SHAPE = (1, 4, 2, 8)  # K and V of 256 bytes each in bfloat16: the copy costs next to nothing


def _per_get_us(fn, layers: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for i in range(layers):
            fn(i)
        best = min(best, (time.perf_counter_ns() - start) / layers / 1000)
    return best


def measure(device: torch.device, layers: int = 60, rounds: int = 200) -> List[Dict[str, object]]:
    """One row per mode and calling context: the get's microseconds, the plain copy's, the engine's share."""
    k, v = torch.randn(SHAPE, device=device).to(torch.bfloat16), torch.randn(SHAPE, device=device).to(torch.bfloat16)
    out_k, out_v = torch.empty_like(k), torch.empty_like(v)

    def plain_copy(_i: int) -> None:
        out_k.copy_(k)
        out_v.copy_(v)

    rows = []
    for context_name, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        with context():
            copy_us = _per_get_us(plain_copy, layers, rounds)
            for mode in MODES:
                with KVStore(OffloadConfig(mode=mode), device, name="overhead") as store:
                    for i in range(layers):
                        store.put(i, k, v)
                    get_us = _per_get_us(store.get, layers, rounds)
                engine = get_us if mode == "gpu" else get_us - copy_us
                rows.append({"mode": mode, "context": context_name, "get_us": get_us, "copy_us": copy_us,
                             "engine_us": engine, "target_us": TARGET_US[mode], "within": engine <= TARGET_US[mode]})
    return rows


def table(rows: List[Dict[str, object]]) -> str:
    lines = ["| mode | called under | get us | plain copy us | engine us (target) |", "|---|---|---|---|---|"]
    for r in rows:
        engine = f"{r['engine_us']:.1f} (<= {r['target_us']:g}{'' if r['within'] else ', OVER'})"
        copy = "-" if r["mode"] == "gpu" else f"{r['copy_us']:.1f}"
        lines.append(f"| {r['mode']} | {r['context']} | {r['get_us']:.1f} | {copy} | {engine} |")
    lines.append("engine: a get's time in gpu (it copies nothing), else its time above a plain copy of K and V "
                 "(tiny layers; the minimum over the passes).")
    return "\n".join(lines)


def main(args) -> int:
    torch.set_num_threads(args.threads or 1)
    rows = measure(args.device, rounds=max(20, 100 * args.runs))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"overhead": rows, "device": str(args.device)}, f, indent=2)
        print(f"JSON written to {args.json}", file=sys.stderr)
    return 0
