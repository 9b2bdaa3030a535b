"""What the benchmark ran on: printed with the table and stored in the JSON."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile

import psutil
import torch

from ..places import GiB


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc (not Linux): the platform's own name below
    return platform.processor() or platform.machine()


def _filesystem(path: str) -> str | None:
    """Filesystem type of the mount holding `path` (Linux), e.g. 'ext4', 'tmpfs', 'overlay'."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    path = os.path.realpath(path)
    best = max((m for m in mounts if path == m[0] or path.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


def describe(device: torch.device) -> dict:
    """A plain dict describing CPU, RAM, accelerator, temp-dir filesystem and library versions."""
    import diffusers

    info = {
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total, "os": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
        "device": str(device), "device_name": None, "device_memory_bytes": None,
        "temp_dir": tempfile.gettempdir(), "temp_fs": _filesystem(tempfile.gettempdir()),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_memory_bytes=props.total_memory)
    return info


def one_line(info: dict) -> str:
    parts = [f"{info['cpu']} ({info['cpu_count']} cores, {info['torch_threads']} torch threads)",
             f"{info['ram_bytes'] / GiB:.1f} GiB RAM"]
    if info["device_name"]:
        parts.append(f"{info['device_name']} ({info['device_memory_bytes'] / GiB:.1f} GiB)")
    else:
        parts.append(f"device {info['device']}")
    parts.append(f"temp dir {info['temp_dir']} on {info['temp_fs'] or 'unknown fs'}")
    parts.append(f"torch {info['torch']}, diffusers {info['diffusers']}, Python {info['python']}")
    return "; ".join(parts)


def load() -> dict:
    """The machine's load right now: 1/5/15-minute load averages (None where the OS has none) and the CPU count."""
    averages = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"load_avg": list(averages) if averages else None, "cpu_count": os.cpu_count()}


def free(device: torch.device, directory: str) -> dict:
    """Free bytes where a cache can live: on the compute device, in RAM, on the disk holding `directory`.

    `unified`: the device computes from host RAM (a CPU, Apple MPS, an integrated NVIDIA part), so its free
    figure is the RAM's and a RAM mode frees nothing on it.
    """
    ram = int(psutil.virtual_memory().available)
    unified, device_free = True, ram
    if device.type == "cuda":
        unified = bool(getattr(torch.cuda.get_device_properties(device), "is_integrated", False))
        if not unified:
            torch.cuda.empty_cache()  # blocks the allocator keeps after the last request count as free
        device_free = ram if unified else int(torch.cuda.mem_get_info(device)[0])
    try:
        disk = shutil.disk_usage(directory).free
    except OSError:
        disk = None
    return {"device": device_free, "ram": ram, "disk": disk, "disk_dir": directory, "unified": unified}
