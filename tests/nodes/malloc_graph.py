"""SimMallocGraph: a CPU model of ComfyUI's compiler ("malloc graphs", ComfyUI 0.34+ with comfy-aimdo >= 0.5.3), so
that a tensor kept past its block fails a CPU test as it fails ComfyUI on a GPU.

It stands in for `comfy.model_prefetch` as read from ComfyUI 0.38.1 (`malloc_graph_enabled`, `malloc_graph_begin`,
`malloc_graph_end`, `pause_malloc_graph`, `prefetch_queue_pop` without a prefetch queue, as on a CPU, with
`malloc_scope="block"`, `make_prefetch_queue`, `cleanup_prefetch_queues`) and models the rules of comfy-aimdo's
native graph (its `malloc_graph.py`: one graph per thread, a push at each begin, a named scope per block):

- Recorded: the tensors a torch op makes on the graph's thread while the graph is active and not paused (a
  `TorchDispatchMode` sees every op; its mode stack is per thread, so the engine's I/O threads are not seen, as a
  side stream is not). Memory from outside torch's allocator (the engine's host buffers: an anonymous mapping seen
  through `torch.frombuffer`) is host memory and never recorded, as pinned memory is not on a GPU.
- A recorded tensor still alive when its scope ends (the next `iterate`, the `end`) is a rogue: counted.
- A rogue freed while the graph exists marks it failed, and the next push, pop or scope switch raises
  `RuntimeError("aimdo memory compile error")`, as comfy-aimdo does.
- Each scope's allocations (their sizes, in order) are compared with the same scope of the thread's previous
  forward: any difference is a graph break, counted per forward (`breaks`).
- Inside `pause_malloc_graph()` nothing is recorded, allocated or freed.

Frees are seen when they are looked for: at every allocation, scope switch, pause and resume, so each is placed
between the same two events as it happened.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from offload_core import passive


GRAPH_CALLS = ("malloc_graph_enabled", "malloc_graph_begin", "malloc_graph_end", "pause_malloc_graph",
               "prefetch_queue_pop", "make_prefetch_queue", "cleanup_prefetch_queues")


class _Alloc:
    __slots__ = ("ref", "nbytes", "rogue")

    def __init__(self, ref, nbytes):
        self.ref, self.nbytes, self.rogue = ref, nbytes, False


class Graph:
    """One thread's graph: the levels open (each a list of its allocations) and the previous forward's scopes."""

    def __init__(self):
        self.active, self.paused = False, 0
        self.levels: list = []  # open levels, innermost last: [name, [allocations]]
        self.live: dict = {}  # storage id -> _Alloc, every recorded allocation not yet seen freed
        self.failed = None  # why the graph failed; raised at the next push, pop or scope switch
        self.failures = self.rogues = 0
        self.scopes, self.last = [], None  # this forward's scope signatures; the previous forward's
        self.breaks: list = []  # per forward: scopes that differ from the previous forward's

    def sweep(self) -> None:
        """Notes every recorded tensor freed since the last sweep."""
        for key, a in list(self.live.items()):
            if a.ref.expired():
                del self.live[key]
                if a.rogue and not self.paused and self.failed is None:
                    self.failures += 1
                    self.failed = f"a rogue of {a.nbytes} bytes was freed before the graph ended"

    def check(self) -> None:
        self.sweep()
        if self.failed is not None:
            raise RuntimeError(f"aimdo memory compile error ({self.failed})")

    def push(self, name) -> None:
        self.check()
        self.levels.append([name, []])

    def pop(self) -> None:
        self.check()
        name, allocs = self.levels.pop()
        for a in allocs:
            if not a.ref.expired() and not a.rogue:
                a.rogue = True
                self.rogues += 1
        self.scopes.append((name, [a.nbytes for a in allocs]))
        if not self.levels:  # the forward ends: compare its scopes with the previous forward's (the first records)
            last = self.last if self.last is not None else self.scopes
            self.breaks.append(sum(1 for i, s in enumerate(self.scopes) if i >= len(last) or last[i] != s))
            self.last, self.scopes = self.scopes, []

    def record(self, t: torch.Tensor, inputs: set) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in inputs or storage.nbytes() == 0:
            return
        self.sweep()  # a storage freed since may have left its address to this one
        if key not in self.live:
            a = self.live[key] = _Alloc(StorageWeakRef(storage), storage.nbytes())
            self.levels[-1][1].append(a)


class _Recorder(TorchDispatchMode):
    def __init__(self, sim: "SimMallocGraph"):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        graph = self.sim.graphs.get(threading.get_ident())
        if graph is not None and graph.active and not graph.paused and graph.levels:
            flat_in, _ = tree_flatten((args, kwargs))
            inputs = {t.untyped_storage()._cdata for t in flat_in if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == self.sim.device_type:
                    graph.record(t, inputs)
        return out


class SimMallocGraph:
    """`comfy.model_prefetch` with the rules above; `install(monkeypatch)` puts it (and a `comfy` package) in
    `sys.modules`. `with sim.recording():` around the work to observe (the dispatch mode, this thread)."""

    def __init__(self, device_type: str = "cpu", pause: bool = True):
        self.device_type = device_type
        self.graphs: dict = {}  # thread id -> Graph
        self.done: list = []  # graphs cleaned up, for the totals
        self.module = types.ModuleType("comfy.model_prefetch")
        for name in GRAPH_CALLS:
            if pause or name != "pause_malloc_graph":  # pause=False: ComfyUI with graphs but without the escape
                setattr(self.module, name, getattr(self, name))

    def install(self, monkeypatch) -> "SimMallocGraph":
        comfy = sys.modules.get("comfy") or types.ModuleType("comfy")
        comfy.model_prefetch = self.module
        monkeypatch.setitem(sys.modules, "comfy", comfy)
        monkeypatch.setitem(sys.modules, "comfy.model_prefetch", self.module)
        return self

    @contextlib.contextmanager
    def recording(self):
        with _Recorder(self):
            yield self

    # -- comfy.model_prefetch ---------------------------------------------------------------------------------
    def malloc_graph_enabled(self, device) -> bool:
        return torch.device(device).type == self.device_type

    def malloc_graph_begin(self, device) -> None:
        if not self.malloc_graph_enabled(device):
            return
        graph = self.graphs.setdefault(threading.get_ident(), Graph())
        graph.push(None)
        graph.active = True

    def malloc_graph_end(self) -> None:
        graph = self.graphs.get(threading.get_ident())
        if graph is not None and graph.active:
            while graph.levels:
                graph.pop()
            graph.active = False

    @contextlib.contextmanager
    def pause_malloc_graph(self, sync=False):
        graph = self.graphs.get(threading.get_ident())
        live = graph is not None and graph.active
        if live:
            graph.sweep()  # freed before the pause: seen
            graph.paused += 1
        try:
            yield
        finally:
            if live:
                graph.sweep()  # freed inside the pause: hidden
                graph.paused -= 1

    def prefetch_queue_pop(self, queue, device, module, dtype=None, core=None, enable_graph=False, generator=None,
                           malloc_scope=None):
        assert queue is None, "the model on a CPU has no prefetch queue"
        graph = self.graphs.get(threading.get_ident())
        if graph is not None and graph.active and malloc_scope is not None:
            if len(graph.levels) > 1 and graph.levels[-1][0] == malloc_scope:  # comfy-aimdo's `iterate`
                graph.pop()
            if module is not None:
                graph.push(malloc_scope)
        if core is not None:
            core()

    def make_prefetch_queue(self, queue, device, transformer_options):
        return None  # a CPU: no dynamic VRAM prefetch

    def cleanup_prefetch_queues(self) -> None:
        """What ComfyUI runs between nodes: the thread's graph is dropped."""
        graph = self.graphs.pop(threading.get_ident(), None)
        if graph is not None:
            graph.sweep()
            self.done.append(graph)

    # -- totals ----------------------------------------------------------------------------------------------
    def totals(self) -> dict:
        """Failures and rogues over every graph so far (cleaned up or not), and each graph's breaks per forward."""
        graphs = self.done + list(self.graphs.values())
        return {"failures": sum(g.failures for g in graphs), "rogues": sum(g.rogues for g in graphs),
                "breaks": [g.breaks for g in graphs]}


class NoGraph:
    """`comfy.model_prefetch` where ComfyUI has none (v0.33, or no CUDA): every call does nothing."""

    @staticmethod
    def malloc_graph_begin(device):
        pass

    @staticmethod
    def malloc_graph_end():
        pass

    @staticmethod
    def prefetch_queue_pop(queue, device, module, dtype=None, core=None, malloc_scope=None, **kwargs):
        if core is not None:
            core()

    @staticmethod
    def make_prefetch_queue(queue, device, transformer_options):
        return None

    @staticmethod
    def pause_malloc_graph(sync=False):
        return contextlib.nullcontext()


@passive  # bookkeeping of allocations, as ComfyUI's own (`nodes/run/compiler.py` declares those passive too)
def model_prefetch():
    """What a tiny model calls: the installed stand-in, else a module that does nothing."""
    return sys.modules.get("comfy.model_prefetch") or NoGraph


for _cls in (NoGraph, SimMallocGraph):
    for _name in GRAPH_CALLS:
        if hasattr(_cls, _name):
            passive(getattr(_cls, _name))
