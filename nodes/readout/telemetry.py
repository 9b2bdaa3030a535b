"""Telemetry hub: the memory readout's data, pushed to the page only while a run is active.

Lifecycle, driven by the model patches (never by a thread of our own):

    TELEMETRY.run_started(run_id, node)  # one push ("start"), tracked stores cleared; node: the Settings node's id
    TELEMETRY.track(name, store)      # a KVStore serving this run (held weakly); opens a "capture" mark
    TELEMETRY.track_section(key, obj)  # an object whose `summary()` is shown under payload[key] (the pose cache)
    TELEMETRY.step()                  # before each diffusion-model forward
    TELEMETRY.progress()              # inside a forward, e.g. after each captured layer
    TELEMETRY.forward_done()          # after each forward: refreshes every store's figures, closes the capture
    TELEMETRY.note(text)              # a line the run says of itself (why the cache stepped aside), until it ends
    TELEMETRY.run_finished(run_id)    # one final push ("final", with a "release" mark), then idle

`step`, `progress` and `forward_done` push at most 4 times a second, all together: a capture step that takes
seconds shows its stores filling, and a push after each forward shows what that forward moved. The final
push is never throttled and counts every transfer (the stores' figures are refreshed after every forward,
so a store freed before the end still reports its last forward). `TELEMETRY.for_node(id)` is a view of the
hub that tags the runs it starts with a node id, so the Settings node's readout can show its own run.

`snapshot()` returns the latest payload (what `GET /kv_offload/stats` serves) and changes no state.
The sender (ComfyUI's `PromptServer.instance.send_sync`, thread-safe) and the clock are injected, so the hub
runs in tests without ComfyUI; this module never imports ComfyUI.

The payload (version `v` = 1; every unknown value is `None`, never -1) is described in docs/monitor.md: the
run and its marks, `memory` (`offload_core.memory_snapshot()`), `stores` and `totals` (`figures.py`),
`reuse` (`nodes/run/reuse.py`) and, for Wan Animate 2, `animate2_cache` (the pose cache's `summary()`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional

from .figures import StoreFigures, per_device, to_json, totals
from .protocol import Readout, log_failure
from ..run.reuse import REUSE

log = logging.getLogger(__name__)

EVENT = "kv_offload.memory"
PAYLOAD_VERSION = 1
MIN_PUSH_INTERVAL_S = 0.25  # at most 4 pushes per second during a run

Sender = Callable[[str, dict], Any]

def _default_memory_snapshot(device=None) -> dict:
    from ...offload_core import memory_snapshot  # lazy: the engine imports torch

    return memory_snapshot(device)


def _caught(what: str, read: Callable[[], Any]) -> Any:
    """`read()`, or None (unknown) when it raises: one section of the payload must not cost the others."""
    try:
        return read()
    except Exception:
        log_failure(what)
        return None


class TelemetryHub(Readout):
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
        self._latest: Optional[dict] = None
        self._device = None  # the host's compute device; None: the engine's default
        self._stores = StoreFigures()
        self._idle()

    def _idle(self) -> None:
        """No run: what `run_started` sets afresh and `run_finished` drops."""
        self._run_id: Optional[str] = None
        self._node: Optional[str] = None
        self._started_at: Optional[float] = None
        self._forwards = 0
        self._last_push: Optional[float] = None
        self._stores.clear()
        self._marks: list = []  # [{what, start_s, end_s}] of the current run
        self._capture: Optional[dict] = None  # the open capture mark
        self._sections: dict = {}  # payload key -> weakref to an object with summary()
        self._notes: list = []  # what the run says of itself (the cache stepped aside, the compiler turned off)

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
            self._idle()
            self._run_id = str(run_id)
            self._node = None if node is None else str(node)
            self._started_at = self._clock()
            self._push(self._build("start"))

    def track(self, name: str, store: Any) -> None:
        """Show `store` (a KVStore serving the current run) in the readout until the run ends."""
        with self._lock:
            if self._run_id is None:
                return
            self._stores.track(name, store)
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
            self._end_capture()
            self._push_or_refresh()

    def note(self, text: str) -> None:
        """Show `text` under the run (`run.notes`) until it ends; pushed with the next payload."""
        with self._lock:
            if self._run_id is not None and text not in self._notes:
                self._notes.append(str(text))

    def run_finished(self, run_id: Optional[str] = None) -> None:
        """Push one final snapshot of the run and go idle. A finish for another run id is ignored."""
        with self._lock:
            if self._run_id is None or (run_id is not None and str(run_id) != self._run_id):
                return
            self._end_capture()  # interrupted mid-capture
            if self._stores:
                at = self._elapsed()
                self._marks.append({"what": "release", "start_s": at, "end_s": at})
            self._push(self._build("final"))
            self._idle()

    def snapshot(self) -> dict:
        """The latest pushed payload; before any run, a fresh idle one (not stored, nothing sent)."""
        with self._lock:
            if self._latest is not None:
                return self._latest
            return to_json(self._payload("idle"))

    # -- internals (call with the lock held) --

    def _elapsed(self) -> Optional[float]:
        return self._clock() - self._started_at if self._started_at is not None else None

    def _end_capture(self) -> None:
        if self._capture is not None:
            self._capture["end_s"] = self._elapsed()
            self._capture = None

    def _may_push(self) -> bool:
        return self._last_push is None or self._clock() - self._last_push >= self._min_interval_s

    def _push_or_refresh(self) -> None:
        if self._may_push():
            self._push(self._build("step"))
        else:
            self._stores.refresh()

    def _payload(self, event: str) -> dict:
        stores = self._stores.collect()
        device = next((s.get("device") for s in stores if s.get("device")), None) or self._device
        memory = _caught("memory snapshot", lambda: self._memory(device))
        read = {str(device): memory}  # each device's figures read once per payload

        def device_memory(d: str) -> Optional[dict]:
            if d not in read:
                read[d] = _caught(f"memory snapshot of {d}", lambda: self._memory(d))
            return read[d]

        return {
            "v": PAYLOAD_VERSION,
            "event": event,
            "time": time.time(),
            "run": {"id": self._run_id, "node": self._node, "active": event in ("start", "step"),
                    "forwards": self._forwards if self._run_id else None, "elapsed_s": self._elapsed(),
                    "marks": [dict(m) for m in self._marks], "notes": list(self._notes)},
            "memory": memory,
            "stores": stores,
            "totals": totals(stores, self._forwards),
            "devices": _caught("device figures", lambda: per_device(stores, device_memory)),
            "reuse": _caught("reuse snapshot", REUSE.snapshot),
            **{key: _caught(f"{key} summary", lambda ref=ref: _summary(ref)) for key, ref in self._sections.items()},
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
        except Exception:  # the readout must never break sampling: the page misses this push, said once
            log_failure(f"push of {EVENT}")


def _summary(ref) -> Optional[dict]:
    obj = ref()
    return obj.summary() if obj is not None else None


class NodeTelemetry(Readout):
    """The hub as one Settings node sees it: the runs it starts carry that node's id; the rest is the hub's."""

    def __init__(self, hub: TelemetryHub, node_id: Any) -> None:
        self.hub = hub
        self.node_id = None if node_id is None else str(node_id)

    def run_started(self, run_id: str) -> None:
        self.hub.run_started(run_id, node=self.node_id)

    def track(self, name: str, store: Any) -> None:
        self.hub.track(name, store)

    def track_section(self, key: str, obj: Any) -> None:
        self.hub.track_section(key, obj)

    def step(self) -> None:
        self.hub.step()

    def progress(self) -> None:
        self.hub.progress()

    def forward_done(self) -> None:
        self.hub.forward_done()

    def note(self, text: str) -> None:
        self.hub.note(text)

    def run_finished(self, run_id: Optional[str] = None) -> None:
        self.hub.run_finished(run_id)


TELEMETRY = TelemetryHub()
