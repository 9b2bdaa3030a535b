"""`memory_snapshot()`: what this process, its device and the system hold, each figure with its scope.

Figures are grouped by scope so a reader never mistakes one for another: `process` (this process alone:
RSS, the torch allocator's device memory), `device` (the whole device, every process on it) and `system`
(the whole machine, or its cgroup). Unknown values are `None`, never -1.
"""

from __future__ import annotations

import os
from typing import Optional

import psutil
import torch

from . import hostmem

SNAPSHOT_VERSION = 1
_UNLIMITED = 1 << 60


def _cgroup_value(*paths: str) -> Optional[int]:
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return value if value < _UNLIMITED else None
    return None


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _device_figures(device: torch.device) -> tuple:
    """(per-process figures, device-wide figures) for `device`."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        process = {
            "device_allocated": torch.cuda.memory_allocated(device),
            "device_reserved": torch.cuda.memory_reserved(device),
            "device_peak_allocated": torch.cuda.max_memory_allocated(device),
        }
        props = torch.cuda.get_device_properties(device)
        wide = {"type": "cuda", "name": props.name, "total": int(total), "free": int(free),
                "integrated": bool(getattr(props, "is_integrated", False))}
        return process, wide
    if device.type == "mps":
        process = {"mps_current_allocated": torch.mps.current_allocated_memory(),
                   "mps_driver_allocated": torch.mps.driver_allocated_memory()}
        wide = {"type": "mps", "name": "Apple MPS", "recommended_max": torch.mps.recommended_max_memory(),
                "integrated": True}
        return process, wide
    return {}, {"type": device.type, "name": None, "total": None, "free": None, "integrated": None}


def memory_snapshot(device=None) -> dict:
    """A plain dict: {"v", "process": {...}, "device": {...}, "system": {...}}; `None` for what is unknown.

    process: rss; spare_staging, the file tiers' idle staging kept for the next store (part of rss, but the OS
        takes it back whenever it needs memory: `hostmem.Spares`); and the torch allocator's figures on `device`
        (CUDA: device_allocated, device_reserved, device_peak_allocated; MPS: mps_current_allocated,
        mps_driver_allocated).
    device: type, name, total, free (CUDA, device-wide) or recommended_max (MPS), integrated.
    system: ram_total, ram_available, swap_used, swap_total, cgroup_limit, cgroup_usage.
    """
    device = torch.device(device) if device is not None else _default_device()
    process, wide = _device_figures(device)
    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    process = {"pid": os.getpid(), "rss": psutil.Process().memory_info().rss, "spare_staging": hostmem.SPARES.nbytes,
               **process}
    system = {
        "ram_total": int(vm.total), "ram_available": int(vm.available),
        "swap_used": int(swap.used), "swap_total": int(swap.total),
        "cgroup_limit": _cgroup_value("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        "cgroup_usage": _cgroup_value("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    }
    return {"v": SNAPSHOT_VERSION, "process": process, "device": wide, "system": system}
