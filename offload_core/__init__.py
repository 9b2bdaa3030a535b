"""KV Offload engine: keep a prefix KV cache on the device, in host RAM or in files, layer by layer.

    from offload_core import OffloadConfig, Mode, KVStore, memory_snapshot

No ComfyUI imports here, ever; diffusers only inside `offload_core.diffusers`.
"""

from ._version import package_version
from .config import HostServices, Mode, OffloadConfig
from .fingerprint import passive
from .memory import memory_snapshot
from .store import KVStore
from .tiers import KVFileError, KVWriteError

__all__ = ["HostServices", "KVFileError", "KVStore", "KVWriteError", "Mode", "OffloadConfig", "memory_snapshot", "passive"]
__version__ = package_version()  # from pyproject.toml: the one place the version is written
