"""The placement plan: which place keeps each layer of a store, decided by plain functions over plain data.

Sizes, budgets and free-memory figures go in; a `Plan` (layer -> place, plus one sentence saying why) comes
out. Nothing here allocates or moves memory, so every case is tested without a device: `kvstore.py` asks,
the tiers act.

Places, fastest first: `device` (resident, served without a copy), `host_pinned`, `host_pageable`, `file`.
Streamed layers (every place but `device`) come back through the store's ring of `depth + 1` device slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Tuple

from ..config import Mode
from ..places import DEVICE, FILE, GiB, HOST_PLACES, KiB, MiB, PAGEABLE, PINNED, PLACES, WORDS

RESERVE_BYTES = GiB // 2  # memory left free beside the cache for activations and other programs
MAX_LAYERS = 1 << 20  # the most layers a plan lists (8 MiB of entries; the deepest supported model has 60)
ASSUMED_LAYERS = 60  # when `auto` is not told the cache size: the deepest supported model (Qwen-Image-Edit)


def room(free: Optional[int]) -> int:
    """The most bytes `auto` keeps in `free` (0 when unknown): half as much again and `RESERVE_BYTES` stay free."""
    if free is None or free <= RESERVE_BYTES:
        return 0
    return (free - RESERVE_BYTES) * 2 // 3


def resolve(requested: Mode, unified: Optional[str]) -> Tuple[Mode, str]:
    """The mode an explicit mode actually runs as: the RAM modes become `gpu` where RAM and VRAM are one pool."""
    if requested.is_ram and unified is not None:
        return Mode.GPU, f"{requested.value} -> gpu: RAM modes disabled, {unified}"
    return requested, "requested"


def resident_indices(layers: int, resident: int) -> List[int]:
    """Which of `layers` (in put order) stay on the device when only `resident` of them fit.

    Spread evenly, the first layer always among them. The store prefetches the next *streamed* layers
    (resident ones need no copy), so a streamed layer's copy starts when the previous streamed layer is
    consumed and hides behind every resident layer in between: spreading the resident layers evenly gives the
    worst-hidden copy the most compute to hide behind. The first layer of a pass is the one whose copy has
    the least time (it cannot be prefetched before the first cached pass), so it is always resident.
    `scripts/resident_choice.py` measures it: spread layers expose a fraction of the wait of a first or a
    last block of the same size.
    """
    resident = max(0, min(resident, layers))
    return sorted({i * layers // resident for i in range(resident)}) if resident else []


@dataclass(frozen=True)
class Plan:
    """Layer -> place for the `layers` a store expects, and the caps that hold for any layer beyond them.

    places: the place of the i-th layer put (put order), for the expected layer count.
    mode: the mode in effect (how streamed layers move: synchronously or prefetched).
    device_cap / host_cap: bytes the device / host RAM places may hold (None: no cap). Enforced per layer by
        `place_of`, so layers larger or more numerous than expected never exceed a budget.
    stream: where a layer goes that may not stay on the device (the plan's fastest streamed place).
    why: per place, why layers go there (the words of `describe`); label: "auto" or the mode's name, None for
        an explicit mode that was simply granted (no budget, one place): its reason is "requested".
    layer_bytes: bytes of one layer as kept, the expectation `reason` is worded from.
    """

    places: Tuple[str, ...]
    mode: Mode
    device_cap: Optional[int] = None
    host_cap: Optional[int] = None
    stream: str = FILE
    why: Mapping[str, str] = field(default_factory=dict)
    label: Optional[str] = None
    within: bool = False  # the device's share is set by `device_budget`, not by free memory
    suffix: str = ""  # said when some layers are not resident (e.g. why no RAM place is planned)
    layer_bytes: int = 0

    @property
    def reason(self) -> str:
        """The sentence for the expected layers (what `describe` says before any layer is put)."""
        return self.describe(self.counts(), len(self.places) * self.layer_bytes)

    def describe(self, counts: Mapping[str, int], nbytes: int) -> str:
        """One sentence for `stats()["reason"]`: the layers `counts` holds per place (`nbytes` in all, as kept),
        each place with why its layers are there. Worded from the layers actually put, not the expectation."""
        if self.label is None and sum(1 for n in counts.values() if n) <= 1:
            return "requested"
        total = sum(counts.values())
        if counts.get(DEVICE, 0) == total:
            text = f"all {_count(total)} ({_gib(nbytes)}) fit {'within' if self.within else 'in'} {self.why[DEVICE]}"
        else:
            said = [f"{counts[p]} {WORDS[p]} ({self.why[p]})" for p in PLACES if counts.get(p)]
            text = f"{_count(total)} ({_gib(nbytes)}): " + ", ".join(said) + self.suffix
        return f"{self.label or self.mode.value}: {text}"

    def counts(self) -> Dict[str, int]:
        out = dict.fromkeys(PLACES, 0)
        for place in self.places:
            out[place] += 1
        return out

    def place_of(self, index: int, nbytes: int, on_device: int, on_host: int) -> str:
        """The place of the `index`-th layer put, `nbytes` as kept, given the bytes already on device / host.

        Layers beyond the expected count get the plan's slowest place (its overflow), and every layer that
        would push a place over its cap moves down one place: device -> the streamed place, host -> file.
        """
        place = self.places[index] if index < len(self.places) else (self.places[-1] if self.places else self.stream)
        if place == DEVICE and self.device_cap is not None and on_device + nbytes > self.device_cap:
            place = self.stream
        if place in HOST_PLACES and self.host_cap is not None and on_host + nbytes > self.host_cap:
            place = FILE
        return place


@dataclass(frozen=True)
class Figures:
    """What a plan is made from: the cache's size, the budgets and what is free right now.

    layers / layer_bytes: expected layer count and bytes per layer as kept (after the codec).
    slot_bytes: bytes of one device slot (a decoded layer), `slots` of them when anything streams.
    pinnable: pinned copies exist here (CUDA and an asynchronous mode); else RAM layers are pageable.
    unified: why host RAM is no separate pool (None: it is); then no RAM place is ever planned.
    counted: False when `layers` is a guess (`ASSUMED_LAYERS`).
    """

    layers: int
    layer_bytes: int
    slot_bytes: int
    slots: int
    device_budget: Optional[int] = None
    host_budget: Optional[int] = None
    pin_budget: Optional[int] = None
    free_device: Optional[int] = None
    free_host: Optional[int] = None
    pinnable: bool = True
    unified: Optional[str] = None
    counted: bool = True  # `layers` is the caller's figure, not a guess: resident layers can be spread


def make_plan(mode: Mode, f: Figures) -> Plan:
    """The plan for a store in `mode` (already resolved, or `auto`). A layer count above `MAX_LAYERS` (an
    absurd `expected_bytes`) is planned as `MAX_LAYERS`: the plan holds one entry per layer, and the layers
    beyond go where `Plan.place_of` puts any layer beyond the expected ones, within the same caps."""
    if f.layers > MAX_LAYERS:
        f = replace(f, layers=MAX_LAYERS)
    if mode is Mode.GPU:
        return Plan((DEVICE,) * f.layers, mode, stream=DEVICE, why={DEVICE: "requested"}, layer_bytes=f.layer_bytes)
    if mode is Mode.AUTO:
        return _auto_plan(f)
    device_cap = f.device_budget
    resident = _whole_layers(device_cap, f.layer_bytes, f.layers) if device_cap is not None else 0
    if mode.is_file:
        host_cap, pinned_cap = None, None
    else:
        host_cap = f.host_budget
        pinned_cap = f.pin_budget if mode.is_async and f.pinnable else 0
    places = _fill(f, resident, host_cap, pinned_cap, file_only=mode.is_file)
    stream = FILE if mode.is_file else (PINNED if mode.is_async and f.pinnable else PAGEABLE)
    budgeted = f.device_budget is not None or host_cap is not None
    return Plan(places, mode, device_cap=device_cap, host_cap=host_cap, stream=stream,
                why=_whys(mode, f, host_cap, mode.is_file), label=mode.value if budgeted else None,
                within=f.device_budget is not None, layer_bytes=f.layer_bytes)


def _auto_plan(f: Figures) -> Plan:
    """Fill places in order of speed: device (free VRAM after the margin), pinned RAM, pageable RAM, files."""
    total = f.layers * f.layer_bytes
    device_room = room(f.free_device)
    if total > device_room:  # something streams: its slots need room on the device too
        device_room = max(0, device_room - f.slots * f.slot_bytes)
    device_cap = device_room if f.device_budget is None else min(device_room, f.device_budget)
    resident = _whole_layers(device_cap, f.layer_bytes, f.layers)
    if f.unified is None:
        host_room = room(f.free_host)
        host_cap = host_room if f.host_budget is None else min(host_room, f.host_budget)
        pinned_cap = f.pin_budget if f.pinnable else 0
    else:
        host_cap, pinned_cap = 0, 0
    places = _fill(f, resident, host_cap, pinned_cap, file_only=f.unified is not None)
    if FILE in places:
        mode = Mode.FILE_ASYNC
    elif resident < f.layers:
        mode = Mode.RAM_ASYNC
    else:
        mode = Mode.GPU
    stream = FILE if f.unified is not None else (PINNED if f.pinnable else PAGEABLE)
    suffix = f" (RAM places disabled, {f.unified})" if f.unified is not None else ""
    return Plan(places, mode, device_cap=device_cap, host_cap=host_cap if f.unified is None else 0, stream=stream,
                why=_whys(Mode.AUTO, f, host_cap, f.unified is not None), label="auto",
                within=f.device_budget is not None, suffix=suffix, layer_bytes=f.layer_bytes)


def _whole_layers(cap: Optional[int], layer_bytes: int, layers: int) -> int:
    if cap is None:
        return layers
    return min(layers, cap // max(layer_bytes, 1))


def _fill(f: Figures, resident: int, host_cap: Optional[int], pinned_cap: Optional[int],
          file_only: bool) -> Tuple[str, ...]:
    """Resident layers spread over the order; the streamed rest pinned, then pageable, then files."""
    streamed = f.layers - resident
    if file_only:
        host, pinned = 0, 0
    else:
        host = streamed if host_cap is None else min(streamed, host_cap // max(f.layer_bytes, 1))
        if pinned_cap is None:
            pinned = host
        else:
            # Staging buffers of the file place come out of the same pin budget when anything spills.
            staging = f.slots * f.slot_bytes if host < streamed else 0
            pinned = min(host, max(0, pinned_cap - staging) // max(f.layer_bytes, 1))
    files = streamed - host
    order = [PINNED] * pinned + [PAGEABLE] * (host - pinned) + [FILE] * files
    # With a guessed layer count, spreading could leave budget unused when fewer layers come: fill from the front.
    on_device = set(resident_indices(f.layers, resident) if f.counted else range(resident))
    rest = iter(order)
    return tuple(DEVICE if i in on_device else next(rest) for i in range(f.layers))


def _gib(n: Optional[int]) -> str:
    if n is None:
        return "unknown"
    return f"{n / GiB:.2f} GiB" if n >= GiB // 4 else (f"{n / MiB:.1f} MiB" if n >= MiB // 4 else f"{n // KiB} KiB")


def _count(layers: int) -> str:
    return f"{layers} layer{'s' * (layers != 1)}"


def _whys(mode: Mode, f: Figures, host_cap: Optional[int], file_only: bool) -> Dict[str, str]:
    """Why layers go to each place, in the plan's terms (the parentheses of `Plan.describe`)."""
    return {DEVICE: _device_why(f), PINNED: _pin_why(f), PAGEABLE: _host_why(mode, f),
            FILE: _file_why(f, host_cap, file_only)}


def _device_why(f: Figures) -> str:
    if f.device_budget is not None:
        return f"device_budget {_gib(f.device_budget)}"
    return f"free device memory {_gib(f.free_device)}"


def _pin_why(f: Figures) -> str:
    return f"pin budget {_gib(f.pin_budget)}" if f.pin_budget is not None else "within the host's pin budget"


def _host_why(mode: Mode, f: Figures) -> str:
    if f.host_budget is not None:
        return f"host_budget {_gib(f.host_budget)}"
    if f.free_host is not None:
        return f"free RAM {_gib(f.free_host)}"
    if mode is Mode.RAM_SYNC:
        return "ram_sync copies synchronously and never pins"
    if not f.pinnable:
        return "copies here are synchronous, so nothing is pinned"
    return "beyond the pin budget"


def _file_why(f: Figures, host_cap: Optional[int], file_only: bool) -> str:
    if file_only:
        return "file mode" if f.unified is None else "no RAM place"
    return "beyond " + (f"host_budget {_gib(f.host_budget)}" if f.host_budget is not None and
                        (host_cap or 0) >= f.host_budget else f"free RAM {_gib(f.free_host)}")
