"""KV Offload engine: keep a prefix KV cache on the device, in host RAM or in files, layer by layer.

    from offload_core import OffloadConfig, Mode, KVStore, memory_snapshot

No ComfyUI imports here, ever; diffusers only inside `offload_core.diffusers`.

The public names are imported on first use (PEP 562), so `python -m offload_core --help` and the command
line's usage errors answer without importing torch.
"""

import importlib

from ._version import package_version

# public name -> the module that defines it
_EXPORTS = {"HostServices": ".config", "Mode": ".config", "OffloadConfig": ".config", "memory_snapshot": ".host.memory",
            "KVStore": ".store.kvstore", "GrowingKVStore": ".growing", "GrowingShape": ".growing", "KVFileError": ".tiers",
            "KVWriteError": ".tiers", "passive": ".reuse.fingerprint"}

__all__ = sorted(_EXPORTS)
__version__ = package_version()  # from pyproject.toml: the one place the version is written


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted({*globals(), *__all__})
