"""ComfyUI's compiler (0.34+, PR #15861): where the stores cannot stay out of its allocation graphs, it is turned
off for our run only.

The compiler records the device allocations of each block of a forward ("malloc graphs", package comfy-aimdo) and
replays them on later steps. The stores keep their buffers out of every graph by allocating under
`comfy.model_prefetch.pause_malloc_graph` (`host.pause_graph`). A ComfyUI with graphs but no pause has no such
escape, and comfy-aimdo before 0.5.3 fails a graph when memory made outside it is freed inside it (which the
stores do: a slot reused, a layer released). There the run sets `comfy.cli_args.args.disable_comfy_compiler`
for its own duration and says why, in the log (once a process) and in the readout (every such run).

No ComfyUI import at module level.
"""

from __future__ import annotations

import contextlib
import logging
from importlib import metadata
from typing import Callable, Optional, Tuple

from ...offload_core import passive

log = logging.getLogger(__name__)
_SAID: list = []  # the log says it once a process; the readout every run

FIXED_IN = (0, 5, 3)  # comfy-aimdo: a free of memory made outside a graph no longer fails the graph


def _version(text: str) -> Tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def aimdo_version() -> Optional[str]:
    try:
        return metadata.version("comfy-aimdo")
    except metadata.PackageNotFoundError:
        return None


def compiler_conflict() -> Optional[str]:
    """Why the stores cannot run under this ComfyUI's compiler; None where they can, or where it has none."""
    try:
        import comfy.model_prefetch as mp
    except ImportError:  # v0.33 and older: no compiler
        return None
    if not hasattr(mp, "malloc_graph_begin"):
        return None
    if not hasattr(mp, "pause_malloc_graph"):
        return ("this ComfyUI records each block's device allocations but has no pause_malloc_graph to keep the "
                "KV cache's buffers out of them")
    found = aimdo_version()
    if found is None or _version(found) < FIXED_IN:
        return (f"comfy-aimdo {found or '(version unknown)'} fails a graph when memory made outside it is freed "
                "inside it, which the KV cache does (fixed in comfy-aimdo 0.5.3)")
    return None


GRAPH_CALLS = ("malloc_graph_enabled", "malloc_graph_begin", "malloc_graph_end", "pause_malloc_graph",
               "prefetch_queue_pop", "make_prefetch_queue", "cleanup_prefetch_queues")


def graph_calls_are_passive() -> None:
    """ComfyUI's allocation-graph and weight-prefetch calls only record and move memory: declared passive, so
    a prefix reuse key does not follow the per-thread state they keep (it changes every run, a miss each time)."""
    try:
        import comfy.model_prefetch as mp
    except ImportError:
        return
    for name in GRAPH_CALLS:
        fn = getattr(mp, name, None)
        if fn is not None:
            passive(fn)


@contextlib.contextmanager
def compiler_for_run(note: Callable[[str], None]):
    """The run's body: with ComfyUI's compiler turned off for its duration where `compiler_conflict` says so,
    restored however the run ends; `note(text)` tells the readout."""
    graph_calls_are_passive()
    why = compiler_conflict()
    args = _cli_args() if why is not None else None
    if args is None or getattr(args, "disable_comfy_compiler", True):  # no conflict, or already off
        yield
        return
    text = (f"ComfyUI's compiler is off for this run: {why}. To keep it on, update ComfyUI and "
            "`pip install -U 'comfy-aimdo>=0.5.3'`.")
    if not _SAID:
        _SAID.append(text)
        log.warning("KV Offload: %s", text)
    note(text)
    args.disable_comfy_compiler = True
    try:
        yield
    finally:
        args.disable_comfy_compiler = False


def _cli_args():
    try:
        from comfy.cli_args import args
    except ImportError:
        return None
    return args
