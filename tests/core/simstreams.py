"""The stream surface of a `SimCuda` (see `simcuda.py`): its events, its streams, the device-generic stream API
`Streams` takes them from, and the `Streams` of one store on it."""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from offload_core.host.devices import Streams

if TYPE_CHECKING:
    from simcuda import SimCuda


class SimEvent:
    """A point in a stream's queue; complete once the stream ran everything before it (unrecorded: complete)."""

    def __init__(self, sim: "SimCuda", stream: Optional["SimStream"] = None, index: int = 0):
        self.sim, self.stream, self.index = sim, stream, index

    def record(self, stream: Optional["SimStream"] = None) -> None:
        with self.sim.lock:
            self.stream = stream or self.sim.current()
            self.index = len(self.stream.ops)

    def query(self) -> bool:
        return self.stream is None or self.stream.executed >= self.index

    def synchronize(self) -> None:
        if self.stream is not None:
            self.sim.run(self.stream, self.index)

    def elapsed_time(self, end: "SimEvent") -> float:
        return 0.0  # no device clock: the timings of a simulated run are zero


class SimAPI:
    """The device-generic stream API (`torch.Stream`, `torch.Event`, `torch.accelerator`) of one `SimCuda`:
    what `Streams` makes its side stream, consumer stream and events with, whatever the device type."""

    def __init__(self, sim: "SimCuda"):
        self.sim = sim
        self.made: List[str] = []  # (device type) of every stream and event made: the path a store took

    def stream(self, device: torch.device) -> "SimStream":
        self.made.append(f"stream:{device.type}")
        return self.sim.new_stream("side")

    def current(self, device: torch.device) -> "SimStream":
        return self.sim.current()

    def event(self, device: torch.device, timing: bool = False) -> SimEvent:
        self.made.append(f"event:{device.type}")
        return SimEvent(self.sim)

    def use(self, stream: "SimStream"):
        return self.sim.use(stream)


class SimStream:
    def __init__(self, sim: "SimCuda", name: str):
        self.sim, self.name = sim, name
        self.ops: List[tuple] = []  # ("wait", event) | ("call", fn, handles)
        self.executed = 0

    def wait_event(self, event: SimEvent) -> None:
        self.sim.enqueue(self, ("wait", event))

    def synchronize(self) -> None:
        self.sim.run(self, len(self.ops))

    def __repr__(self) -> str:
        return f"<SimStream {self.name}: {self.executed}/{len(self.ops)} run>"


class SimStreams(Streams):
    """`Streams` of one store on a `SimCuda`: its streams and events come through the generic API (`SimAPI`),
    as on any stream device; copies, device memory and `record_stream` are the simulated device's."""

    def __init__(self, sim: SimCuda, device: torch.device, asynchronous: bool):
        super().__init__(device, asynchronous, api=sim.api)  # a CPU tensor device, scheduled like CUDA / XPU
        self.sim = sim

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
        self.sim.copy(dst, src, non_blocking)

    def copy_with(self, fn, dst: torch.Tensor, *srcs: torch.Tensor, non_blocking: bool) -> None:
        self.sim.copy_with(fn, dst, srcs, non_blocking)

    def empty(self, nbytes: int) -> torch.Tensor:
        return self.sim.empty(nbytes)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if stream is not None:
            self.sim.record_stream(tensor, stream)
