"""Devices, streams and fences: the only place that knows whether copies can run asynchronously.

On CUDA, copies run on one side stream per store and completion is tracked with events. Everywhere else
(CPU, MPS) the same calls run synchronously: `Fence` is already complete, the stream context is
`nullcontext()`, so the scheduling code in `store.py` is one code path that CPU tests exercise fully.

Every copy, device allocation and fence of the stores and tiers goes through `Streams`, so that the CPU tests
can swap it (through `open_streams`) for a model of CUDA ordering in which queued work really is deferred
(`tests/core/simcuda.py`): there a missing fence shows up as wrong data or a reported violation.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch


def unified_memory_reason(device: torch.device, get_properties: Optional[Callable] = None) -> Optional[str]:
    """Why host RAM and `device` memory are one physical pool, or None when they are separate.

    `get_properties(index)` defaults to `torch.cuda.get_device_properties`; tests pass a stand-in for devices
    this machine lacks.
    """
    if device.type == "mps":
        return "unified memory (Apple MPS): host RAM and device memory are the same pool"
    if device.type != "cuda":
        return None
    get_properties = get_properties or torch.cuda.get_device_properties
    index = device.index if device.index is not None else 0
    props = get_properties(index)
    if getattr(props, "is_integrated", False):
        name = getattr(props, "name", "integrated GPU")
        return f"unified memory ({name} is an integrated GPU): host RAM and device memory are the same pool"
    return None


class Fence:
    """Completion of work queued on a stream; `None` event means the work already finished on the host."""

    __slots__ = ("event",)

    def __init__(self, event: Optional["torch.cuda.Event"] = None):
        self.event = event

    def make_wait(self, stream) -> None:
        """Order all later work on `stream` after this fence, without blocking the host."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or self.event.query()


DONE = Fence()


class Streams:
    """The side stream of one store and the timing of work on it and on the consumer's stream.

    Timings are CUDA events resolved lazily (never a sync on the hot path) or, without CUDA, wall time.
    """

    def __init__(self, device: torch.device, asynchronous: bool, stream_fn: Optional[Callable] = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.asynchronous = asynchronous and self.cuda
        self._stream_fn = stream_fn
        self._side = None
        self._pending: List[Tuple[object, object, str]] = []
        self._lock = threading.Lock()  # the file tier's I/O thread times its copies too
        self.seconds = {"transfer": 0.0, "wait": 0.0}

    @property
    def immediate(self) -> bool:
        """True when every operation has run by the time it returns (no CUDA): host code may then touch device
        buffers directly, e.g. the file tier's I/O threads filling a CPU slot, with no stream work to order."""
        return not self.cuda

    @property
    def side(self):
        """The copy stream (created on first use), or None when copies run on the consumer's stream."""
        if not self.asynchronous:
            return None
        if self._side is None:
            stream = self._stream_fn(self.device) if self._stream_fn else None
            self._side = stream if stream is not None else torch.cuda.Stream(device=self.device)
        return self._side

    def consumer(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def on_side(self):
        side = self.side
        return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()

    # -- the operations the tiers queue (on the current stream: the consumer's, or the side one in on_side) --
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """`dst.copy_(src)` queued on the current stream."""
        dst.copy_(src, non_blocking=non_blocking)

    def empty(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer on the device, from the caching allocator on the current stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Keeps the caching allocator from reusing `tensor`'s memory until work queued on `stream` so far ran."""
        if stream is not None:
            tensor.record_stream(stream)

    def record(self, stream=None) -> Fence:
        """A fence after everything queued so far on `stream` (default: the current stream)."""
        if not self.cuda:
            return DONE
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        event = torch.cuda.Event()
        event.record(stream)
        return Fence(event)

    @contextlib.contextmanager
    def timed(self, bucket: str, stream=None):
        """Adds the duration of the enclosed work to `seconds[bucket]`: GPU time on `stream` under CUDA."""
        if not self.cuda:
            start = time.perf_counter()
            try:
                yield
            finally:
                with self._lock:
                    self.seconds[bucket] += time.perf_counter() - start
            return
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._pending.append((begin, end, bucket))
                crowded = len(self._pending) >= 64
            if crowded:
                self.resolve(block=False)

    def resolve(self, block: bool = True) -> None:
        """Folds finished event timings into `seconds`; with `block`, waits for all of them."""
        with self._lock:
            keep = []
            for begin, end, bucket in self._pending:
                if block or end.query():
                    end.synchronize()
                    self.seconds[bucket] += begin.elapsed_time(end) / 1000.0
                else:
                    keep.append((begin, end, bucket))
            self._pending = keep

    def synchronize(self) -> None:
        """Waits for every copy queued on the side stream."""
        if self._side is not None:
            self._side.synchronize()

    def drain(self) -> None:
        """Waits for all work on the side stream and, with asynchronous copies, on the consumer's stream: what
        close() does before freeing anything either of them may still read or write."""
        self.synchronize()
        if self.asynchronous:
            torch.cuda.current_stream(self.device).synchronize()


def open_streams(device: torch.device, asynchronous: bool, stream_fn: Optional[Callable] = None) -> Streams:
    """The `Streams` of a new store: the one seam through which tests run stores on a model of CUDA ordering."""
    return streams_factory(device, asynchronous, stream_fn)


streams_factory: Callable[..., Streams] = Streams  # replaced only by tests (see the module docstring)
