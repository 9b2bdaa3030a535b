"""The ComfyUI extension: our node, plus the memory monitor's node and routes where present."""

from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from .host import reclaim_leftovers
from .qwen21 import qwen21_support
from .settings_node import KVOffloadSettings

log = logging.getLogger(__name__)


def _monitor_nodes() -> list:
    try:
        from .monitor import KVMemoryMonitor
    except ImportError:
        log.debug("KV Offload: memory monitor node not available", exc_info=True)
        return []
    return [KVMemoryMonitor]


def _register_routes() -> None:
    try:
        from .routes import register_routes
    except ImportError:
        log.debug("KV Offload: routes not available", exc_info=True)
        return
    register_routes()


class KVOffloadExtension(ComfyExtension):
    async def on_load(self) -> None:
        reclaim_leftovers()
        _register_routes()
        log.info("KV Offload: %s", qwen21_support())

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [KVOffloadSettings, *_monitor_nodes()]
