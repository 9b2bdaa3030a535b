"""The ComfyUI extension: the Settings node, the memory monitor's node and the readout's route."""

from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from .run.host import reclaim_leftovers
from .readout.monitor import KVMemoryMonitor
from .families.qwen21 import qwen21_support
from .readout.routes import register_routes
from .settings_node import KVOffloadSettings

log = logging.getLogger(__name__)


class KVOffloadExtension(ComfyExtension):
    async def on_load(self) -> None:
        reclaim_leftovers()
        register_routes()
        log.info("KV Offload: %s", qwen21_support())

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [KVOffloadSettings, KVMemoryMonitor]
