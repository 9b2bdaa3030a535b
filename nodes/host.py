"""ComfyUI's services, handed to the engine as `HostServices` (imported only when ComfyUI runs us).

- free device memory: the sampling patcher's `get_free_memory` (it counts DynamicVRAM), else
  `model_management.get_free_memory`; this is what `auto` sizes against.
- pinning: `ensure_pin_budget` first (the pinned-memory budget is shared with model weights), then
  `pin_memory` / `unpin_memory`, so ComfyUI accounts for every page we lock. On `--cpu` and Apple
  `pin_memory` refuses and the engine degrades to pageable memory.
- streams: ComfyUI's offload stream pool (`get_offload_stream`), shared with weight casting; none on CPU.
- files: a `kv_offload` folder under ComfyUI's temp directory (wiped at start-up). No path from a graph is
  ever used: the engine makes a private directory below this one and deletes it on close.
"""

from __future__ import annotations

import logging
import os

from ..offload_core import HostServices

log = logging.getLogger(__name__)

TEMP_SUBDIR = "kv_offload"


def temp_root() -> str:
    import folder_paths

    path = os.path.join(folder_paths.get_temp_directory(), TEMP_SUBDIR)
    os.makedirs(path, exist_ok=True)
    return path


def comfy_host_services(patcher=None) -> HostServices:
    import comfy.model_management as mm

    def free_device_memory(device):
        try:
            if patcher is not None and hasattr(patcher, "get_free_memory"):
                return int(patcher.get_free_memory(device))
            return int(mm.get_free_memory(device))
        except Exception:
            log.debug("free-memory query failed", exc_info=True)
            return None

    def free_host_memory():
        try:
            import torch

            return int(mm.get_free_memory(torch.device("cpu")))
        except Exception:
            return None

    def pin(tensor) -> bool:
        budget = getattr(mm, "ensure_pin_budget", None)
        if budget is not None and not budget(tensor.nbytes):
            return False
        return bool(mm.pin_memory(tensor))

    def unpin(tensor):
        return mm.unpin_memory(tensor)

    def stream(device):
        if getattr(device, "type", None) not in ("cuda", "xpu"):
            return None
        return mm.get_offload_stream(device)

    return HostServices(free_device_memory=free_device_memory, free_host_memory=free_host_memory,
                        pin=pin, unpin=unpin, stream=stream, temp_dir=temp_root)
