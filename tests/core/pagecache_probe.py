"""Run in a subprocess by test_page_cache.py: writes and reads back a file-tier cache, prints measurements.

A separate process so RSS and page-cache figures belong to this cache alone.
"""

import ctypes
import json
import mmap
import os
import sys

import psutil
import torch

from offload_core import KVStore, OffloadConfig

MiB = 1 << 20


def resident_bytes(path):
    """Bytes of `path` now in the OS page cache (mincore on a private mapping)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    buf = ctypes.c_char.from_buffer(mm)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
    del buf
    mm.close()
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(1 for b in vec if b & 1) * mmap.PAGESIZE


def layer(i, numel):
    base = torch.arange(numel, dtype=torch.int32)
    return base * (i + 1), base * -(i + 2)


def main():
    mode, bypass, layers, layer_mib, file_dir = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    numel = layer_mib * MiB // 8  # K and V are int32 halves of the layer
    proc = psutil.Process()
    store = KVStore(OffloadConfig(mode=mode, file_dir=file_dir, bypass_page_cache=bypass), "cpu")
    for i in range(layers):
        k, v = layer(i, numel)
        store.put(i, k, v)
        del k, v
    baseline, peak, exact = proc.memory_info().rss, 0, True
    store.flush()  # every write is on disk
    store.get(0)
    for i in list(range(1, layers)) + [0]:
        k, v = store.get(i)
        exact &= int(k[-1]) == (numel - 1) * (i + 1) and int(v[numel // 2]) == (numel // 2) * -(i + 2)
        peak = max(peak, proc.memory_info().rss)
    stats = store.stats()
    directory = stats["file_dir"]
    files = [os.path.join(directory, f) for f in os.listdir(directory) if not f.startswith(".")]
    cache_bytes = sum(os.path.getsize(f) for f in files)
    resident = sum(resident_bytes(f) for f in files)
    store.close()
    print(json.dumps({"cache_bytes": cache_bytes, "page_cache_bytes": resident, "rss_growth": peak - baseline,
                      "layer_bytes": layer_mib * MiB, "mode": stats["page_cache"], "exact": exact,
                      "left": os.listdir(file_dir)}))


if __name__ == "__main__":
    main()
