"""Devices, streams and fences: the only place that knows whether copies can run asynchronously.

On a device with memory of its own and user streams (CUDA, ROCm — which torch reports as `cuda` — and Intel
`xpu`), copies run on one side stream per store and completion is tracked with events, all through torch's
device-generic API (`torch.Stream`, `torch.Event`, `torch.accelerator`). Everywhere else (CPU, MPS, which has
no user streams) the same calls run synchronously: `Fence` is already complete, the stream context is
`nullcontext()`, so the scheduling code in `store/` is one code path that CPU tests exercise fully.

Every copy, device allocation and fence of the stores and tiers goes through `Streams`, and every stream and
event it makes comes from its `api`, so that the CPU tests can swap it (through `open_streams`) for a model of
CUDA ordering in which queued work really is deferred (`tests/core/simcuda.py`): there a missing fence shows
up as wrong data or a reported violation.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch

STREAM_DEVICES = ("cuda", "xpu")  # separate memory and user streams: copies may run beside compute


def unified_memory_reason(device: torch.device, get_properties: Optional[Callable] = None) -> Optional[str]:
    """Why host RAM and `device` memory are one physical pool, or None when they are separate.

    Apple MPS always; a CUDA / ROCm / XPU device whose properties say `is_integrated` (NVIDIA GB10 and Jetson,
    AMD APUs such as Ryzen AI Max, Intel integrated graphics). `get_properties(index)` defaults to the
    device's `torch.<type>.get_device_properties`; tests pass a stand-in for devices this machine lacks.
    """
    if device.type == "mps":
        return "unified memory (Apple MPS): host RAM and device memory are the same pool"
    if device.type not in STREAM_DEVICES:
        return None
    get_properties = get_properties or getattr(torch, device.type).get_device_properties
    index = device.index if device.index is not None else 0
    props = get_properties(index)
    if getattr(props, "is_integrated", False):
        name = getattr(props, "name", "integrated GPU")
        return f"unified memory ({name} is an integrated GPU): host RAM and device memory are the same pool"
    return None


class GenericAPI:
    """Streams and events of any torch accelerator, through torch's device-generic API."""

    @staticmethod
    def stream(device: torch.device):
        return torch.Stream(device=device)

    @staticmethod
    def current(device: torch.device):
        return torch.accelerator.current_stream(device)

    @staticmethod
    def event(device: torch.device, timing: bool = False):
        return torch.Event(device=device, enable_timing=timing)

    @staticmethod
    def use(stream):
        return stream  # a torch.Stream is the context that makes it current


GENERIC = GenericAPI()


class Fence:
    """Completion of work queued on a stream; `None` event means the work already finished on the host."""

    __slots__ = ("event",)

    def __init__(self, event: Optional["torch.Event"] = None):
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

    `api` makes the streams and events (default: torch's generic one on a stream device, none elsewhere).
    Timings are events resolved lazily (never a sync on the hot path) or, without streams, wall time.
    """

    def __init__(self, device: torch.device, asynchronous: bool, stream_fn: Optional[Callable] = None, api=None):
        self.device = device
        self.api = api if api is not None else GENERIC if device.type in STREAM_DEVICES else None
        self.streamed = self.api is not None
        self.asynchronous = asynchronous and self.streamed
        self._stream_fn = stream_fn
        self._side = None
        self._pending: List[Tuple[object, object, str]] = []
        self._lock = threading.Lock()  # the file tier's I/O thread times its copies too
        self.seconds = {"transfer": 0.0, "wait": 0.0}

    @property
    def immediate(self) -> bool:
        """True when every operation has run by the time it returns (no streams): host code may then touch device
        buffers directly, e.g. the file tier's I/O threads filling a CPU slot, with no stream work to order."""
        return not self.streamed

    @property
    def side(self):
        """The copy stream (created on first use), or None when copies run on the consumer's stream."""
        if not self.asynchronous:
            return None
        if self._side is None:
            stream = self._stream_fn(self.device) if self._stream_fn else None
            self._side = stream if stream is not None else self.api.stream(self.device)
        return self._side

    def consumer(self):
        return self.api.current(self.device) if self.streamed else None

    def on_side(self):
        side = self.side
        return self.api.use(side) if side is not None else contextlib.nullcontext()

    # -- the operations the tiers queue (on the current stream: the consumer's, or the side one in on_side) --
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        """`dst.copy_(src)` queued on the current stream."""
        dst.copy_(src, non_blocking=non_blocking)

    def copy_with(self, fn: Callable[[], None], dst: torch.Tensor, *srcs: torch.Tensor, non_blocking: bool) -> None:
        """`fn()`, which copies `srcs` into `dst` through torch calls, queued on the current stream (one seam for
        a copy made of several torch calls, e.g. a chunk of a layer's K and V)."""
        fn()

    def empty(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer on the device, from the caching allocator on the current stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Keeps the caching allocator from reusing `tensor`'s memory until work queued on `stream` so far ran."""
        if stream is not None:
            tensor.record_stream(stream)

    def record(self, stream=None) -> Fence:
        """A fence after everything queued so far on `stream` (default: the current stream)."""
        if not self.streamed:
            return DONE
        stream = stream if stream is not None else self.api.current(self.device)
        event = self.api.event(self.device)
        event.record(stream)
        return Fence(event)

    def timed(self, bucket: str, stream=None) -> "_Timed":
        """Adds the duration of the enclosed work to `seconds[bucket]`: device time on `stream` with streams.

        A plain class, not a generator context manager: it runs several times per `get`, and a generator's
        set-up costs more than the work it times on a CPU."""
        return _Timed(self, bucket, stream)

    def _add_events(self, begin, end, bucket: str) -> None:
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
            self.api.current(self.device).synchronize()


class _Timed:
    """The context of `Streams.timed`: wall time without streams, a pair of timing events on the stream with them."""

    __slots__ = ("streams", "bucket", "stream", "begin")

    def __init__(self, streams: Streams, bucket: str, stream) -> None:
        self.streams, self.bucket, self.stream = streams, bucket, stream

    def __enter__(self) -> None:
        streams = self.streams
        if not streams.streamed:
            self.begin = time.perf_counter()
            return
        if self.stream is None:
            self.stream = streams.api.current(streams.device)
        self.begin = streams.api.event(streams.device, timing=True)
        self.begin.record(self.stream)

    def __exit__(self, *exc) -> None:
        streams = self.streams
        if not streams.streamed:
            elapsed = time.perf_counter() - self.begin
            with streams._lock:
                streams.seconds[self.bucket] += elapsed
            return
        end = streams.api.event(streams.device, timing=True)
        end.record(self.stream)
        streams._add_events(self.begin, end, self.bucket)


def wait_for_device(device: torch.device) -> None:
    """Blocks the host until the work queued so far on `device`'s current stream has run; nothing on a device
    without streams (CPU, MPS), where every operation has run by the time it returns. Replaced by the tests'
    model of CUDA ordering, whose queued work would otherwise never be waited for."""
    if device.type in STREAM_DEVICES:
        GENERIC.current(device).synchronize()


def open_streams(device: torch.device, asynchronous: bool, stream_fn: Optional[Callable] = None) -> Streams:
    """The `Streams` of a new store: the one seam through which tests run stores on a model of CUDA ordering."""
    return streams_factory(device, asynchronous, stream_fn)


streams_factory: Callable[..., Streams] = Streams  # replaced only by tests (see the module docstring)
