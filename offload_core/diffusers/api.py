"""`enable_kv_offload` / `disable_kv_offload` for diffusers pipelines with a prefix KV cache."""

from __future__ import annotations

import logging

import diffusers

from .. import HostServices, Mode
from ..reuse.registry import PrefixRegistry
from ..reuse.budget import parse_budget
from . import flux2, qwenimage21
from .keys import ours
from .pipeguard import CALLING, session_of
from .session import OffloadSession, make_config

logger = logging.getLogger(__name__)

SUPPORTED_DIFFUSERS = "0.42"


def check_diffusers_version(version: str) -> None:
    """Refuse diffusers versions whose cache internals this adapter was not written against."""
    parts = version.split(".")
    if ".".join(parts[:2]) != SUPPORTED_DIFFUSERS:
        raise RuntimeError(
            f"offload_core.diffusers supports diffusers {SUPPORTED_DIFFUSERS}.x (it hooks the KV-cache classes of "
            f"that release); found diffusers {version}. Install it with `pip install 'diffusers~={SUPPORTED_DIFFUSERS}.1'`."
        )


def _kind_of(pipe) -> str:
    from diffusers import Flux2KleinKVPipeline, QwenImage21Pipeline
    from diffusers.modular_pipelines.qwenimage21 import QwenImage21ModularPipeline

    if isinstance(pipe, (QwenImage21Pipeline, QwenImage21ModularPipeline)):
        return "qwenimage21"
    if isinstance(pipe, Flux2KleinKVPipeline):
        return "flux2"
    raise TypeError(
        f"enable_kv_offload supports QwenImage21Pipeline, the modular Qwen-Image 2.1 pipeline and "
        f"Flux2KleinKVPipeline; got {type(pipe).__name__}. Other pipelines have no prefix KV cache to offload."
    )


def enable_kv_offload(pipe, mode: Mode | str = "auto", *, host: HostServices | None = None,
                      reuse: bool | str = True, reuse_budget=None, **config_fields) -> OffloadSession:
    """Keep the pipeline's prefix K/V cache where `mode` puts it and bring each layer back when it is needed.

    Args:
        pipe: a `QwenImage21Pipeline`, a modular Qwen-Image 2.1 pipeline or a `Flux2KleinKVPipeline`.
        mode: any `Mode` value; `"gpu"` keeps today's placement but frees the cache before the VAE decodes.
            `"off"` recomputes the prefix every step (Qwen-Image 2.1 only).
        host: optional host services (pin budget, side stream, free-memory queries, temp dir).
        reuse: keep each completed prefix cache after the request (in the places it was made in, device slots
            freed) and serve a later request with the same prefix inputs from it, skipping the capture:
            FLUX.2 Klein KV when the references are the same (prompt and seed may change), Qwen-Image 2.1 when
            prompt, references and output size are the same (seed and step count may change). The key also
            covers the transformer's weights (LoRA load / fuse / unload, edits), dtype and device, and the code
            its forward can reach (`docs/reuse.md`). Where reading the model for the key costs more than a hit
            saves (measured on the first requests at each prefix size), reuse turns off there and says so;
            `"always"` keeps it on regardless.
        reuse_budget: bytes kept for reuse, for every place (an int) or per place (`{"device": ..., "host":
            ..., "file": ...}`); least recently used entries are evicted (closed: memory freed, files deleted).
            Default: nothing on the device (the VRAM goes back after every request), up to a quarter of the
            free RAM and of the free disk space.
        **config_fields: the other `OffloadConfig` fields (`prefetch_depth`, `file_dir`, `bypass_page_cache`,
            `pin_budget`, `device_budget`, `host_budget`, `storage`), validated before the pipeline is touched.

    Returns:
        The session; `session.last_stats` holds each store's `stats()` of the last finished call and
        `session.reuse.stats()` the hits, misses, bytes kept and evictions.
    Calling it again replaces the previous settings (and drops what was kept). Undo with `disable_kv_offload(pipe)`,
    which also closes every kept cache.
    """
    check_diffusers_version(diffusers.__version__)
    kind = _kind_of(pipe)
    config = make_config(mode, config_fields)
    budget = _check_reuse(reuse, reuse_budget)
    if kind == "flux2" and config.mode is Mode.OFF:
        raise ValueError(
            "`mode` 'off' is not available for Flux2KleinKVPipeline: after step 0 the pipeline no longer passes "
            "the reference tokens, so they cannot be recomputed. Use 'gpu' (or an offload mode), or run "
            "Flux2KleinPipeline for an uncached baseline."
        )
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:
        raise ValueError("enable_kv_offload needs the pipeline's `transformer`; load it first, then enable.")
    if session_of(pipe) is not None:
        disable_kv_offload(pipe)

    registry = PrefixRegistry(budget, name=type(pipe).__name__) if reuse and config.mode is not Mode.OFF else None
    session = OffloadSession(pipe, config, host, registry, always=reuse == "always")
    try:  # stopped anywhere (an error, Ctrl-C), the pipeline is given back as it was: it can be enabled again
        before, after = session.times.hooks(session.timing)
        if registry is not None:  # around the adapter's hooks: a call the adapter makes from its own is part of it
            session.add_hook(transformer.register_forward_pre_hook(ours(before), with_kwargs=True))
        (qwenimage21 if kind == "qwenimage21" else flux2).install(session, transformer)
        if registry is not None:
            session.add_hook(transformer.register_forward_hook(ours(after), with_kwargs=True))
        session.attach()
    except BaseException:
        session.detach()
        raise
    logger.info("KV offload enabled on %s: mode=%s, reuse %s", type(pipe).__name__, config.mode.value,
                "on" if registry is not None else "off")
    return session


def _check_reuse(reuse, reuse_budget) -> dict:
    if not isinstance(reuse, bool) and reuse != "always":
        raise ValueError(f"`reuse` must be True, False or 'always' (on even where a hit saves less than the key "
                         f"costs); got {reuse!r}.")
    if reuse_budget is not None and not reuse:
        raise ValueError(f"`reuse_budget` only applies with reuse=True; got reuse_budget={reuse_budget!r} with "
                         "reuse=False. Remove it, or turn reuse on.")
    return parse_budget(reuse_budget)


def disable_kv_offload(pipe) -> None:
    """Close any live store, remove every hook and guard, and give the pipeline back as it was. Idempotent.
    Called during the pipeline's own call (from `callback_on_step_end`), it takes effect when that call returns:
    the call's later steps still read its caches."""
    session = session_of(pipe)
    if session is None:
        return
    if getattr(CALLING, "session", None) is session:  # from inside the running call (a step callback)
        session.detach_after_call = True  # its later steps still read the caches: undone when the call ends
        logger.info("KV offload on %s is disabled when the running call returns", type(pipe).__name__)
        return
    session.detach()
    logger.info("KV offload disabled on %s", type(pipe).__name__)
