"""The one configuration object of the engine, validated once before anything is allocated.

`OffloadConfig` is a frozen dataclass; `Mode` is a `str` Enum so every mode also works as a plain string.
Every bad value or meaningless combination raises `ValueError` naming the option, the value, the rule and
the fix. Host services (free-memory queries, pinning, streams, temp dir) are not configuration: they enter
through `HostServices`, as plain callables.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch

from .tiers.file.filecheck import check_file_options

MAX_PREFETCH_DEPTH = 8  # more layers in flight only re-creates the device cache we are trying to avoid


class Mode(str, enum.Enum):
    AUTO = "auto"
    OFF = "off"
    GPU = "gpu"
    RAM_SYNC = "ram_sync"
    RAM_ASYNC = "ram_async"
    FILE_SYNC = "file_sync"
    FILE_ASYNC = "file_async"

    def __str__(self) -> str:
        return self.value

    @property
    def is_async(self) -> bool:
        return self in (Mode.RAM_ASYNC, Mode.FILE_ASYNC)

    @property
    def is_file(self) -> bool:
        return self in (Mode.FILE_SYNC, Mode.FILE_ASYNC)

    @property
    def is_ram(self) -> bool:
        return self in (Mode.RAM_SYNC, Mode.RAM_ASYNC)

    @property
    def takes_async_options(self) -> bool:
        """`prefetch_depth` and `pin_budget` mean something: an async mode, or `auto` (which may pick one)."""
        return self.is_async or self is Mode.AUTO

    @property
    def takes_file_options(self) -> bool:
        """`file_dir` and `bypass_page_cache` mean something: a file mode, or `auto` (which may pick one)."""
        return self.is_file or self is Mode.AUTO

    @property
    def takes_device_budget(self) -> bool:
        """`device_budget` means something: a mode that streams layers (it keeps some resident), or `auto`."""
        return self.is_ram or self.is_file or self is Mode.AUTO

    @property
    def takes_host_budget(self) -> bool:
        """`host_budget` means something: a mode that keeps layers in RAM (the rest spill to files), or `auto`."""
        return self.is_ram or self is Mode.AUTO

    @property
    def takes_storage(self) -> bool:
        """`storage` means something wherever a cache is kept: every mode but `off`."""
        return self is not Mode.OFF

    @classmethod
    def parse(cls, value: "Mode | str") -> "Mode":
        if isinstance(value, Mode):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"`mode` must be one of {choices}; got {value!r}. Pick one of those names.")


@dataclass(frozen=True)
class OffloadConfig:
    """What to do with a prefix KV cache.

    Args:
        mode: where the cache lives between uses (see `Mode`); `auto` picks from free memory at first `put`.
        prefetch_depth: layers copied ahead of the consumer (async modes only; default 1, at most 8).
        file_dir: existing writable directory for the file modes; default a fresh private temp directory
            that is deleted on close.
        bypass_page_cache: file modes only (default True): read with O_DIRECT where the filesystem allows it,
            else drop written and read pages with posix_fadvise, so a file mode really saves RAM.
        pin_budget: bytes of page-locked host memory this store may pin (async modes only), inside the one
            budget every store of the process shares: the host pinning service's (ComfyUI's), else a quarter of
            the physical RAM (`hostmem.process_pin_budget()`). Default: no cap of its own.
        device_budget: bytes of the cache (as kept) a store may hold resident on the device; whole layers up
            to it stay there, the rest stream from the mode's place (None: the mode decides).
            Streaming modes and `auto` only. Budgets are per store, i.e. per cached prefix and CFG branch.
        host_budget: bytes of host RAM a store may hold its layers in; beyond it layers spill to files (None:
            no cap). RAM modes and `auto` only.
        storage: how the bytes are kept: "exact" (default, lossless), "fp8" (float8 e4m3) or "int8", both
            with one scale per token and head, about half the bytes of a bf16/fp16 cache, everywhere the
            cache is kept (the device included). `get` always returns the dtype that was put.
        dedup: keep a layer whose batch rows are bit-identical (a batch from one prompt and one set of
            references) as one row, in every place, and broadcast it back at `get` (None: on). False skips
            the check (one comparison of each layer on the device at `put`).
    """

    mode: "Mode | str" = Mode.AUTO
    prefetch_depth: Optional[int] = None
    file_dir: Optional[str] = None
    bypass_page_cache: Optional[bool] = None
    pin_budget: Optional[int] = None
    device_budget: Optional[int] = None
    host_budget: Optional[int] = None
    storage: str = "exact"
    dedup: Optional[bool] = None

    def __post_init__(self) -> None:
        mode = Mode.parse(self.mode)
        object.__setattr__(self, "mode", mode)
        _check_prefetch_depth(mode, self.prefetch_depth)
        _check_budget("device_budget", mode, self.device_budget, mode.takes_device_budget,
                      "'ram_sync', 'ram_async', 'file_sync', 'file_async' and 'auto' (in 'gpu' every layer is "
                      "resident already)", "pick a streaming mode or 'auto'")
        _check_budget("host_budget", mode, self.host_budget, mode.takes_host_budget,
                      "'ram_sync', 'ram_async' and 'auto' (the modes that keep layers in RAM)",
                      "pick 'ram_async' or 'auto'")
        spills = mode.is_ram and self.host_budget is not None  # overflow beyond the host budget goes to files
        check_file_options(mode, self.file_dir, self.bypass_page_cache, spills)
        _check_pin_budget(mode, self.pin_budget)
        object.__setattr__(self, "storage", _check_storage(mode, self.storage))
        _check_dedup(mode, self.dedup)

    @property
    def depth(self) -> int:
        """Layers in flight ahead of the consumer; 0 for the modes that never prefetch."""
        if self.prefetch_depth is not None:
            return self.prefetch_depth
        return 1 if self.mode.takes_async_options else 0

    @property
    def dedups(self) -> bool:
        """Whether stores keep layers with identical batch rows as one row (`dedup.py`)."""
        return self.dedup is not False

    @property
    def bypass(self) -> bool:
        return True if self.bypass_page_cache is None else self.bypass_page_cache


def _check_prefetch_depth(mode: Mode, depth: Optional[int]) -> None:
    if depth is None:
        return
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise ValueError(f"`prefetch_depth` must be an int; got {depth!r} ({type(depth).__name__}). Pass e.g. 1.")
    if not mode.takes_async_options:
        raise ValueError(
            f"`prefetch_depth` only applies to the async modes ('ram_async', 'file_async') and 'auto'; got "
            f"prefetch_depth={depth} with mode {mode.value!r}. Remove it, or pick an async mode."
        )
    if not 1 <= depth <= MAX_PREFETCH_DEPTH:
        raise ValueError(
            f"`prefetch_depth` must be between 1 and {MAX_PREFETCH_DEPTH} for mode {mode.value!r}; got {depth}. "
            "1 hides a transfer behind one layer of compute; deeper only holds more of the cache on the device."
        )


def _check_budget(name: str, mode: Mode, budget: Optional[int], applies: bool, modes: str, fix: str) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"`{name}` must be a number of bytes >= 0 (or None: the mode decides); got {budget!r}. "
                         "Pass e.g. 2 << 30 for 2 GiB.")
    if not applies:
        raise ValueError(f"`{name}` only applies to {modes}; got {name}={budget} with mode {mode.value!r}. "
                         f"Remove it, or {fix}.")


STORAGES = ("exact", "fp8", "int8")


def _check_storage(mode: Mode, storage) -> str:
    value = storage.strip().lower() if isinstance(storage, str) else storage
    if value not in STORAGES:
        raise ValueError(f"`storage` must be one of {', '.join(map(repr, STORAGES))}; got {storage!r}. "
                         "'exact' keeps the cache lossless; 'fp8' / 'int8' keep about half the bytes.")
    if value != "exact" and not mode.takes_storage:
        raise ValueError(f"`storage` {value!r} only applies where a cache is kept; mode 'off' keeps none. "
                         "Remove it, or pick another mode.")
    if value == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"`storage` 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks. "
                         "Use storage='int8', or upgrade torch.")
    return value


def _check_dedup(mode: Mode, dedup) -> None:
    if dedup is not None and not isinstance(dedup, bool):
        raise ValueError(f"`dedup` must be True or False (or None: on); got {dedup!r}. Pass dedup=False to turn "
                         "the check for identical batch rows off.")
    if dedup is not None and mode is Mode.OFF:
        raise ValueError(f"`dedup` only applies where a cache is kept; mode 'off' keeps none (got dedup={dedup}). "
                         "Remove it, or pick another mode.")


def _check_pin_budget(mode: Mode, budget: Optional[int]) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"`pin_budget` must be a number of bytes >= 0; got {budget!r}. Pass e.g. 8 << 30.")
    if not mode.takes_async_options:
        raise ValueError(
            f"`pin_budget` only applies to the async modes; got pin_budget={budget} with mode {mode.value!r}. "
            "Remove it, or pick 'ram_async' / 'file_async'."
        )


@dataclass(frozen=True)
class HostServices:
    """Services of the host application (ComfyUI, a server) the engine cooperates with; all optional.

    free_device_memory(device) -> bytes free for new tensors on `device` (None: unknown).
    free_host_memory() -> bytes of RAM available (None: unknown).
    pin(tensor) -> bool: page-lock an existing CPU tensor in place within the host's budget; False: refused.
    unpin(tensor): undo `pin`. Called once for every tensor `pin` accepted, before it is freed.
    stream(device) -> a side stream for copies (None: the engine creates its own).
    temp_dir() -> directory under which a file tier creates its private temp directory.
    pause_graph() -> a context manager inside which the host does not record this thread's device allocations
        (ComfyUI's `pause_malloc_graph`: its compiler records each block's allocations and replays them). Every
        `put` and `get` runs inside it, so no buffer of the store belongs to a block, whichever block asked.
    """

    free_device_memory: Optional[Callable[[torch.device], Optional[int]]] = None
    free_host_memory: Optional[Callable[[], Optional[int]]] = None
    pin: Optional[Callable[[torch.Tensor], bool]] = None
    unpin: Optional[Callable[[torch.Tensor], object]] = None
    stream: Optional[Callable[[torch.device], object]] = None
    temp_dir: Optional[Callable[[], str]] = None
    pause_graph: Optional[Callable[[], ContextManager]] = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not callable(value):
                raise ValueError(
                    f"HostServices: `{field.name}` must be a callable or None; got {value!r} "
                    f"({type(value).__name__}). Pass a function, e.g. {field.name}={_EXAMPLES[field.name]}.")
        if (self.pin is None) != (self.unpin is None):
            raise ValueError("HostServices: `pin` and `unpin` come as a pair; got only one of them. Pass both or neither.")


_EXAMPLES = {
    "free_device_memory": "lambda device: torch.cuda.mem_get_info(device)[0]",
    "free_host_memory": "lambda: psutil.virtual_memory().available",
    "pin": "lambda tensor: False", "unpin": "lambda tensor: None",
    "stream": "lambda device: None", "temp_dir": "tempfile.gettempdir",
    "pause_graph": "contextlib.nullcontext",
}
