"""What a run tells the memory readout, as methods: the null readout, and the wrapper that keeps sampling safe from it.

`Readout` is the protocol and its null object (every call does nothing), so `run.telemetry.step()` is always
valid and a misspelt call is an `AttributeError`. `safe(readout)` wraps any readout (the hub, a node's view
of it, a test's recorder) so that none of its failures reaches sampling: each is logged, at WARNING the first
time per call and at DEBUG after that.

No ComfyUI import.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ..once import warn_once

log = logging.getLogger(__name__.rsplit(".", 1)[0] + ".telemetry")  # one logger for the readout's failures


def log_failure(what: str) -> None:
    warn_once(log, f"readout: {what}", "KV Offload: the memory readout's %s failed", what)


class Readout:
    """The readout's calls during a run; this base class does nothing (no readout)."""

    def run_started(self, run_id: str) -> None:
        """A sampling run starts (`run_id`: 12 hex digits)."""

    def track(self, name: str, store: Any) -> None:
        """Show `store` (a KVStore serving the run) as `name` until the run ends."""

    def track_section(self, key: str, obj: Any) -> None:
        """Show `obj.summary()` under `key` in the run's payloads."""

    def step(self) -> None:
        """Before each diffusion-model forward."""

    def progress(self) -> None:
        """Inside a forward, e.g. after each captured layer."""

    def forward_done(self) -> None:
        """After each forward."""

    def note(self, text: str) -> None:
        """Say `text` with the run (e.g. why the cache stepped aside), in every payload until the run ends."""

    def run_finished(self, run_id: str) -> None:
        """The run `run_id` ended (completed, interrupted or failed)."""


NO_READOUT = Readout()


class SafeReadout(Readout):
    """`inner`'s calls, each caught: a failing readout is logged and sampling goes on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def _call(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception:  # the readout runs inside sampling and must never break it
            log_failure(f"{what}()")

    def run_started(self, run_id: str) -> None:
        self._call("run_started", lambda: self.inner.run_started(run_id))

    def track(self, name: str, store: Any) -> None:
        self._call("track", lambda: self.inner.track(name, store))

    def track_section(self, key: str, obj: Any) -> None:
        self._call("track_section", lambda: self.inner.track_section(key, obj))

    def step(self) -> None:
        self._call("step", lambda: self.inner.step())

    def progress(self) -> None:
        self._call("progress", lambda: self.inner.progress())

    def forward_done(self) -> None:
        self._call("forward_done", lambda: self.inner.forward_done())

    def note(self, text: str) -> None:
        self._call("note", lambda: self.inner.note(text))

    def run_finished(self, run_id: str) -> None:
        self._call("run_finished", lambda: self.inner.run_finished(run_id))


def safe(readout: Optional[Any]) -> Readout:
    """The readout to call during a run: the null one for None, `readout` wrapped in `SafeReadout` otherwise."""
    if readout is None or type(readout) is Readout:
        return NO_READOUT
    return readout if isinstance(readout, SafeReadout) else SafeReadout(readout)
