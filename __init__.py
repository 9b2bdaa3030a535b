"""KV Offload: a ComfyUI node pack (and the `offload_core` engine it ships).

ComfyUI loads this file as a package and calls `comfy_entrypoint()`; nothing of ComfyUI is imported until
it does, so the engine and the tests can import the pack without ComfyUI. No `NODE_CLASS_MAPPINGS` here:
with one, ComfyUI would never call the entry point.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.entry import KVOffloadExtension

    return KVOffloadExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
