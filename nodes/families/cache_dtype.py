"""ComfyUI's own cache nodes' `dtype` choice (default / int8 / int4) mapped to our `storage`.

ComfyUI's Qwen-Image 2.1 prefix cache and its `WanAnimate2Cache` node both offer int8 and int4 storage. A
user who picked one of them and then added our node must never lose that choice silently: it maps to the
nearest storage of ours, or our node's own lossy storage wins, and either way the user is told.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ...offload_core import Mode, OffloadConfig

# ComfyUI's cache dtype -> the nearest storage of ours (int4 has none: int8 keeps twice its bytes).
COMFY_DTYPES = {"default": None, "int8": "int8", "int4": "int8"}


def storage_for_cache_dtype(config: OffloadConfig, dtype, label: str) -> "tuple[OffloadConfig, Optional[str]]":
    """The config to use given ComfyUI's cache `dtype`, and what to tell the user (None: nothing to say).

    Our node's own `storage` (anything but exact) wins over it, said so; `int8` is ours; `int4` maps to
    `int8`. An unknown value keeps exact, said so. `label` names ComfyUI's cache in the message.
    """
    if dtype in (None, "default") or config.mode is Mode.OFF:
        return config, None
    if config.storage != "exact":
        return config, (f"KV Offload: {label} cache dtype {dtype!r} is overridden by this node's storage "
                        f"{config.storage!r}.")
    mapped = COMFY_DTYPES.get(dtype)
    if mapped is None:
        return config, (f"KV Offload: {label} cache dtype {dtype!r} is not one KV Offload knows "
                        "(default, int8, int4); the cache stays exact. Set `storage` on the node instead.")
    note = "" if mapped == dtype else f" (the nearest KV Offload has: {dtype} is not available, int8 keeps twice its bytes)"
    return dataclasses.replace(config, storage=mapped), (
        f"KV Offload: {label} cache dtype {dtype!r} -> storage {mapped!r}{note}.")


def storage_for_qwen21(config: OffloadConfig, options: Optional[dict]) -> "tuple[OffloadConfig, Optional[str]]":
    """Honour `options["dtype"]` of ComfyUI's Qwen-Image 2.1 cache (see `storage_for_cache_dtype`)."""
    return storage_for_cache_dtype(config, (options or {}).get("dtype"), "Qwen-Image 2.1")
