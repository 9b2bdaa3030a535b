"""ComfyUI's services, handed to the engine as `HostServices` (imported only when ComfyUI runs us).

- free device memory: the sampling patcher's `get_free_memory` (it counts DynamicVRAM), else
  `model_management.get_free_memory`; this is what `auto` sizes against.
- pinning: `ensure_pin_budget` first (the pinned-memory budget is shared with model weights), then
  `pin_memory` / `unpin_memory`, so ComfyUI accounts for every page we lock. On `--cpu` and Apple
  `pin_memory` refuses and the engine degrades to pageable memory.
- streams: ComfyUI's offload stream pool (`get_offload_stream`), shared with weight casting; none on CPU.
- allocations: ComfyUI 0.34+ records each block's device allocations and replays them (its compiler, "malloc
  graphs"); the stores allocate under its `pause_malloc_graph`, so none of their buffers belongs to a block.
- files: a private directory per run (`RunDir`: random name, mode 0700) in a `kv_offload_cache` folder beside
  ComfyUI's temp directory -- the same disk, but outside the temp, output and input folders that ComfyUI's
  `/view` serves to any client, so no client can download the cache even if it learns a path. Each run's
  directory is locked by its process for the run's life (`OwnedDir`); it is removed when the run closes, the
  folder when it is empty, and the directories of processes that died (crash, SIGKILL) by the next run or
  pack load of any ComfyUI sharing the folder -- never those of a live one (two ComfyUIs started from the
  same install, one per GPU, share it). No path from a graph is ever used.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

from ...offload_core import HostServices
from ...offload_core.tiers.file.fileowner import OwnedDir, reclaim

log = logging.getLogger(__name__)

CACHE_DIR = "kv_offload_cache"
SERVED = ("temp", "output", "input")  # the directory types ComfyUI's /view serves


def _inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return os.path.commonpath((path, parent)) == parent


def cache_root() -> str:
    """The folder that holds the runs' private directories (not created here)."""
    import folder_paths

    root = os.path.join(os.path.dirname(os.path.abspath(folder_paths.get_temp_directory())), CACHE_DIR)
    served = [folder_paths.get_directory_by_type(t) for t in SERVED]
    if any(d and _inside(root, d) for d in served):  # e.g. an output directory set to ComfyUI's base folder
        root = os.path.join(tempfile.gettempdir(), CACHE_DIR)
    return root


class RunDir:
    """`HostServices.temp_dir` of one run: its private directory, made on first use; `cleanup()` removes it.

    `RunState.close()` calls `cleanup()` after every store has closed (each deleted its own files already).
    """

    def __init__(self, root=cache_root):
        self._root = root
        self._lock = threading.Lock()  # the file stores of cond and uncond may ask at once
        self._owned = None

    @property
    def path(self):
        return self._owned.path if self._owned is not None else None

    def __call__(self) -> str:
        with self._lock:
            if self._owned is None:
                root = self._root()
                for _ in range(3):  # another process may remove the shared folder the moment it empties
                    try:
                        self._owned = OwnedDir(_make_root(root), "run-")  # reclaims dead processes' runs first
                        break
                    except FileNotFoundError:
                        continue
                else:
                    self._owned = OwnedDir(_make_root(root), "run-")
            return self._owned.path

    def cleanup(self) -> None:
        with self._lock:
            owned, self._owned = self._owned, None
        if owned is None:
            return
        owned.delete()  # logs whatever cannot be deleted, with the reason
        try:
            os.rmdir(os.path.dirname(owned.path))  # the shared folder goes too once no run uses it
        except OSError:
            pass


def _make_root(root: str) -> str:
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
    except OSError:  # ComfyUI's folder is read-only here: the OS temp dir is not served either
        root = os.path.join(tempfile.gettempdir(), CACHE_DIR)
        os.makedirs(root, mode=0o700, exist_ok=True)
    return root


def reclaim_leftovers() -> None:
    """Remove the run directories of processes that are gone (called once when the pack loads).

    Only directories whose owner's lock is free: a second ComfyUI using the same folder keeps its live cache.
    """
    try:
        root = cache_root()
    except Exception as exc:  # the pack loads anyway; a file mode's run asks for the folder again
        log.warning("KV Offload: could not find the cache folder at load (%s: %s); what ended processes left "
                    "in it is removed when a file mode's run next makes its directory there",
                    type(exc).__name__, exc)
        return
    if os.path.isdir(root):
        reclaim(root, "run-")


_WARNED_QUERIES: set = set()  # the free-memory queries whose failure was said, once a process each


def _query_failed(what: str, exc: Exception) -> None:
    """A failed free-memory query changes the plan (`auto` counts that memory as unknown, so it keeps nothing
    resident there): said once at WARNING, with the reason, not buried at DEBUG."""
    if what not in _WARNED_QUERIES:
        _WARNED_QUERIES.add(what)
        log.warning("KV offload: ComfyUI's free-memory query for %s failed (%s: %s); mode auto plans as if that "
                    "figure were unknown (nothing kept there on its account) until it answers again.", what,
                    type(exc).__name__, exc)
    log.debug("free-memory query for %s failed", what, exc_info=True)


def comfy_host_services(patcher=None) -> HostServices:
    import comfy.model_management as mm

    def free_device_memory(device):
        try:
            if patcher is not None and hasattr(patcher, "get_free_memory"):
                return int(patcher.get_free_memory(device))
            return int(mm.get_free_memory(device))
        except Exception as exc:  # the plan goes on without the figure: said once (`_query_failed`)
            _query_failed(str(device), exc)
            return None

    def free_host_memory():
        try:
            import torch

            return int(mm.get_free_memory(torch.device("cpu")))
        except Exception as exc:
            _query_failed("the host's RAM", exc)
            return None

    def pin(tensor) -> bool:
        budget = getattr(mm, "ensure_pin_budget", None)
        # never by evicting the pins of the model that is sampling (ComfyUI's own prefix cache asks the same way)
        if budget is not None and not budget(tensor.nbytes, evict_active=False):
            return False
        return bool(mm.pin_memory(tensor))

    def unpin(tensor):
        return mm.unpin_memory(tensor)

    def stream(device):
        if getattr(device, "type", None) not in ("cuda", "xpu"):
            return None
        return mm.get_offload_stream(device)

    return HostServices(free_device_memory=free_device_memory, free_host_memory=free_host_memory,
                        pin=pin, unpin=unpin, stream=stream, temp_dir=RunDir(), pause_graph=pause_graph())


def pause_graph():
    """ComfyUI's `pause_malloc_graph` (0.34+: its compiler records each block's device allocations), else None."""
    try:
        import comfy.model_prefetch as mp
    except ImportError:  # v0.33: no compiler
        return None
    return getattr(mp, "pause_malloc_graph", None)
