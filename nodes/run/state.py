"""Per-run state of the reference K/V cache: one engine `KVStore` per cond, alive for one sampling run.

The node's MODEL output is cached by ComfyUI across prompts and `ModelPatcher.clone()` shares patch
objects, so nothing here lives on a patch object. A `RunState` is created by the outer-sample wrapper
(`nodes/run/wrappers.py`), put into that run's copy of `transformer_options` under `RUN_KEY`, and
closed in the wrapper's `finally` -- on normal completion, on `InterruptProcessingException` and on any
error. A new prompt, a new reference or a new model therefore always starts from empty stores.

Stores are keyed by the cond's `uuid` (`transformer_options["uuids"]`), never by block alone: cond and
uncond may be batched together or not, and the batching may change from step to step.

This module imports no ComfyUI.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid as _uuid
from typing import Callable, Hashable, Optional

import torch

from ...offload_core.tiers import KVWriteError
from .branch import CACHED, CAPTURE, PASS, BranchCache, ForwardState, ForwardWatcher, RunExtension, layer_bytes
from ..keys import MULTI_GPU_KEY, RUN_KEY
from ..once import warn_once
from ..readout.protocol import safe
from .stores import StoreOpener

log = logging.getLogger(__name__)

WRITE_FAILED = "the cache files could not be written, so caching is off for this run ({})"


class RunState:
    """The stores of one sampling run.

    Args:
        config: `OffloadConfig` (mode other than "off").
        host: `HostServices` for this run (or None).
        n_layers: attention layers per forward (for the store's expected size).
        store_factory: None: each store is a `KVStore`; tests pass a stand-in with its signature.
        telemetry: the readout (the hub, a node's view of it) or None; every call is caught (`nodes/readout/protocol.py`).
        devices: the family serves multi-GPU sampling's threads (`live_run`).
        patcher, model_options: the ModelPatcher sampling and the options that reach the forward (what prefix
            reuse keys by).
    """

    def __init__(self, config, host, n_layers: int, store_factory: Optional[Callable] = None, telemetry=None,
                 run_id: Optional[str] = None, *, devices: bool = False, patcher=None,
                 model_options: Optional[dict] = None):
        self.config = config
        self.host = host
        self.n_layers = max(int(n_layers), 1)
        self.telemetry = safe(telemetry)
        self.opener = StoreOpener(host, self.telemetry, store_factory)  # opens and tracks every store of the run
        self.run_id = run_id or _uuid.uuid4().hex[:12]
        self.branches: dict[Hashable, BranchCache] = {}
        self._local = threading.local()  # this thread's forward in progress (`forward`), its device and model
        self._active: dict[int, ForwardState] = {}  # thread ident -> its forward in progress
        self.devices = devices  # multi-GPU sampling: one forward per device's thread at a time
        self.patcher, self.model_options = patcher, model_options
        self.forwards = 0
        self.closed = False
        self.stood_down: Optional[str] = None  # why the cache stepped aside for the rest of the run
        self._lock = threading.RLock()  # guards `branches` (threads of multi-GPU sampling add and drop them)
        self.extensions: dict[Hashable, RunExtension] = {}  # a family's own state, under its own key object
        self.watchers: list[ForwardWatcher] = []  # told of each forward (prefix reuse times them: nodes/run/reuse.py)

    # --- one forward -----------------------------------------------------------------------------------
    @property
    def forward(self) -> Optional[ForwardState]:
        """The forward in progress on this thread (multi-GPU sampling runs one per device's thread)."""
        return getattr(self._local, "forward", None)

    @forward.setter
    def forward(self, fwd: Optional[ForwardState]) -> None:
        self._local.forward = fwd
        if fwd is None:
            self._active.pop(threading.get_ident(), None)
        else:
            self._active[threading.get_ident()] = fwd

    def bind_thread(self, device, model) -> None:
        """This thread's forwards from now on: ComfyUI's device for the thread under multi-GPU sampling (None on
        one device) and the diffusion model it runs there (each device runs its own copy)."""
        self._local.device, self._local.model = device, model

    @property
    def thread_device(self):
        """ComfyUI's device of this thread's forwards under multi-GPU sampling, else None (`bind_thread`)."""
        return getattr(self._local, "device", None)

    @property
    def thread_model(self):
        """The diffusion model this thread's forwards run, once a forward began on it (`bind_thread`), else None."""
        return getattr(self._local, "model", None)

    def begin_forward(self, uuids, ref_tokens: int, batch: int) -> ForwardState:
        """Decide the phase of this forward; called from the post-input patch, before any block runs.

        cached: every cond in the batch has a complete capture with the same reference length -> the
        reference tokens are dropped from the sequence and fed back from the stores. capture: the conds
        without one capture this forward (a half-captured cond from an aborted forward starts over).
        """
        uuids = list(uuids or [])
        if self.closed or self.stood_down or ref_tokens <= 0 or not uuids or batch % len(uuids):
            self.forward = ForwardState(PASS, uuids)
            return self.forward
        rows = batch // len(uuids)
        ready = [self._ready(u, ref_tokens) for u in uuids]
        if all(ready):
            self.forward = ForwardState(CACHED, uuids, rows, ref_tokens)
            return self.forward
        capture = frozenset(u for u, ok in zip(uuids, ready) if not ok)
        with self._lock:
            for u in capture:
                self.drop_branch(u)
                self.branches[u] = BranchCache(ref_tokens=ref_tokens, rows=rows)
        self.forward = ForwardState(CAPTURE, uuids, rows, ref_tokens, capture)
        return self.forward

    def end_forward(self, ok: bool) -> None:
        """Close the forward: a capture is complete only if its forward ran to the end.

        Then the watchers and the readout are told (after the drop of an incomplete capture, so it never shows
        one as kept)."""
        did, self._local.did = getattr(self._local, "did", None) or (), None
        try:
            self._end_forward(ok)
            phase = CAPTURE if CAPTURE in did else CACHED if CACHED in did else PASS
            for watcher in self.watchers:
                watcher.end(phase)
        finally:
            self.telemetry.forward_done()

    def _end_forward(self, ok: bool) -> None:
        fwd, self.forward = self.forward, None
        self.forwards += 1
        if fwd is not None and self.stood_down:  # another thread stood the run down while this forward ran
            for u in fwd.uuids:
                self.drop_branch(u)
            return
        if fwd is None or fwd.phase != CAPTURE:
            return
        for u in fwd.capture:
            branch = self.branches.get(u)
            if branch is None:
                continue
            # every layer must have been seen: a capture with a layer missing would fail or be recomputed later
            if ok and len(branch.layers) == self.n_layers:
                try:
                    branch.store.flush()  # the file modes write in the background: their errors surface here
                except KVWriteError as exc:
                    self.stand_down(WRITE_FAILED.format(exc))
                    return
                branch.complete = True
            else:
                self.drop_branch(u)

    def _ready(self, u, ref_tokens: int) -> bool:
        b = self.branches.get(u)
        return b is not None and b.complete and b.ref_tokens == ref_tokens

    # --- layer traffic ----------------------------------------------------------------------------------
    def put(self, u, layer: Hashable, k: torch.Tensor, v: torch.Tensor, label: str = "cond") -> None:
        """Hand one layer's reference K/V of cond `u` to its store (the store copies).

        `label` ("cond" / "uncond") names the store in logs and in the memory readout.
        """
        if self.stood_down:  # e.g. the disk filled up earlier in this forward: the capture is off
            return
        branch = self.branches[u]
        if branch.store is None:
            # The stores of one forward each plan their places at their first put, against the same free memory: size
            # each for all conds captured together, so `auto` never books the same free VRAM / RAM twice.
            together = max(len(self.forward.capture), 1) if self.forward is not None else 1
            branch.name = self.unique_name(label)
            branch.store = self.open_store(branch.name, self.thread_device or k.device,
                                           layer_bytes(k, v) * self.n_layers * together)
        try:
            with self.opener.planning(self.devices and not branch.layers):  # its first put: where the store plans
                branch.store.put(layer, k, v)
        except KVWriteError as exc:
            # Disk full or failing during the capture. This forward computes every layer from the full input
            # anyway, so stepping aside (recompute each step, no extra VRAM) finishes the generation, where
            # moving the cache to the GPU could run out of the VRAM a file mode was picked to save.
            self.stand_down(WRITE_FAILED.format(exc))
            return
        branch.layers.add(layer)
        self._did(CAPTURE)
        self.telemetry.progress()  # a capture step can take seconds: the readout shows the stores filling

    def get(self, u, layer: Hashable):
        """(k, v) of cond `u` at `layer`, on the compute device; valid until the next get on that store."""
        branch = self.branches[u]
        if layer not in branch.layers:
            raise RuntimeError(
                f"KV Offload: no cached reference K/V for layer {layer!r} of cond {u}; the model ran a layer "
                "on a cached step that it did not run on the capture step. Use mode 'off' for this graph."
            )
        out = branch.store.get(layer)
        self._did(CACHED)
        return out

    def _did(self, phase: str) -> None:
        """Note what this thread's forward does with the stores (what `end_forward` tells the watchers)."""
        did = getattr(self._local, "did", None)
        if did is not None:
            did.add(phase)

    def paused(self):
        """A context in which this thread's device allocations are not recorded by the host's allocation graph
        (`HostServices.pause_graph`): for a tensor a family makes inside a block that must outlive the block."""
        pause = getattr(self.host, "pause_graph", None)
        return pause() if pause is not None else contextlib.nullcontext()

    # --- stores -------------------------------------------------------------------------------------------
    def unique_name(self, label: str) -> str:
        """"cond", "uncond", "cond 2", ...: unique among this run's live stores (the readout keys by name)."""
        with self._lock:
            taken = {b.name for b in self.branches.values() if b.store is not None}
        return next(n for n in (label, *(f"{label} {i}" for i in range(2, len(taken) + 2))) if n not in taken)

    def add_branch(self, u: Hashable, branch: BranchCache) -> BranchCache:
        """Keep `branch` under `u` (a family's prefix entry or pose window); safe beside other threads' calls."""
        with self._lock:
            self.branches[u] = branch
        return branch

    def open_store(self, name: str, device, expected_bytes: int, config=None):
        """A new store of this run (`config`: the run's unless given), shown in the readout as `name`."""
        others = (lambda: self._stores_beside(name)) if self.devices else None
        return self.opener.open(name, self.config if config is None else config, device, expected_bytes,
                                requested=self.config.mode, others=others)

    def _stores_beside(self, name: str) -> list:
        """The run's open stores but `name`: under multi-GPU sampling, what a new store shares the host's RAM with."""
        with self._lock:
            return [b.store for b in self.branches.values() if b.store is not None and b.name != name]

    def track_store(self, name: str, store) -> None:
        """Show `store` in the readout as `name`, and warn once if it runs in another mode than the one asked."""
        self.opener.track(name, store, self.config.mode)

    # --- lifetime ---------------------------------------------------------------------------------------
    def stand_down(self, reason: str) -> None:
        """Step aside for the rest of the run: close every store, pass every later forward through.

        Safe from several threads at once (one warning). The stores another thread's forward reads right now are
        closed when that forward ends (`end_forward`): a store is closed only by, or after, its own thread."""
        with self._lock:
            if self.stood_down:
                return
            self.stood_down = reason
            log.warning("KV Offload: %s; the reference K/V is recomputed every step for this run.", reason)
        self.telemetry.note(f"stood down: {reason}; the reference K/V is recomputed every step for this run")
        self.forward = None
        busy = {u for fwd in list(self._active.values()) for u in fwd.uuids}
        errors = self._close_branches([u for u in list(self.branches) if u not in busy])
        interrupt = next((e for e in errors if not isinstance(e, Exception)), None)
        for e in errors:  # the run goes on without the cache: a store that failed to close must not end it
            if e is not interrupt:
                log.warning("KV Offload: closing a KV store failed while the cache stood down (%s: %s); the run "
                            "goes on without it", type(e).__name__, e, exc_info=(type(e), e, e.__traceback__))
        if interrupt is not None:  # only now that every other store is closed
            raise interrupt

    def step(self, device=None) -> None:
        """Before each forward (`device`: where it computes, None when unknown): the readout, then the watchers."""
        self.telemetry.step()
        self._local.did = set()
        for watcher in self.watchers:
            watcher.begin(device)

    def drop_branch(self, u) -> None:
        """Forget what `u` keys (a cond's branch, a prefix entry, a pose window), closing its store; nothing if gone."""
        with self._lock:
            branch = self.branches.pop(u, None)
        if branch is not None and branch.store is not None:
            branch.store.close()

    def _close_branches(self, keys) -> list:
        """Drop the branches `keys`, each even when closing another failed; the failures, in order."""
        errors = []
        for u in keys:
            try:
                self.drop_branch(u)
            except BaseException as e:  # close the others anyway, also after a Ctrl-C in one close
                errors.append(e)
        return errors

    def close(self) -> None:
        """Close every store (finishes or cancels transfers, frees buffers, deletes files). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.forward = None
        errors = self._close_branches(list(self.branches))
        self.branches.clear()
        self._remove_temp_dir()
        if errors:  # an interrupt first: it must not be replaced by an error from another store
            first = next((e for e in errors if not isinstance(e, Exception)), errors[0])
            for e in errors:
                if e is not first:  # raised is only one: the others are logged, never lost
                    log.warning("KV Offload: closing another KV store of the run also failed",
                                exc_info=(type(e), e, e.__traceback__))
            raise first

    # --- a family's own state -------------------------------------------------------------------------------
    def extension(self, key: Hashable) -> Optional[RunExtension]:
        """The state the family that owns `key` keeps for this run, or None."""
        return self.extensions.get(key)

    def add_extension(self, key: Hashable, ext: RunExtension) -> RunExtension:
        """Keep `ext` for this run under the family's `key`; freed when the run ends (`close_extensions`)."""
        self.extensions[key] = ext
        return ext

    def close_extensions(self) -> None:
        """Free every family's state, after `close` (each `free()` is idempotent)."""
        for ext in list(self.extensions.values()):
            ext.free()

    def _remove_temp_dir(self) -> None:
        # The host's per-run directory (see nodes/run/host.py) goes with the run; the stores removed their own.
        cleanup = getattr(getattr(self.host, "temp_dir", None), "cleanup", None)
        if callable(cleanup):
            try:
                cleanup()
            except Exception as exc:  # the run is over either way: a folder left behind must not fail it
                warn_once(log, "run directory removal", "KV Offload: could not remove the run's cache directory "
                          "(%s: %s); it stays on disk until the pack next loads and reclaims it", type(exc).__name__, exc)


def live_run(to: dict) -> Optional[RunState]:
    """The run in `to`, or None when there is none or it has stood down.

    Multi-GPU sampling (ComfyUI's MultiGPU CFG Split) runs the forwards of one step concurrently, one thread per
    device, each with `MULTI_GPU_KEY` set to its device. A run whose family serves that (`RunState.devices`)
    keeps one forward per thread and one store per device and cond (`branch_keys`); another stands down at the
    first such forward, before any state is touched, and every thread passes through.
    """
    run: Optional[RunState] = to.get(RUN_KEY) if isinstance(to, dict) else None
    if run is None:
        return None
    if MULTI_GPU_KEY in to and not run.devices:
        run.stand_down("multi-GPU sampling runs cond batches in parallel threads, which KV Offload does not "
                       "support for this model family yet; it stands down for this run")
    return None if run.stood_down else run
