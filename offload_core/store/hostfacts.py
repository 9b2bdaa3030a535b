"""The host's facts a store's plan is made from (free memory, the temp dir), checked like options.

A `HostServices` callable is the host's word; a bad figure raises here, naming the callable, the value and the
fix, before the store allocates anything. Without a callable the engine queries the figure itself.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Optional

import psutil
import torch

from ..config import HostServices


def host_figure(name: str, value) -> Optional[int]:
    """A byte count a `HostServices` callable returned, checked like an option: an int >= 0, or None (unknown).

    A finite real number >= 0 (a float, a NumPy integer) is accepted and truncated to whole bytes; NaN, inf, a
    negative number, a bool or anything else raises, so a bad figure never becomes a plan (NaN compares False
    against every budget).
    """
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return int(value)
    raise ValueError(f"HostServices: `{name}` returned {value!r} ({type(value).__name__}); it must return a byte "
                     "count >= 0 (an int), or None when the figure is unknown. Fix that callable, or leave it None "
                     "so the engine queries the figure itself.")


def host_dir(value) -> str:
    """The directory `HostServices.temp_dir` returned, checked before a file place is made in it."""
    if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
        return os.fspath(value)
    raise ValueError(f"HostServices: `temp_dir` returned {value!r} ({type(value).__name__}); it must return the path of "
                     "an existing directory. Fix that callable, or leave it None for the system temp dir.")


def free_device_memory(device: torch.device, host: HostServices) -> Optional[int]:
    if host.free_device_memory is not None:
        return host_figure("free_device_memory", host.free_device_memory(device))
    if device.type == "cuda":
        # Memory torch's caching allocator holds but does not use is free for our tensors too; the driver's
        # figure alone would push a cache that fits off the device after the first request.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + int(cached)
    if device.type == "cpu":
        return free_host_memory(host)
    return None


def free_host_memory(host: HostServices) -> Optional[int]:
    if host.free_host_memory is not None:
        return host_figure("free_host_memory", host.free_host_memory())
    return int(psutil.virtual_memory().available)


def same_pool_reason(device: torch.device) -> Optional[str]:
    """Why `auto` must not plan RAM places beside this device beyond unified memory: the device is the CPU."""
    return "the device is the CPU" if device.type == "cpu" else None
