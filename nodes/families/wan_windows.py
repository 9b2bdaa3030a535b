"""The pose cache's windows: what each is, what the budgets leave it, where there is room, its readout line.

Pure helpers of `nodes/families/wan.py` (plain data in, plain data out, besides the free-memory and disk queries the
host answers). No ComfyUI import.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from typing import Optional

import torch

from ...offload_core import Mode, OffloadConfig
from ...offload_core.places import DEVICE, FILE, HOST_PLACES, MiB


@dataclasses.dataclass(eq=False)  # compared by identity: a key tensor has no truth value
class Window:
    """One cached pose sequence: its key (row 0 of the pose latents), its branch id and readout name."""

    key: torch.Tensor
    sid: tuple
    name: str
    hits: int = 0
    store: object = None
    bytes: dict = dataclasses.field(default_factory=dict)  # per place, as last seen open
    claim: int = 0  # RAM bytes of the RAM budget it booked when it opened (0: no RAM budget)


def window_line(w: Window) -> str:
    """e.g. "pose 2: device 0.0 MiB, RAM 96.0 MiB, file 32.0 MiB, 14 hits, prefetch wait 1.2 ms"."""
    b = w.bytes
    ram = sum(b.get(p) or 0 for p in HOST_PLACES)
    stats = w.store.stats() if w.store is not None else {}
    wait = stats.get("exposed_wait_s") or 0.0
    return (f"{w.name}: device {(b.get(DEVICE) or 0) / MiB:.1f} MiB, RAM {ram / MiB:.1f} MiB, "
            f"file {(b.get(FILE) or 0) / MiB:.1f} MiB, {w.hits} hits, prefetch wait {wait * 1e3:.1f} ms")


def window_config(config: OffloadConfig, others: list, same_device: Optional[list] = None) -> OffloadConfig:
    """A new window's config: what the other windows left of the budgets (their `stats()["bytes"]`): `others`,
    every device's, of the RAM budget; `same_device` (default: `others`), its device's, of the VRAM budget."""
    fields = {}
    if config.host_budget is not None:
        used = sum((b.get(p) or 0) for b in others for p in HOST_PLACES)
        fields["host_budget"] = max(0, config.host_budget - used)
    if config.device_budget is not None:
        used = sum((b.get(DEVICE) or 0) for b in (others if same_device is None else same_device))
        fields["device_budget"] = max(0, config.device_budget - used)
    return dataclasses.replace(config, **fields) if fields else config


def place_room(config: OffloadConfig, host, device: Optional[torch.device]) -> Optional[int]:
    """Bytes free where the mode keeps a new window (None: unknown, so nothing is evicted).

    gpu: free VRAM; a RAM mode without a RAM budget: free RAM; every mode that can put the rest in files (the
    file modes, a RAM mode with a RAM budget, auto): free disk where the files go.
    """
    mode = config.mode
    if mode is Mode.GPU:
        query = getattr(host, "free_device_memory", None)
        return query(device) if callable(query) and device is not None else None
    if mode.is_ram and config.host_budget is None:
        query = getattr(host, "free_host_memory", None)
        return query() if callable(query) else None
    where = config.file_dir or (host.temp_dir() if callable(getattr(host, "temp_dir", None)) else tempfile.gettempdir())
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None
