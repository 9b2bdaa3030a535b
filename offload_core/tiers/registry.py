"""Place name -> the tier that keeps a store's layers there.

A store holds one tier per place its plan uses, opened on the first layer placed there (a plan with no file
layer creates no directory). Every tier gets the store's streams and depth; the host places differ only in
their allocator: `host_pinned` pins within the budget (and falls back visibly), `host_pageable` never pins.
File staging comes from the pinning allocator: staged copies to the device are the ones pinning speeds up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional

from ..host.devices import Streams
from ..host.hostmem import HostAllocator
from ..places import DEVICE, FILE, PAGEABLE, PINNED
from .base import Tier, TierContext
from .device import DeviceTier
from .file.tier import FileTier
from .ram import RamTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlaceOptions:
    """What the places need beyond the tier context.

    pageable: allocator of the `host_pageable` place (never pins).
    file_dir: parent directory of the file place's private directory (None: the system temp dir).
    bypass: file place: keep the page cache out of it. asynchronous: file place: background I/O thread.
    """

    pageable: HostAllocator
    file_dir: Optional[str]
    bypass: bool
    asynchronous: bool


def _device(ctx: TierContext, opts: PlaceOptions) -> Tier:
    return DeviceTier(ctx)


def _pinned(ctx: TierContext, opts: PlaceOptions) -> Tier:
    return RamTier(ctx)


def _pageable(ctx: TierContext, opts: PlaceOptions) -> Tier:
    return RamTier(replace(ctx, allocator=opts.pageable))


def _file(ctx: TierContext, opts: PlaceOptions) -> Tier:
    return FileTier(ctx, opts.file_dir, opts.bypass, opts.asynchronous)


FACTORIES: Dict[str, Callable[[TierContext, PlaceOptions], Tier]] = {
    DEVICE: _device, PINNED: _pinned, PAGEABLE: _pageable, FILE: _file,
}


def open_tier(place: str, ctx: TierContext, opts: PlaceOptions) -> Tier:
    try:
        factory = FACTORIES[place]
    except KeyError:
        raise ValueError(f"unknown place {place!r}; expected one of {', '.join(FACTORIES)}") from None
    return factory(ctx, opts)


def close_tiers(tiers: Dict[str, Tier], streams: Streams) -> None:
    # Order matters: side-stream copies touch host buffers, so they finish before any tier frees anything.
    # After the drain only a file tier's read lane can still queue a copy (a load that was running); its
    # close stops the lane, then waits for each staging buffer's copy fence before freeing it, so no sync of
    # the side stream is needed after the tiers closed.
    try:
        streams.drain()
    finally:
        errors = []
        for tier in list(tiers.values()):  # every tier is closed, whichever fails
            try:
                tier.close()
            except BaseException as exc:
                errors.append(exc)
        for later in errors[1:]:  # the first is raised; the others must not vanish with it
            log.warning("KV offload: closing another place failed too: %s: %s", type(later).__name__, later,
                        exc_info=later)
        if errors:
            raise errors[0]
