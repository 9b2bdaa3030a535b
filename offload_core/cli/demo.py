"""The round trip behind `python -m offload_core demo` (its options and checks: `democli`)."""

from __future__ import annotations

import sys
import time

import torch

from ..config import Mode, OffloadConfig
from ..places import DEVICE, FILE, HOST_PLACES, MiB
from ..store.kvstore import KVStore

# Where each mode keeps the cache between gets: the `bytes` entries of `KVStore.stats()` that must hold it all.
MODE_PLACES = {Mode.GPU: (DEVICE,), Mode.RAM_SYNC: HOST_PLACES, Mode.RAM_ASYNC: HOST_PLACES, Mode.FILE_SYNC: (FILE,),
               Mode.FILE_ASYNC: (FILE,)}


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
    in_effect = Mode(stats["mode"])
    held = sum(stats["bytes"][place] for place in MODE_PLACES[in_effect])
    return {"mode": in_effect.value, "reason": stats["reason"], "exact": exact and stats["gets"] == len(layers),
            "held": held >= total, "put_s": put_s, "get_s": get_s, "wait_ms": stats["exposed_wait_s"] * 1000}


def run(args) -> int:
    """The demo on checked options (`democli.check`): 0 when every mode passed both checks, else 1."""
    numel = max(1, int(args.mib * MiB) // 2)
    layers = [(torch.randn(numel, device=args.device).to(torch.bfloat16),
               torch.randn(numel, device=args.device).to(torch.bfloat16)) for _ in range(args.layers)]
    print(f"{args.layers} layers of 2 x {numel * 2 / MiB:.3f} MiB (bfloat16) on {args.device}")
    print(f"{'mode':<11} {'in effect':<11} {'exact':<6} {'held':<5} {'put s':>7} {'get pass s':>11} "
          f"{'exposed wait ms':>16}")
    failed = []
    for mode in MODE_PLACES:
        r = round_trip(mode, layers, args.device)
        print(f"{mode.value:<11} {r['mode']:<11} {'yes' if r['exact'] else 'NO':<6} {'yes' if r['held'] else 'NO':<5} "
              f"{r['put_s']:>7.3f} {r['get_s']:>11.3f} {r['wait_ms']:>16.1f}")
        if r["mode"] != mode.value:
            print(f"  ({mode.value} ran as {r['mode']}: {r['reason']})")
        if not (r["exact"] and r["held"]):
            failed.append(mode.value)
    if failed:
        print(f"FAILED: {', '.join(failed)}: a layer did not come back bit-identical, or the cache was not held in "
              "its mode's places (column 'held').", file=sys.stderr)
        return 1
    print("every mode returned every layer bit-identical")
    return 0
