"""SimCuda: a CPU model of CUDA ordering, so that a missing fence fails a CPU test.

On a real CPU device every copy has finished when it returns, so no test can see a missing event wait, a buffer
freed too early or an unbounded queue. Stores run on this model instead when a test swaps
`offload_core.devices.streams_factory` for `SimCuda.streams` (see `conftest.py`). What it models:

- Work queued on a stream (a copy, a kernel of the test, a wait for an event) runs in queue order, and only
  when something orders it: `Event.synchronize`, `Stream.synchronize`, `SimCuda.synchronize` (a host sync), a
  wait of another stream that is itself run, or a blocking copy. An event is complete once its stream has run
  everything queued before it.
- Two schedules, the two extremes a GPU may take:
  `late`: the consumer's stream (the host's own kernels) runs at once; side streams run as late as allowed.
  Reading freed memory, a missing wait for a copy and an unbounded queue show up here.
  `early`: side streams run as soon as their waits are met; the consumer's stream lags until something
  synchronizes it, its kernels queued by the test with `launch`. Overwriting what the consumer still reads
  shows up here.
- Device memory (`empty`) comes from a caching allocator that hands a freed block of the same size out again
  at once to the stream it was allocated on, unless `record_stream` marked it used by another stream: then not
  before that stream has run past the moment it was freed. Work on the allocating stream is always in order. A queued operation holds no reference to device memory, only its address, as a
  kernel does; host buffers of the store's allocator are tracked too.
- A copy between host and device with `non_blocking=False` blocks the host until it ran (torch syncs the stream);
  every other copy is asynchronous. Pinning always succeeds (the host allocator's pinning is replaced).
- Operations on another stream that touch a device block freed (or handed out again) since they were queued,
  or a host buffer released since, are recorded in `violations`; the first then run anyway, as the hardware
  would (so the test also sees the wrong data), the second not (the pages may be unmapped).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, List, Optional

import numpy as np
import torch

from offload_core.host import devices, hostmem

from simstreams import SimAPI, SimEvent, SimStream, SimStreams


class _Block:
    """One device allocation of the caching allocator; `gen` counts how often it was handed out."""

    def __init__(self, nbytes: int):
        self.array = np.zeros(max(nbytes, 1), dtype=np.uint8)
        self.base = torch.from_numpy(self.array)  # the allocator's own reference: the memory is never unmapped
        self.ptr, self.nbytes = self.base.data_ptr(), nbytes
        self.gen, self.free = 0, True
        self.stream: Optional["SimStream"] = None  # the stream it was allocated on: its work is always in order
        self.used_by: set = set()  # streams named by record_stream since it was handed out
        self.held_until: List[SimEvent] = []


class _Handle:
    """What a queued operation keeps of a tensor: for device blocks only the address, like a kernel."""

    def __init__(self, sim: "SimCuda", t: torch.Tensor):
        self.block, self.host, self.tensor = sim.block_of(t), None, None
        if self.block is not None:
            self.gen, self.offset = self.block.gen, t.data_ptr() - self.block.ptr
            self.size, self.stride, self.dtype = tuple(t.size()), tuple(t.stride()), t.dtype
        else:
            self.host = sim.host_buffer_of(t)
            self.tensor = t

    def problem(self, stream: SimStream) -> Optional[str]:
        block = self.block
        if block is not None and stream is block.stream:
            return None  # later users of the memory queue on this stream too, so after this operation
        if block is not None and block.gen != self.gen:
            return f"device block of {block.nbytes} bytes was freed and handed out again"
        if block is not None and block.free and stream not in block.used_by:
            return f"device block of {block.nbytes} bytes was freed (no record_stream for {stream.name})"
        if self.host is not None and self.host.tensor is None:
            return f"host buffer of {self.host.nbytes} bytes was released"
        return None

    def get(self) -> torch.Tensor:
        if self.block is None:
            return self.tensor
        span = sum((s - 1) * st for s, st in zip(self.size, self.stride)) + 1 if all(self.size) else 0
        size = torch.empty((), dtype=self.dtype).element_size()
        flat = self.block.base[self.offset:self.offset + span * size].view(self.dtype)
        return flat.as_strided(self.size, self.stride)

    @property
    def on_host(self) -> bool:
        return self.host is not None


class SimCuda:
    """One simulated device: its streams, its caching allocator, and what went wrong (`violations`)."""

    def __init__(self, schedule: str = "late"):
        assert schedule in ("late", "early"), schedule
        self.schedule = schedule
        self.lock = threading.RLock()
        self.consumer = SimStream(self, "consumer")
        self.all_streams = [self.consumer]
        self.violations: List[str] = []
        self.on_copy: Optional[Callable] = None  # called after a copy is queued; tests inject faults here
        self._local = threading.local()
        self._blocks: List[_Block] = []
        self._host: List = []
        self.held_bytes = self.peak_held_bytes = 0
        self._depth = 0  # runs in progress (a wait runs another stream first)
        self.api = SimAPI(self)

    # -- streams -----------------------------------------------------------------------------------------
    def current(self) -> SimStream:
        return getattr(self._local, "stream", None) or self.consumer

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def new_stream(self, name: str) -> SimStream:
        with self.lock:
            stream = SimStream(self, f"{name}{len(self.all_streams)}")
            self.all_streams.append(stream)
            return stream

    def record(self, stream: Optional[SimStream] = None) -> SimEvent:
        with self.lock:
            stream = stream or self.current()
            return SimEvent(self, stream, len(stream.ops))

    def enqueue(self, stream: SimStream, op: tuple) -> None:
        with self.lock:
            stream.ops.append(op)
            if self.schedule == "late" and stream is self.consumer:
                self.run(stream, len(stream.ops))
            self._advance()

    def launch(self, fn: Callable, *tensors: torch.Tensor) -> None:
        """A kernel of the test on the current stream: `fn(*tensors)` runs when the stream gets there."""
        self.enqueue(self.current(), ("call", fn, [_Handle(self, t) for t in tensors]))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        stream = self.current()
        handles = [_Handle(self, dst), _Handle(self, src)]
        torch.autograd.graph.increment_version(dst)  # as the real copy_ does when it is queued
        self.enqueue(stream, ("call", _copy, handles))
        if self.on_copy is not None:
            self.on_copy(stream, dst, src)
        if not non_blocking and handles[0].on_host != handles[1].on_host:
            self.run(stream, len(stream.ops))  # a pageable copy: torch waits for it

    def copy_with(self, fn: Callable, dst: torch.Tensor, srcs, non_blocking: bool) -> None:
        """A copy made of several torch calls (`fn()`), queued as one operation; blocking as `copy`."""
        stream = self.current()
        handles = [_Handle(self, dst), *[_Handle(self, t) for t in srcs]]
        self.enqueue(stream, ("call", lambda *_: fn(), handles))
        if not non_blocking and any(h.on_host != handles[0].on_host for h in handles[1:]):
            self.run(stream, len(stream.ops))

    def run(self, stream: SimStream, upto: int) -> None:
        """Runs `stream` up to op `upto`, and first whatever its waits need."""
        with self.lock:
            self._depth += 1
            try:
                while stream.executed < upto:
                    op = stream.ops[stream.executed]
                    if op[0] == "wait":
                        self.run(op[1].stream, op[1].index)  # an earlier point of any stream: no cycle
                    else:
                        self._execute(stream, op)
                    stream.executed += 1
            finally:
                self._depth -= 1
            self._advance()

    def _advance(self) -> None:
        if self.schedule != "early" or self._depth:  # never inside a run: it owns the streams it is running
            return
        progress = True
        while progress:  # side streams run whatever is not waiting on an incomplete event
            progress = False
            for stream in self.all_streams[1:]:
                while stream.executed < len(stream.ops):
                    op = stream.ops[stream.executed]
                    if op[0] == "wait" and not op[1].query():
                        break
                    if op[0] == "call":
                        self._execute(stream, op)
                    stream.executed += 1
                    progress = True

    def _execute(self, stream: SimStream, op: tuple) -> None:
        _, fn, handles = op
        unmapped = False
        for h in handles:
            problem = h.problem(stream)
            if problem is not None:
                self.violations.append(f"{stream.name}: {getattr(fn, '__name__', fn)} ran after its {problem}")
                unmapped = unmapped or h.on_host  # its pages may be gone: touching them would crash the tests
        if not unmapped:
            fn(*[h.get() for h in handles])

    def wait_current(self, device=None) -> None:
        """`devices.wait_for_device`: the host waits for everything queued on the current stream."""
        stream = self.current()
        self.run(stream, len(stream.ops))

    def synchronize(self) -> None:
        """A device-wide host sync: every stream runs everything queued."""
        with self.lock:
            while any(s.executed < len(s.ops) for s in self.all_streams):
                for s in self.all_streams:
                    self.run(s, len(s.ops))

    # -- memory ------------------------------------------------------------------------------------------
    def empty(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            for block in self._blocks:  # held blocks come back once their streams ran past the free (a query)
                if block.held_until and all(e.query() for e in block.held_until):
                    block.held_until = []
                    self.held_bytes -= block.nbytes
            stream = self.current()  # as torch's allocator: one pool per stream
            block = next((b for b in reversed(self._blocks) if b.free and not b.held_until
                          and b.nbytes == nbytes and b.stream in (None, stream)), None)
            if block is None:
                block = _Block(nbytes)
                self._blocks.append(block)
            block.gen += 1
            block.free, block.used_by, block.stream = False, set(), stream
            self.held_bytes += nbytes
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
            view = block.array[:nbytes]
            weakref.finalize(view, self._free, block, block.gen)
            return torch.from_numpy(view)

    def _free(self, block: _Block, gen: int) -> None:
        with self.lock:
            if block.gen != gen or block.free:
                return
            block.free = True
            if block.used_by:
                block.held_until = [self.record(s) for s in block.used_by]
            else:
                self.held_bytes -= block.nbytes

    def record_stream(self, tensor: torch.Tensor, stream: SimStream) -> None:
        block = self.block_of(tensor)
        if block is not None:
            block.used_by.add(stream)

    def block_of(self, t: torch.Tensor) -> Optional[_Block]:
        ptr = t.data_ptr()
        with self.lock:
            return next((b for b in self._blocks if b.ptr <= ptr < b.ptr + max(b.nbytes, 1)), None)

    def host_buffer_of(self, t: torch.Tensor):
        """The live host buffer of the store's allocator that holds `t`, if any. A released one is passed over:
        its address range may since hold memory of torch's own allocator (an encoded layer, a temporary),
        which an operation queued now reads as any other tensor, not as the released buffer."""
        ptr = t.data_ptr()
        with self.lock:
            return next((b for b, start, end in reversed(self._host) if start <= ptr < end and b.tensor is not None),
                        None)

    def track_host_buffer(self, buf) -> None:
        if buf.tensor is None or not buf.nbytes:
            return
        start = buf.tensor.data_ptr()
        end = start + buf.nbytes
        with self.lock:  # an address range unmapped before may come back in a new buffer: forget the old one
            self._host = [(b, s, e) for b, s, e in self._host if e <= start or s >= end] + [(buf, start, end)]

    # -- the store's view of it --------------------------------------------------------------------------
    def streams(self, device: torch.device, asynchronous: bool, stream_fn=None) -> "SimStreams":
        return SimStreams(self, device, asynchronous)

    def install(self, monkeypatch) -> "SimCuda":
        """Makes every store created from now on (until `monkeypatch` undoes it) run on this model."""
        _install(monkeypatch, self.streams, self.wait_current, [self])
        return self


class SimDevices:
    """Several simulated devices, one `SimCuda` each, as a host with several GPUs: a store on `cpu:i` gets the
    streams, memory and host waits of device i (`devices.streams_factory`, `devices.wait_for_device` are routed by
    the device's index), and each device's current stream is its own, per thread. Work queued on one device is
    never run by another's synchronize, so a store that queued on the wrong device reads stale data."""

    def __init__(self, n: int = 2, schedule: str = "late"):
        self.sims = [SimCuda(schedule) for _ in range(n)]

    def of(self, device) -> SimCuda:
        return self.sims[torch.device(device).index or 0]

    def streams(self, device: torch.device, asynchronous: bool, stream_fn=None) -> "SimStreams":
        return SimStreams(self.of(device), device, asynchronous)

    def wait_current(self, device=None) -> None:
        self.of(device if device is not None else "cpu").wait_current()

    def install(self, monkeypatch) -> "SimDevices":
        _install(monkeypatch, self.streams, self.wait_current, self.sims)
        return self


def _install(monkeypatch, streams, wait, sims) -> None:
    """Stores made from now on get their streams from `streams`, host waits from `wait`, and every host buffer
    of theirs is tracked by each of `sims` (host memory is the host's: every device may copy from it)."""
    monkeypatch.setattr(devices, "streams_factory", streams)
    monkeypatch.setattr(devices, "wait_for_device", wait)
    monkeypatch.setattr(hostmem, "_cuda_register", lambda tensor: True)
    monkeypatch.setattr(hostmem, "_cuda_unregister", lambda tensor: None)
    alloc = hostmem.HostAllocator.alloc

    def tracked_alloc(allocator, nbytes, spare=False):
        buf = alloc(allocator, nbytes, spare)
        for sim in sims:
            sim.track_host_buffer(buf)
        return buf

    monkeypatch.setattr(hostmem.HostAllocator, "alloc", tracked_alloc)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.autograd._unsafe_preserve_version_counter(dst):  # counted when queued, as torch does
        dst.copy_(src)
