"""The *KV Memory Monitor* node: a place on the canvas for the live memory readout.

Design choice: the node has no inputs, no outputs and is not an output node. ComfyUI only executes output
nodes and what they depend on, so the monitor never runs, never enters the execution cache and never changes
a result; it can sit anywhere in any graph, wired to nothing. What it shows comes from the server's
`kv_offload.memory` pushes during a run and from `GET /kv_offload/stats` when the page loads (see
`web/kv_offload.js`): memory is process- and device-wide state, not a value that flows along links, and a
MODEL passthrough would have tied the readout to one branch of the graph for no gain.

Importable without ComfyUI (the pack's tests do): the node class exists only where `comfy_api` does.
"""

from __future__ import annotations

NODE_ID = "KVMemoryMonitor"
DISPLAY_NAME = "KV Memory Monitor"
CATEGORY = "kv_offload"
DESCRIPTION = (
    "Live readout of device memory, process RSS, system RAM and swap, and of every KV cache store in use: "
    "the mode in effect (and why), bytes per place, bytes on the device, transfer bandwidth and "
    "the time sampling waited for the cache. Updated during runs (at most 4 times a second) and once at "
    "the end; nothing is sent while idle. Needs no wires: it is a display and never executes."
)

try:
    from comfy_api.latest import io
except ImportError:  # tests and the engine import the pack without ComfyUI
    io = None


if io is not None:

    class KVMemoryMonitor(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> "io.Schema":
            return io.Schema(
                node_id=NODE_ID,
                display_name=DISPLAY_NAME,
                category=CATEGORY,
                description=DESCRIPTION,
                inputs=[],
                outputs=[],
            )

        @classmethod
        def execute(cls) -> "io.NodeOutput":
            return io.NodeOutput()  # never scheduled: not an output node and nothing depends on it
