"""HTTP side of the memory readout: `GET /kv_offload/stats` and the hub's sender.

Called once by the extension's `on_load`, inside ComfyUI. The route only reads the hub's latest payload
(it never builds or pushes one, so polling it cannot make the server talk); ComfyUI mirrors it under `/api`.
"""

from __future__ import annotations

import logging

from .telemetry import TELEMETRY

log = logging.getLogger(__name__)

ROUTE = "/kv_offload/stats"


def register_routes(hub=TELEMETRY) -> None:
    """Add the read-only stats route and let `hub` push through the server's thread-safe `send_sync`."""
    from aiohttp import web
    from server import PromptServer

    server = PromptServer.instance
    hub.set_sender(server.send_sync)
    hub.set_device(_comfy_device())

    @server.routes.get(ROUTE)
    async def kv_offload_stats(request):  # noqa: ARG001 - aiohttp handler signature
        return web.json_response(hub.snapshot(), headers={"Cache-Control": "no-store"})


def _comfy_device():
    """ComfyUI's compute device, so the readout reports the device that runs the model (None if unknown)."""
    try:
        import comfy.model_management as mm

        return mm.get_torch_device()
    except Exception as exc:  # the readout works without it, on the engine's default device
        log.warning("KV Offload: could not read ComfyUI's torch device (%s: %s); the memory readout reports the "
                    "engine's default device instead", type(exc).__name__, exc)
        return None
