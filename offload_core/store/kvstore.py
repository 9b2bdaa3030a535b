"""`KVStore`: one cached prefix, put once per layer, got many times, then closed.

The store keeps the contract (`put`, `get`, `park`, `close`, `stats`); a plan (`plan.py`) says where each
layer is kept, the tiers of those places (`tiers/`) move the bytes, and the ring (`ring.py`) serves every layer
that is not resident through `depth + 1` device slots in the learned order. So at most the resident layers
plus `depth + 1` are ever on the device, and a slot is overwritten only after the work that read it has
finished. Without CUDA the same code runs with every fence already complete.

With compact storage (`storage` fp8 / int8) the codec (`codec.py`) encodes at `put` on the device, the tiers
keep and move the encoded bytes, and `get` decodes into a slot; a layer holding a NaN or an inf is kept exactly
as put instead (no codec can hold such a value without spreading or dropping it) and counted in
`stats()["kv_error"]`. A layer whose batch rows are identical is kept as one row (`dedup.py`: dedup first, then
the codec) and broadcast into the slot at `get`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Dict, Hashable, Optional, Tuple

import torch

from .codec import Compact, codec_for
from ..config import HostServices, Mode, OffloadConfig
from .dedup import RowDedup, served_layout
from ..host.devices import unified_memory_reason
from .checks import Consumer, Owner, check_device, check_pair, engine_mode, one_consumer
from .hostfacts import free_device_memory, free_host_memory, same_pool_reason
from ..host.hostmem import pin_room
from ..layout import LayerLayout, layout_for
from ..places import BUDGET_DEVICE, BUDGET_HOST, DEVICE
from .plan import ASSUMED_LAYERS, Figures, Plan, make_plan, resolve
from .layers import Layers
from .resources import StoreResources
from .ring import LayerOrder
from .stats import Snapshot, StoreStats
from ..tiers import KVWriteError, Tier

log = logging.getLogger(__name__)


class KVStore:
    """Holds the K/V of one prefix (one request, one CFG branch) where the plan of `config` puts each layer.

    A store serves one consumer: `put` and `get` must come from one thread (the first that calls either);
    another thread gets a `RuntimeError`, since the tensors of a `get` are only valid until the next one.
    `stats()` may be called from any thread; `close()` too (it waits for a `put` or `get` in progress).

    Args:
        config: a validated `OffloadConfig`; mode `off` is refused (no cache means no store).
        device: the consuming device ('cpu', 'cuda[:i]' or 'mps'); `put` takes tensors on it, `get` returns them.
        host: the host application's services (pinning, streams, free memory, temp dir).
        expected_bytes: the size of the whole cache as put (exact dtype), for the plan: the expected layer
            count is `expected_bytes` over the first layer's size; default 60 layers. Layers beyond the
            expectation get the plan's slowest place, and never push a place over its budget.
        name: shown in logs and stats (e.g. "cond", "uncond").
    """

    def __init__(self, config: OffloadConfig, device, *, host: Optional[HostServices] = None,
                 expected_bytes: Optional[int] = None, name: str = ""):
        self.device = _check_args(config, device, expected_bytes)
        self.config, self.name = config, name
        self._host = host or HostServices()
        self._paused = self._host.pause_graph or contextlib.nullcontext
        self._expected = expected_bytes
        self._unified = unified_memory_reason(self.device)
        self._compact = Compact(codec_for(config.storage), f"KV offload{self._tag}")
        self._codec = self._compact.codec
        self.requested = config.mode
        self.mode: Optional[Mode] = None
        self._granted = "auto: decided at the first put"  # how the requested mode was granted (see `reason`)
        self.plan: Optional[Plan] = None
        self._res: Optional[StoreResources] = None  # streams, allocators, tiers and ring, once the mode is known
        self._layers = Layers(self._compact)
        self.dedup = RowDedup(config.dedups)
        self._order = LayerOrder()
        self._consumer, self._busy, self._owner = Consumer(), threading.RLock(), Owner()
        self.closed = False
        self.depth = 0
        self.sealed = False  # set by park(): complete and read-only
        self._broken: Optional[str] = None  # the operation that raised part-way (`_fail`)
        self._stats = StoreStats(name, str(self.device), self.requested.value, config.storage)
        if config.mode is not Mode.AUTO:
            mode, reason = resolve(config.mode, self._unified)
            if mode is not self.requested:
                log.warning("KV offload%s: %s", self._tag, reason)
            self.mode, self._granted = mode, reason
            self._open_schedule(mode.is_async)

    @property
    def _tiers(self) -> Dict[str, Tier]:
        """The open tiers, by place: `StoreResources` owns them."""
        return self._res.tiers if self._res is not None else {}

    @property
    def _tag(self) -> str:
        return f" [{self.name}]" if self.name else ""

    # -- lifecycle -------------------------------------------------------------------------------------------
    def _open_schedule(self, asynchronous: bool) -> None:
        self._res = StoreResources(self, self._owner, self.config, self._host, self.device, asynchronous,
                                   self._layers, self._order, self._stats)
        self.depth = self._res.depth

    def _free_figures(self) -> Tuple[Optional[int], Optional[int]]:
        """Free device and host memory for `auto` (validated, `hostfacts.host_figure`); (None, None) otherwise."""
        if self.requested is not Mode.AUTO:
            return None, None
        return free_device_memory(self.device, self._host), free_host_memory(self._host)

    def _make_plan(self, layout: LayerLayout, kept: LayerLayout, free: Tuple[Optional[int], Optional[int]]) -> None:
        exact = layout.tensor_bytes
        counted = self._expected is not None and exact > 0  # a first layer of no tokens tells no layer count
        auto = self.requested is Mode.AUTO
        if auto:
            self._open_schedule(True)
        figures = Figures(
            layers=max(1, -(-self._expected // exact)) if counted else ASSUMED_LAYERS, layer_bytes=kept.data_bytes,
            slots=self.depth + 1, slot_bytes=layout.data_bytes + (kept.data_bytes if self._codec is not None else 0),
            device_budget=self.config.device_budget, host_budget=self.config.host_budget,
            pin_budget=pin_room(self.config.pin_budget, host_pins=self._host.pin is not None),
            free_device=free[0], free_host=free[1], pinnable=self._res.allocator.pin,
            unified=self._unified or same_pool_reason(self.device), counted=counted)
        self.plan = make_plan(Mode.AUTO if auto else self.mode, figures)
        if auto:
            self.mode = self.plan.mode
        counts = ", ".join(f"{place} {n}" for place, n in self.plan.counts().items() if n)
        log.info("KV offload%s: mode %s (%s), plan %s, storage %s, prefetch depth %d", self._tag,
                 self.mode.value, self.plan.reason, counts, self.config.storage, self.depth)

    @engine_mode
    def close(self) -> None:
        """Finishes or cancels outstanding transfers, then frees every buffer and deletes every file.

        Idempotent; runs the same on normal completion, interruption and exceptions. In a forked child it only
        marks the child's copy closed: the files, buffers and locks are the parent's (see `checks.Owner`).
        """
        if not self._owner.here:
            self.closed = True
            return
        with self._busy:
            self._close()

    def _close(self) -> None:
        self.closed = True  # first: no put or get from here on, however the rest ends
        if self._res is not None:
            self._res.close(self._tag)  # a no-op once whole; whole when called again after a Ctrl-C stopped it
        self._stats.emptied()

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __reduce_ex__(self, protocol):
        # pickle, copy and multiprocessing's spawn land here: its buffers, threads and files belong to this process
        raise TypeError(f"KVStore {self.name!r} cannot be pickled or copied: its device buffers, I/O threads and "
                        "files belong to this process. Create a store in the other process instead.")

    # -- put / get -------------------------------------------------------------------------------------------
    @engine_mode
    @one_consumer
    def put(self, key: Hashable, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores layer `key` once. The store takes a private copy; `k` and `v` stay the caller's."""
        self._check_open("put")
        if self.sealed:
            raise RuntimeError(f"KVStore.put: store {self.name!r} is sealed (kept for reuse, read-only); put into a "
                               "new store.")
        check_pair(key, k, v, self.device)
        if key in self._layers.layouts:
            raise ValueError(f"KVStore.put: layer {key!r} was already put; a store holds one prefix, put once. "
                             "Use a new store (or close this one) for a new request.")
        if self.plan is None:  # the host's figures first: a bad one raises before this store allocates anything
            free = self._free_figures()
        try:
            self._put(key, k, v, free if self.plan is None else None)
        except BaseException as exc:
            self._fail("put", exc)
            raise

    def _put(self, key: Hashable, k: torch.Tensor, v: torch.Tensor, free) -> None:
        whole = (k, v)
        k, v, rows = self.dedup.split(k, v)  # identical batch rows: one row goes on, checked on the device
        layout = layout_for(*whole) if rows == 1 else served_layout(*whole, k, v)
        if self._codec is not None:
            k, v = self._compact.encode(key, k, v)
        kept = layout_for(k, v) if self._compact.coded(key) or rows > 1 else layout
        if self.plan is None:
            self._make_plan(layout, kept, free)
        used = self._layers.used()
        place = self.plan.place_of(len(self._layers.layouts), kept.data_bytes, used[BUDGET_DEVICE], used[BUDGET_HOST])
        self._res.tier(place).store(key, k, v, kept)
        self._layers.add(key, layout, kept, place, rows)
        self._order.add(key)
        if place == DEVICE:
            self._stats.add_device(kept.tensor_bytes, layers=1)
        else:
            self._stats.count_transfer(kept.data_bytes)

    @engine_mode
    @one_consumer
    def get(self, key: Hashable) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer `key` on the device, in the dtype put (bit-identical for `storage="exact"`).

        Valid until the next `get` on this store or `close()`, and read-only: they are the store's own buffers
        (a write into them is detected at the next `get`, which raises). The next layers are prefetched meanwhile.
        """
        self._check_open("get")
        if key not in self._layers.layouts:
            raise KeyError(f"KVStore.get: layer {key!r} was never put into store {self.name!r}.")
        try:
            return self._res.ring.serve(key)
        except BaseException as exc:
            self._fail("get", exc)
            raise

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"KVStore.{what}: store {self.name!r} is closed; create a new store per request.")
        if self._broken is not None:
            raise RuntimeError(f"KVStore.{what}: store {self.name!r} is broken: {self._broken} stopped part-way, "
                               "so what it holds is unknown. Close it (close() frees everything) and use a new store.")

    def _fail(self, what: str, exc: BaseException) -> None:
        """`what` raised part-way (an error, Ctrl-C): the store is broken, since what it holds is unknown; every
        later call but `close()` and `stats()` says so, and `close()` frees everything, as a file object does
        after a failed write. A layer the disk could not take (`KVWriteError`) breaks nothing: none of it was
        kept, and the layers before it still serve (a host falls back on them). A try/except costs nothing on
        the get path; a context manager there cost 1 us a get."""
        if self._broken is None and not isinstance(exc, KVWriteError):
            self._broken = f"an earlier {what} ({type(exc).__name__})"

    @engine_mode
    def flush(self) -> None:
        """Waits until every layer put so far is in its place (on disk, for the file modes); raises the first
        error storing one (`KVWriteError` for a full disk). Never needed for correctness: a `get` waits for its
        own layer. For measuring, and for a caller that wants write errors at a point of its choosing."""
        self._owner.check("flush", self.name)
        self._check_open("flush")
        try:
            for tier in list(self._tiers.values()):
                tier.flush()
        except BaseException as exc:
            self._fail("flush", exc)
            raise

    @engine_mode
    def park(self) -> None:
        """Between requests (prefix reuse): seal the store and free its ring's device slots; the data stays.

        Outstanding loads finish first and the consumer's stream is synchronized, so no kernel still reads a
        slot when it is dropped. Afterwards `put` is refused and `get` works as it did (slots are made again on
        demand), from whichever thread the next request runs on. Idempotent; a no-op on a closed store. The
        first park waits for the file writes and raises a failed one (`KVWriteError`), leaving the store as it
        was.
        """
        self._owner.check("park", self.name)
        with self._busy:
            if self.closed or self._res is None:
                return
            self._check_open("park")
            try:
                if not self.sealed:
                    self._res.seal()
                self.sealed = True
                self._res.ring.empty()  # host slots a tier made go back to the OS, device slots to the allocator
            except BaseException as exc:
                self._fail("park", exc)
                raise
            self._stats.parked(self._layers.resident_bytes(), len(self._layers.resident))
            self._consumer.release()  # the next request's consumer owns it, one request at a time

    # -- reporting -------------------------------------------------------------------------------------------
    @property
    def reason(self) -> str:
        """Why the cache is where it is (`stats()["reason"]`): the plan in force, worded from the layers put so
        far (not from the expected count), or how the mode was granted ("requested", a fallback) where the plan
        has nothing to add; then what the tiers noted."""
        said = self._granted
        if self.plan is not None:
            words = self.plan.describe(self.placement(), self._layers.kept_bytes())
            said = words if words != "requested" else said
        return "; ".join([said, *(self._res.notes if self._res is not None else ())])

    def placement(self) -> Dict[str, int]:
        """Layers put so far, per place (what `stats()["plan"]` reports)."""
        return self._layers.placement()

    def kv_error(self) -> Optional[Dict[str, object]]:
        """The codec's error over every layer put, and the layers kept exact (`codec.Compact.summary`)."""
        return self._compact.summary()

    @staticmethod
    def check_config(config: OffloadConfig, device) -> torch.device:
        """Raises what `KVStore(config, device)` would raise for this pair, and makes nothing; returns the device.

        A host checks a user's choice with it where it learns the device, before it patches a model or starts a
        run (the ComfyUI node: a storage the device cannot decode fails on the node, not in the middle of
        sampling)."""
        return _check_config(config, device)

    def stats(self) -> dict:
        """A plain dict of what the store holds where, what it moved and how long the consumer waited."""
        res = self._res
        stored, info = res.stored(self.closed) if res is not None else ({}, {})
        return self._stats.as_dict(Snapshot(
            mode=self.mode.value if self.mode is not None else None, reason=self.reason, prefetch_depth=self.depth,
            closed=self.closed, layers=len(self._layers.layouts), plan=self.placement(), stored=stored, info=info,
            seconds=res.seconds() if res is not None else {"transfer": 0.0, "wait": 0.0},
            pinned_fallback=res.allocator.fallback_reason if res is not None else None, kv_error=self.kv_error(),
            dedup=self.dedup.as_dict()))


def _check_args(config, device, expected_bytes) -> torch.device:
    """The arguments of `KVStore(config, device, expected_bytes=...)` checked; returns the device."""
    if expected_bytes is not None and (isinstance(expected_bytes, bool) or not isinstance(expected_bytes, int)
                                       or expected_bytes < 0):
        raise ValueError(f"KVStore: `expected_bytes` must be a byte count >= 0; got {expected_bytes!r}.")
    return _check_config(config, device)


def _check_config(config, device) -> torch.device:
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"KVStore: `config` must be an OffloadConfig; got {type(config).__name__}.")
    if config.mode is Mode.OFF:
        raise ValueError("KVStore: mode 'off' means no KV cache, so there is nothing to store; "
                         "recompute the prefix instead of creating a store.")
    device = check_device(device)
    if config.storage == "fp8" and device.type == "mps":
        raise ValueError("KVStore: `storage` 'fp8' needs float8 kernels, which torch has no MPS version of; "
                         "got storage='fp8' on an mps device. Use storage='int8' there.")
    return device
