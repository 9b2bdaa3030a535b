"""Which layers should stay resident under a device budget? Exposed wait of three choices, side by side.

A store with part of its layers resident and the rest streamed from files (`file_async`: reads on the I/O
thread overlap the consumer, also on a CPU), consumed by a loop that "computes" each layer for a fixed time
(a sleep: the host is free while a GPU would compute). The placement rule is swapped in turn:

    first   the first R layers of the order are resident
    last    the last R layers
    spread  R layers spread evenly over the order (what `plan.resident_indices` does)

Usage: python scripts/resident_choice.py [--layers 32] [--mib 8] [--compute-ms 4] [--steps 6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import offload_core.store.plan as plan
from offload_core import KVStore, OffloadConfig

RULES = {
    "first": lambda n, r: list(range(min(r, n))),
    "last": lambda n, r: list(range(max(0, n - r), n)),
    "spread": plan.resident_indices,
}


def one(rule: str, args, directory: str) -> dict:
    original = plan.resident_indices
    plan.resident_indices = RULES[rule]
    try:
        numel = args.mib * 2**20 // 2 // 2  # K and V in bf16
        k = torch.randn(numel).bfloat16()
        config = OffloadConfig(mode="file_async", device_budget=args.resident * 2 * numel * 2 + 8192,
                               file_dir=directory, bypass_page_cache=True, prefetch_depth=args.depth)
        waits = []
        with KVStore(config, "cpu", expected_bytes=args.layers * 2 * numel * 2) as store:
            for i in range(args.layers):
                store.put(i, k, k)
            for step in range(args.steps + 1):
                before = store.stats()["exposed_wait_s"]
                start = time.perf_counter()
                for i in range(args.layers):
                    store.get(i)
                    time.sleep(args.compute_ms / 1000)
                if step:  # step 0 warms up (first pass: nothing prefetched before it)
                    waits.append(store.stats()["exposed_wait_s"] - before)
            stats = store.stats()
        return {"rule": rule, "wait_ms": statistics.median(waits) * 1000, "resident": stats["plan"]["device"],
                "page_cache": stats["page_cache"], "pass_ms": (time.perf_counter() - start) * 1000}
    finally:
        plan.resident_indices = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--resident", type=int, default=16)
    p.add_argument("--mib", type=int, default=8, help="MiB per layer (K + V)")
    p.add_argument("--compute-ms", type=float, default=4.0)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dir", help="directory for the layer files (default: the system temp dir)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the three rules, interleaved")
    args = p.parse_args()
    torch.set_num_threads(1)
    waits = {rule: [] for rule in RULES}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for _ in range(args.rounds):  # interleaved, so a load that comes and goes slows every rule alike
            for rule in RULES:
                r = one(rule, args, directory)
                waits[rule].append(r["wait_ms"])
                print(f"{r['rule']:>6}: exposed wait {r['wait_ms']:7.1f} ms per pass, {r['resident']} resident, "
                      f"last pass {r['pass_ms']:.0f} ms, reads: {r['page_cache']}")
    print("median exposed wait per pass: " + ", ".join(
        f"{rule} {statistics.median(w):.1f} ms" for rule, w in waits.items()))


if __name__ == "__main__":
    main()
