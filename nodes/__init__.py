"""ComfyUI side of KV Offload: the settings node, its model patches and host services.

Import submodules directly; this package imports nothing, so the patch modules load without ComfyUI.
"""
