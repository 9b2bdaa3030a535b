"""The Settings node's widgets -> a validated `OffloadConfig`, and the message `validate_inputs` shows."""

from __future__ import annotations

from ..offload_core.config import Mode, OffloadConfig
from ..offload_core.places import MiB
from .run.reuse import ALWAYS

MODES = [m.value for m in Mode]
STORAGES = ["exact", "fp8", "int8"]


def _mib(name: str, value, zero: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a whole number of MiB >= 0; got {value!r}. Use 0 to {zero}.")
    return value * MiB


def config_from_inputs(mode, prefetch_depth=None, bypass_page_cache=None, pin_budget_mb=None,
                       vram_budget_mb=None, storage=None, ram_budget_mb=None) -> OffloadConfig:
    """The node's widgets -> a validated `OffloadConfig` (raises the engine's `ValueError`).

    A widget always holds a value, so options that do not apply to the picked mode are left out rather
    than rejected: prefetch depth and pin budget reach only the async modes and `auto`, the page-cache
    switch only the file modes and `auto`, the VRAM budget only the streaming modes and `auto`, the RAM budget
    (overflow to files) only the RAM modes and `auto`, the storage every mode but `off`. A budget of 0 leaves
    it to ComfyUI / the mode.
    """
    m = Mode.parse(mode)
    fields = {"mode": m}
    if m.takes_async_options and prefetch_depth is not None:
        fields["prefetch_depth"] = prefetch_depth
    if m.takes_file_options and bypass_page_cache is not None:
        fields["bypass_page_cache"] = bypass_page_cache
    if m.takes_async_options and pin_budget_mb is not None:
        if _mib("pin_budget_mb", pin_budget_mb, "leave the budget to ComfyUI"):
            fields["pin_budget"] = pin_budget_mb * MiB
    if vram_budget_mb is not None:
        budget = _mib("vram_budget_mb", vram_budget_mb, "let the mode decide")
        if budget and m.takes_device_budget:
            fields["device_budget"] = budget
    if ram_budget_mb is not None:
        budget = _mib("ram_budget_mb", ram_budget_mb, "let the mode decide")
        if budget and m.takes_host_budget:
            fields["host_budget"] = budget
    if storage is not None and m.takes_storage:
        fields["storage"] = storage
    return OffloadConfig(**fields)


def reuse_from_inputs(reuse, reuse_always) -> "bool | str":
    """The `reuse` and `reuse_always` widgets -> what `apply_offload` takes: False, True (reuse turns itself off
    where it does not pay) or `ALWAYS` (kept on whatever the measurement)."""
    return ALWAYS if reuse and reuse_always else bool(reuse)


def validation_message(**inputs) -> "bool | str":
    """True, or the engine's message for the first bad value (what `validate_inputs` returns).

    A linked input reaches validation as None (its value exists only at execution, where `execute` checks
    it): None options are left out, and with no mode yet there is nothing to check against.
    """
    if inputs.get("mode") is None:
        return True
    try:
        config_from_inputs(**inputs)
    except ValueError as e:
        return str(e)
    return True
