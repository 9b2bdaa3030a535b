"""The graphs the ComfyUI suites queue: a tiny FLUX.2 (or Qwen-Image) through the pack's node to `SaveLatent`, and
whether KSampler really ran in a prompt."""

from __future__ import annotations

LOSSLESS = ["ram_sync", "ram_async", "file_sync", "file_async", "auto"]

_seq = iter(range(1, 1 << 30))


def _cache_nodes(graph: dict, model_ref: list, mode, flux_kv) -> list:
    """Insert FluxKVCache before/after KVOffloadSettings as asked; return the final model link."""
    if flux_kv == "before":
        graph["fluxkv"] = {"class_type": "FluxKVCache", "inputs": {"model": model_ref}}
        model_ref = ["fluxkv", 0]
    if mode is not None:
        graph["kvo"] = {"class_type": "KVOffloadSettings",
                        "inputs": {"model": model_ref, "mode": mode, "prefetch_depth": 1,
                                   "bypass_page_cache": True, "pin_budget_mb": 0}}
        model_ref = ["kvo", 0]
    if flux_kv in ("only", "after"):
        graph["fluxkv"] = {"class_type": "FluxKVCache", "inputs": {"model": model_ref}}
        model_ref = ["fluxkv", 0]
    return model_ref


def graph(model: str = "flux2", mode=None, flux_kv=None, cfg: float = 1.0, steps: int = 4, ref_seed: int = 2,
          seed: int = 7, size: int = 4, max_gpus: int = 0) -> dict:
    """UNETLoader / tiny Qwen-Image -> [FluxKVCache] -> [KVOffloadSettings] -> [MultiGPU CFG Split] -> KSampler ->
    SaveLatent (`max_gpus` 0: no MultiGPU CFG Split)."""
    flux = model == "flux2"
    g = {"model": ({"class_type": "UNETLoader",
                    "inputs": {"unet_name": "tiny_flux2.safetensors", "weight_dtype": "default"}} if flux else
                   {"class_type": "KVOffloadTestTinyQwenImage", "inputs": {"seed": 0}})}
    model_ref = _cache_nodes(g, ["model", 0], mode, flux_kv)
    if max_gpus:
        g["multigpu"] = {"class_type": "MultiGPU_WorkUnits", "inputs": {"model": model_ref, "max_gpus": max_gpus}}
        model_ref = ["multigpu", 0]
    channels, frames, side = (128, 0, size) if flux else (16, 1, 2 * size)
    g["text"] = {"class_type": "KVOffloadTestConditioning", "inputs": {"seed": 1, "tokens": 8, "dim": 64}}
    g["ref"] = {"class_type": "KVOffloadTestLatent",
                "inputs": {"seed": ref_seed, "channels": channels, "height": side, "width": side, "frames": frames}}
    g["pos"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["text", 0], "latent": ["ref", 0]}}
    # the negative keeps the reference latents: with CFG, cond and uncond are batched into one forward
    g["neg"] = {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["pos", 0]}}
    g["start"] = {"class_type": "KVOffloadTestLatent",
                  "inputs": {"seed": 3, "channels": channels, "height": side, "width": side, "frames": frames}}
    g["sampler"] = {"class_type": "KSampler",
                    "inputs": {"model": model_ref, "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler",
                               "scheduler": "simple", "positive": ["pos", 0], "negative": ["neg", 0],
                               "latent_image": ["start", 0], "denoise": 1.0}}
    g["save"] = {"class_type": "SaveLatent",
                 "inputs": {"samples": ["sampler", 0], "filename_prefix": f"kvo/run{next(_seq):05d}"}}
    return g


def sampled(entry: dict) -> bool:
    """True when KSampler really ran in this prompt (was not served from the execution cache)."""
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_cached" and "sampler" in data.get("nodes", []):
            return False
    return True
