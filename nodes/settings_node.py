"""The *KV Offload Settings* node: MODEL in, a patched clone out (V3 node API)."""

from __future__ import annotations

from comfy_api.latest import io

from ..offload_core.config import MAX_PREFETCH_DEPTH
from .apply import apply_offload
from .run.host import comfy_host_services
from .inputs import MODES, STORAGES, config_from_inputs, reuse_from_inputs, validation_message
from .families.qwen21 import qwen21_support
from .readout.telemetry import TELEMETRY

MODE_TOOLTIP = (
    "Where the reference-image K/V cache lives between denoising steps. "
    "auto: the fastest places that the free VRAM / RAM / pinned budget hold now, layer by layer. "
    "off: no cache, the prefix is recomputed every step (AR video: ComfyUI's own cache, on the GPU). "
    "gpu: in VRAM (same as ComfyUI's Flux KV Cache). "
    "ram_sync / ram_async: host RAM, copied back layer by layer (async: pinned, prefetched behind compute). "
    "file_sync / file_async: files in a private folder beside ComfyUI's temp folder, deleted after the run "
    "(async: read ahead of compute). "
    "Every mode except off gives the same latents as gpu (with storage exact)."
)

TOOLTIPS = {
    "prefetch_depth": "Layers copied ahead of the one being computed (ram_async, file_async, auto). 1 hides a copy "
                      "behind one layer of compute; more holds more of the cache in VRAM. Ignored by the other modes.",
    "bypass_page_cache": "File modes: keep the OS page cache out of the way (O_DIRECT where the filesystem allows), "
                         "so a file mode really saves RAM. Ignored by the other modes.",
    "pin_budget_mb": "ram_async / file_async / auto: most page-locked host memory (MiB) the cache may pin. 0 leaves "
                     "it to ComfyUI's pinned-memory budget. Beyond it the cache uses pageable memory (slower, never "
                     "fails).",
    "vram_budget_mb": "Speed-VRAM dial: up to this many MiB of each cache (cond and uncond each) stay in VRAM and the "
                      "rest streams from the mode's place (Wan Animate 2: the whole pose cache; 0: the mode decides; "
                      "ignored by gpu and off).",
    "storage": "exact keeps the cache lossless; fp8 / int8 keep about half the VRAM, RAM, disk and copy time for a "
               "small, measured error in the image (every mode but off).",
    "reuse": "Keep the prefix K/V in RAM or files after the run and reuse it when the same prompt, references and "
             "size come again, so a new seed skips the fill pass (exact only for Qwen-Image 2.1; off for the others).",
    "reuse_always": "Keep prefix reuse on even where it does not pay. Off: after two runs in a row where reading the "
                    "model for the reuse key cost more than a hit would save (a small model, or weights that are slow "
                    "to read), reuse turns itself off for that model and prefix size, with a warning.",
    "ram_budget_mb": "ram_sync / ram_async / auto: most host RAM (MiB) each cache may keep; the rest goes to files "
                     "instead of being dropped (Wan Animate 2: the whole pose cache, all context windows together). "
                     "0: no cap of its own.",
}
MAX_BUDGET_MB = 1 << 24


def _budget(name: str, **flags) -> "io.Int.Input":
    """A budget widget in MiB; 0 leaves the budget to ComfyUI or the mode."""
    return io.Int.Input(name, default=0, min=0, max=MAX_BUDGET_MB, tooltip=TOOLTIPS[name], **flags)


class KVOffloadSettings(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KVOffloadSettings",
            display_name="KV Offload Settings",
            category="kv_offload",
            description="Moves the reference-image attention K/V cache of FLUX.2 Klein KV, Qwen-Image, "
                        "Qwen-Image-Edit and Qwen-Image 2.1, Wan Animate 2's pose cache and the KV cache of ComfyUI's "
                        "autoregressive video sampler (Causal-WAN), out of VRAM "
                        "and brings each layer back just before it is needed. " + qwen21_support(),
            inputs=[
                io.Model.Input("model", tooltip="A FLUX.2 Klein KV, Qwen-Image(-Edit), Qwen-Image 2.1, Wan Animate 2 or "
                               "Causal-WAN (AR video) model."),
                io.Combo.Input("mode", options=MODES, default="auto", tooltip=MODE_TOOLTIP),
                io.Int.Input("prefetch_depth", default=1, min=1, max=MAX_PREFETCH_DEPTH,
                             tooltip=TOOLTIPS["prefetch_depth"]),
                io.Boolean.Input("bypass_page_cache", default=True, advanced=True,
                                 tooltip=TOOLTIPS["bypass_page_cache"]),
                _budget("pin_budget_mb", advanced=True),
                # Optional: prompts and workflows saved before these inputs existed still validate.
                _budget("vram_budget_mb", optional=True),
                io.Combo.Input("storage", options=STORAGES, default="exact", optional=True,
                               tooltip=TOOLTIPS["storage"]),
                io.Boolean.Input("reuse", default=True, optional=True, tooltip=TOOLTIPS["reuse"]),
                # After `reuse`: saved workflows list widget values by position, so a new input goes last.
                _budget("ram_budget_mb", optional=True),
                io.Boolean.Input("reuse_always", default=False, optional=True, advanced=True,
                                 tooltip=TOOLTIPS["reuse_always"]),
            ],
            outputs=[io.Model.Output(tooltip="The model with the chosen KV cache mode.")],
            hidden=[io.Hidden.unique_id],  # the memory readout shows this node's own run
        )

    @classmethod
    def validate_inputs(cls, mode) -> bool | str:
        # ComfyUI attaches this message to every argument taken here, so it takes only `mode`; the numbers
        # are range-checked by ComfyUI against their min/max (each error on its own input), and `execute`
        # checks every value again through the engine.
        return validation_message(mode=mode)

    @classmethod
    def execute(cls, model, mode, prefetch_depth, bypass_page_cache, pin_budget_mb, vram_budget_mb=0,
                storage="exact", reuse=True, ram_budget_mb=0, reuse_always=False) -> io.NodeOutput:
        config = config_from_inputs(mode, prefetch_depth, bypass_page_cache, pin_budget_mb, vram_budget_mb, storage,
                                    ram_budget_mb)
        # the readout tags this node's runs with its id, so the node shows its own run
        telemetry = TELEMETRY.for_node(cls.hidden.unique_id) if cls.hidden else TELEMETRY
        patched, _ = apply_offload(model, config, host=comfy_host_services, telemetry=telemetry,
                                   reuse=reuse_from_inputs(reuse, reuse_always))
        return io.NodeOutput(patched)
