"""diffusers adapter: offload the prefix KV cache of Qwen-Image 2.1 and FLUX.2 Klein KV pipelines.

The only module of the engine that imports diffusers.
"""

try:
    import diffusers as _diffusers  # noqa: F401  (checked here so that a missing extra says how to get it)
except ModuleNotFoundError as exc:
    if exc.name != "diffusers":
        raise
    raise ModuleNotFoundError('offload_core.diffusers needs diffusers 0.42.x, which is not installed: '
                              'pip install "comfyui-kv-offload[diffusers]"', name="diffusers") from exc

from .api import check_diffusers_version, disable_kv_offload, enable_kv_offload
from .session import OffloadSession

__all__ = ["enable_kv_offload", "disable_kv_offload", "check_diffusers_version", "OffloadSession"]
