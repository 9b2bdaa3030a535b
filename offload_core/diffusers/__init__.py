"""diffusers adapter: offload the prefix KV cache of Qwen-Image 2.1 and FLUX.2 Klein KV pipelines.

The only module of the engine that imports diffusers.
"""

from .api import check_diffusers_version, disable_kv_offload, enable_kv_offload
from .session import OffloadSession

__all__ = ["enable_kv_offload", "disable_kv_offload", "check_diffusers_version", "OffloadSession"]
