"""Telemetry hub: the memory readout's data, pushed to the page only while a run is active.

Lifecycle, driven by the model patches (never by a thread of our own):

    TELEMETRY.run_started(run_id, node)  # one push ("start"), tracked stores cleared; node: the Settings node's id
    TELEMETRY.track(name, store)      # a KVStore serving this run (held weakly); opens a "capture" mark
    TELEMETRY.track_section(key, obj)  # an object whose `summary()` is shown under payload[key] (the pose cache)
    TELEMETRY.step()                  # before each diffusion-model forward
    TELEMETRY.progress()              # inside a forward, e.g. after each captured layer
    TELEMETRY.forward_done()          # after each forward: refreshes every store's figures, closes the capture
    TELEMETRY.run_finished(run_id)    # one final push ("final", with a "release" mark), then idle

`step`, `progress` and `forward_done` push at most 4 times a second, all together: a capture step that takes
seconds shows its stores filling, and a push after each forward shows what that forward moved. The final
push is never throttled and counts every transfer (the stores' figures are refreshed after every forward,
so a store freed before the end still reports its last forward). `TELEMETRY.for_node(id)` is a view of the
hub that tags the runs it starts with a node id, so the Settings node's readout can show its own run.

`snapshot()` returns the latest payload (what `GET /kv_offload/stats` serves) and changes no state.
The sender (ComfyUI's `PromptServer.instance.send_sync`, thread-safe) and the clock are injected, so the hub
runs in tests without ComfyUI; this module never imports ComfyUI.

Payload (version `v` = 1; every unknown value is `None`, never -1):
    v, event ("start" | "step" | "final" | "idle"), time (unix seconds),
    run {id, node, active, forwards, elapsed_s, marks}: node is the id of the Settings node whose MODEL runs
        (None when unknown); marks: [{what: "capture" | "release", start_s, end_s}] in run seconds,
        "capture" from the first store of a forward to the end of that forward, "release" when the stores
        were freed (end of sampling, before the VAE decode),
    memory: `offload_core.memory_snapshot()` as is (it says which figures are this process, which the device),
    stores: one entry per tracked store, cond before uncond: its `stats()` without any path (no `file_dir`;
            `on_disk` instead; `dedup`: the batch rows kept against those put, shown per store) plus
            bandwidth_bytes_per_s, passes, exposed_wait_per_pass_s, scope="process",
    totals: bytes per location summed over the stores, device_bytes, exposed_wait_s, exposed_wait_per_forward_s,
    animate2_cache (Wan Animate 2 only): {windows, hits, fills, evictions, per_window: {name: readout line}}.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
import weakref
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

EVENT = "kv_offload.memory"
PAYLOAD_VERSION = 1
MIN_PUSH_INTERVAL_S = 0.25  # at most 4 pushes per second during a run
BYTE_KEYS = ("device", "host_pinned", "host_pageable", "file")
# Never published: any client of the server gets the payload, and a cache path would tell it where K/V of
# another user's images lies on disk. `on_disk` (bool) says whether a store has files.
PRIVATE_KEYS = ("file_dir",)

Sender = Callable[[str, dict], Any]


def _default_memory_snapshot(device=None) -> dict:
    from ..offload_core import memory_snapshot  # lazy: the engine imports torch

    return memory_snapshot(device)


def to_json(value: Any) -> Any:
    """Plain JSON types only: enums to their value, tuples to lists, NaN/inf to None (JSON.parse rejects NaN)."""
    if isinstance(value, enum.Enum):
        return to_json(value.value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v) for v in value]
    return str(value)


def _reuse_snapshot() -> Optional[dict]:
    """What prefix reuse holds (hits, misses, bytes, evictions, on/off and why); None if unavailable."""
    try:
        from .reuse import REUSE

        return REUSE.snapshot()
    except Exception:  # the readout must never break sampling
        log.debug("reuse snapshot failed", exc_info=True)
        return None


def _summary(ref) -> Optional[dict]:
    obj = ref()
    try:
        return obj.summary() if obj is not None else None
    except Exception:  # the readout must never break sampling
        log.debug("summary() of a readout section failed", exc_info=True)
        return None


def _ratio(num: Any, den: Any) -> Optional[float]:
    if not isinstance(num, (int, float)) or not isinstance(den, (int, float)) or den <= 0:
        return None
    return num / den


def derive_store(stats: dict) -> dict:
    """A store's `stats()` plus the rates the readout shows.

    bandwidth = transfer bytes / transfer seconds (None before the first timed transfer);
    bytes_while_open = the store's `bytes` when it was last seen open (a closed store holds nothing);
    passes = gets / layers (how many times the store has served its whole prefix: one per cached step of
    its branch); exposed wait per pass = exposed_wait_s / passes.
    """
    out = {k: v for k, v in stats.items() if k not in PRIVATE_KEYS}
    out["on_disk"] = bool(stats.get("file_dir"))
    out.setdefault("bytes_while_open", None)
    transfers = stats.get("transfers") or {}
    out["bandwidth_bytes_per_s"] = _ratio(transfers.get("bytes"), transfers.get("seconds"))
    passes = _ratio(stats.get("gets"), stats.get("layers"))
    out["passes"] = passes
    out["exposed_wait_per_pass_s"] = _ratio(stats.get("exposed_wait_s"), passes) if passes else None
    out["scope"] = "process"
    return out


def _sum_known(values: list) -> Optional[float]:
    known = [v for v in values if isinstance(v, (int, float))]
    return sum(known) if known else None


def totals(stores: list, forwards: int) -> dict:
    byte_totals = {key: _sum_known([(s.get("bytes") or {}).get(key) for s in stores]) for key in BYTE_KEYS}
    wait = _sum_known([s.get("exposed_wait_s") for s in stores])
    return {
        "stores": len(stores),
        "bytes": byte_totals,
        "device_bytes": _sum_known([s.get("device_bytes") for s in stores]),
        "exposed_wait_s": wait,
        "exposed_wait_per_forward_s": _ratio(wait, forwards) if wait is not None else None,
    }


def store_order(name: str) -> tuple:
    """Sort key of store names: "cond", "cond 2", ..., then "uncond", "uncond 2", ..., then any other."""
    base, _, number = str(name).partition(" ")
    rank = {"cond": 0, "uncond": 1}.get(base, 2)
    return rank, base, int(number) if number.isdigit() else 1, str(name)


class TelemetryHub:
    """Collects per-run KV store stats and memory figures; pushes them only while a run is active.

    Thread-safety: `step()` runs on the sampling thread, `snapshot()` on the server's thread; one lock guards
    the state, and payloads are also sent under it so they reach the page in the order they were built
    (`send_sync` only queues the message on the server's loop, so this never blocks for long).
    """

    def __init__(self, send: Optional[Sender] = None, clock: Callable[[], float] = time.monotonic,
                 memory: Callable[..., dict] = _default_memory_snapshot,
                 min_interval_s: float = MIN_PUSH_INTERVAL_S) -> None:
        self._send = send
        self._clock = clock
        self._memory = memory
        self._min_interval_s = min_interval_s
        self._lock = threading.RLock()  # re-entrant: a sender may read snapshot()
        self._run_id: Optional[str] = None
        self._started_at: Optional[float] = None
        self._forwards = 0
        self._last_push: Optional[float] = None
        self._stores: dict = {}       # name -> weakref (or strong ref when the object refuses weakrefs)
        self._last_stats: dict = {}   # name -> last stats() seen, kept when the store object is gone
        self._latest: Optional[dict] = None
        self._device = None           # the host's compute device; None: the engine's default
        self._node: Optional[str] = None
        self._marks: list = []        # [{what, start_s, end_s}] of the current run
        self._capture: Optional[dict] = None  # the open capture mark
        self._sections: dict = {}     # payload key -> weakref to an object with summary()

    def set_device(self, device) -> None:
        """Report memory of `device` (e.g. ComfyUI's torch device) when no tracked store names one."""
        self._device = device

    def set_sender(self, send: Optional[Sender]) -> None:
        """Inject the push function (PromptServer.instance.send_sync); None sends nothing."""
        self._send = send

    @property
    def active(self) -> bool:
        return self._run_id is not None

    def for_node(self, node_id: Any) -> "NodeTelemetry":
        """This hub, with the runs it starts tagged as runs of node `node_id` (the Settings node's id)."""
        return NodeTelemetry(self, node_id)

    def run_started(self, run_id: str, node: Any = None) -> None:
        with self._lock:
            self._run_id = str(run_id)
            self._node = None if node is None else str(node)
            self._started_at = self._clock()
            self._forwards = 0
            self._stores.clear()
            self._last_stats.clear()
            self._marks = []
            self._capture = None
            self._sections.clear()
            self._push(self._build("start"))

    def track(self, name: str, store: Any) -> None:
        """Show `store` (a KVStore serving the current run) in the readout until the run ends."""
        with self._lock:
            if self._run_id is None:
                return
            try:
                ref = weakref.ref(store)
            except TypeError:
                ref = lambda s=store: s  # noqa: E731 - dropped at run end like the weak ones
            self._stores[str(name)] = ref
            if self._capture is None:  # a new store is being filled: this forward captures
                self._capture = {"what": "capture", "start_s": self._elapsed(), "end_s": None}
                self._marks.append(self._capture)

    def track_section(self, key: str, obj: Any) -> None:
        """Show `obj.summary()` (a plain dict) under `key` in this run's payloads, the final one included."""
        with self._lock:
            if self._run_id is not None:
                self._sections[str(key)] = weakref.ref(obj)

    def step(self) -> None:
        """Count one forward (called before it runs); push when the rate limit allows."""
        with self._lock:
            if self._run_id is None:
                return
            self._forwards += 1
            self._push_or_refresh()

    def progress(self) -> None:
        """Push mid-forward when the rate limit allows (a capture step fills its stores for seconds).

        Cheap when throttled: one clock read, no store is asked for its figures."""
        with self._lock:
            if self._run_id is not None and self._may_push():
                self._push(self._build("step"))

    def forward_done(self) -> None:
        """After a forward: close an open capture mark; push what the forward moved when the rate limit allows."""
        with self._lock:
            if self._run_id is None:
                return
            if self._capture is not None:
                self._capture["end_s"] = self._elapsed()
                self._capture = None
            self._push_or_refresh()

    def run_finished(self, run_id: Optional[str] = None) -> None:
        """Push one final snapshot of the run and go idle. A finish for another run id is ignored."""
        with self._lock:
            if self._run_id is None or (run_id is not None and str(run_id) != self._run_id):
                return
            if self._capture is not None:  # interrupted mid-capture
                self._capture["end_s"] = self._elapsed()
                self._capture = None
            if self._stores:
                at = self._elapsed()
                self._marks.append({"what": "release", "start_s": at, "end_s": at})
            self._push(self._build("final"))
            self._run_id = None
            self._node = None
            self._started_at = None
            self._stores.clear()
            self._last_stats.clear()
            self._last_push = None
            self._marks = []
            self._sections.clear()

    def snapshot(self) -> dict:
        """The latest pushed payload; before any run, a fresh idle one (not stored, nothing sent)."""
        with self._lock:
            if self._latest is not None:
                return self._latest
            return to_json(self._payload("idle"))

    # -- internals (call with the lock held) --

    def _elapsed(self) -> Optional[float]:
        return self._clock() - self._started_at if self._started_at is not None else None

    def _may_push(self) -> bool:
        return self._last_push is None or self._clock() - self._last_push >= self._min_interval_s

    def _push_or_refresh(self) -> None:
        if self._may_push():
            self._push(self._build("step"))
            return
        # Refresh the stores' figures anyway: they may be closed and gone before the final push.
        for name, ref in self._stores.items():
            self._store_stats(name, ref)

    def _collect_stores(self) -> list:
        named = sorted(self._stores.items(), key=lambda item: store_order(item[0]))
        return [derive_store(stats) for stats in (self._store_stats(n, r) for n, r in named) if stats is not None]

    def _store_stats(self, name: str, ref) -> Optional[dict]:
        """Fresh stats of a live store; for a store already gone, its last stats marked closed."""
        previous = self._last_stats.get(name)
        store = ref()
        if store is None:
            if previous is None or previous.get("closed"):
                return previous
            stats = dict(previous, closed=True, bytes={k: None for k in BYTE_KEYS}, device_bytes=None)
        else:
            try:
                stats = dict(store.stats())
            except Exception:  # a store torn down mid-call: keep its last figures
                log.debug("stats() of KV store %r failed", name, exc_info=True)
                return previous
            stats.setdefault("name", name)
        if stats.get("closed"):  # a closed store holds nothing: keep what it held while open, for the readout
            stats["bytes_while_open"] = (previous or {}).get("bytes_while_open") or (
                None if (previous or {}).get("closed") else (previous or {}).get("bytes"))
        self._last_stats[name] = stats
        return stats

    def _payload(self, event: str) -> dict:
        stores = self._collect_stores()
        device = next((s.get("device") for s in stores if s.get("device")), None) or self._device
        try:
            memory = self._memory(device)
        except Exception:
            log.debug("memory snapshot failed", exc_info=True)
            memory = None
        return {
            "v": PAYLOAD_VERSION,
            "event": event,
            "time": time.time(),
            "run": {"id": self._run_id, "node": self._node, "active": event in ("start", "step"),
                    "forwards": self._forwards if self._run_id else None, "elapsed_s": self._elapsed(),
                    "marks": [dict(m) for m in self._marks]},
            "memory": memory,
            "stores": stores,
            "totals": totals(stores, self._forwards),
            "reuse": _reuse_snapshot(),
            **{key: _summary(ref) for key, ref in self._sections.items()},
        }

    def _build(self, event: str) -> dict:
        payload = to_json(self._payload(event))
        self._latest = payload
        self._last_push = self._clock()
        return payload

    def _push(self, payload: dict) -> None:
        send = self._send
        if send is None:
            return
        try:
            send(EVENT, payload)
        except Exception:  # the readout must never break sampling
            log.warning("could not push %s", EVENT, exc_info=True)


class NodeTelemetry:
    """The hub as one Settings node sees it: the runs it starts carry that node's id; the rest is the hub's."""

    def __init__(self, hub: TelemetryHub, node_id: Any) -> None:
        self.hub = hub
        self.node_id = None if node_id is None else str(node_id)

    def run_started(self, run_id: str) -> None:
        self.hub.run_started(run_id, node=self.node_id)

    def __getattr__(self, name: str) -> Any:  # track, step, progress, forward_done, run_finished, ...
        if name.startswith("__") or name == "hub":  # copy / pickle probe these before __init__ ran
            raise AttributeError(name)
        return getattr(self.hub, name)


TELEMETRY = TelemetryHub()
