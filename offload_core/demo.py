"""`python -m offload_core demo`: a round trip through every tier with synthetic K/V, timed.

Not the benchmark (that runs a real pipeline); a quick check that each tier works on this machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from .config import Mode, OffloadConfig
from .store import KVStore


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload_core demo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--mib", type=float, default=8.0, help="size of K (and of V) per layer, MiB")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    numel = int(args.mib * 2**20) // 2
    layers = [(torch.randn(numel, device=device).to(torch.bfloat16), torch.randn(numel, device=device).to(torch.bfloat16))
              for _ in range(args.layers)]
    print(f"{'mode':<11} {'tier':<11} {'exact':<6} {'put s':>7} {'get pass s':>11} {'exposed wait ms':>16}")
    for mode in (m for m in Mode if m not in (Mode.OFF, Mode.AUTO)) :
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
        print(f"{mode.value:<11} {stats['tier']:<11} {'yes' if exact else 'NO':<6} {put_s:>7.3f} {get_s:>11.3f} "
              f"{stats['exposed_wait_s'] * 1000:>16.1f}")
    return 0
