"""Whether prefix reuse pays for a model: a hit skips the prefix's extraction, but every request reads the model
for the key (weights, module state, code), hit or miss.

What a hit would save is measured on each miss that made a prefix to keep: the transformer calls that extracted
it against as many later calls of the same request, which run without the prefix (on a GPU, both timed to the
device's completion). When the key cost at least that much in `LOSSES` such requests in a row at one model and
prefix size, reuse turns off for that model at that size, with the reason (`session.refused`, a warning, and
`last_stats[i]["reuse_refused"]`), and the key is not read again there. A larger prefix (another size) is judged
on its own. `reuse="always"` keeps reuse on whatever the measurement. The ComfyUI nodes judge their runs with
the same two classes (`nodes/run/reuse.py`), telling `StepTimes` what a forward did once it ran.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Hashable, List, Optional

import torch

from ..host import devices

LOSSES = 2  # requests in a row where the key cost more than a hit would save, before reuse stops


class StepTimes:
    """The transformer calls of one request, as extracting or not: what a hit would save is the extracting
    calls' time above as many of the later calls. `hooks()` times the outermost calls of a transformer (a call
    the adapter makes from inside one is part of it)."""

    def __init__(self) -> None:
        self.extract: List[float] = []
        self.cached: List[float] = []
        self._began: Optional[float] = None
        self._extracting = False
        self._depth = 0

    def reset(self) -> None:
        self.__init__()

    def hooks(self, active):
        """(pre-hook, hook) for `register_forward_pre_hook` / `register_forward_hook` with kwargs; the pre-hook
        registered before the adapter's, the hook after them. `active()`: whether this call is to be timed."""
        def before(module, args, kwargs):
            self._depth += 1
            if self._depth == 1 and active():
                hidden = kwargs.get("hidden_states")
                if isinstance(hidden, torch.Tensor):
                    self.begin(hidden.device, kwargs.get("kv_cache_mode") == "extract")
            return None

        def after(module, args, kwargs, output):
            self._depth = max(self._depth - 1, 0)
            if self._depth == 0:
                hidden = kwargs.get("hidden_states")
                self.end(hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu"))
            return None
        return before, after

    def begin(self, device: torch.device, extracting: Optional[bool] = None) -> None:
        """Start timing a call. `extracting` None: what the call does is known only once it ran (told to `end`);
        such a call is timed while it could still be one to compare (no extracting call yet, or one unmatched)."""
        owed = len(self.cached) < len(self.extract)  # an extracting call still lacks its later call
        if not (extracting or owed or (extracting is None and not self.extract)):
            return  # enough later calls to compare with
        devices.wait_for_device(device)  # through the module: the tests' model of CUDA replaces it
        self._began, self._extracting = time.perf_counter(), extracting

    def end(self, device: torch.device, extracting: Optional[bool] = None) -> None:
        """Stop timing the call; `extracting`: what it did, where `begin` could not tell (None: as told there;
        a call neither extracting nor later, or a later call beyond those compared, is dropped)."""
        if self._began is None:
            return
        devices.wait_for_device(device)  # through the module: the tests' model of CUDA replaces it
        took, self._began = time.perf_counter() - self._began, None
        extracting = self._extracting if extracting is None else extracting
        if extracting is None or (not extracting and len(self.cached) >= len(self.extract)):
            return
        (self.extract if extracting else self.cached).append(took)

    def saved(self) -> Optional[float]:
        """Seconds a hit would have saved this request, once a later call was timed per extracting call."""
        if not self.extract or len(self.cached) < len(self.extract):
            return None
        return sum(self.extract) - sum(self.cached[: len(self.extract)])


class ReuseCost:
    """Per (model, prefix size): the verdict of the last requests, and the reason once reuse is off there."""

    def __init__(self, always: bool = False, keep_on: str = "reuse='always'") -> None:
        self.always = always
        self.keep_on = keep_on  # how the user keeps reuse on, as the reason says it
        self._losses: Dict[Hashable, int] = {}
        self._off: Dict[Hashable, str] = {}
        self._lock = threading.Lock()

    def off(self, scope: Hashable) -> Optional[str]:
        return self._off.get(scope)

    def judge(self, scope: Hashable, key_s: float, saved_s: Optional[float]) -> Optional[str]:
        """Records one request that made a prefix; returns the reason when reuse turns off at `scope` now."""
        if self.always or saved_s is None:
            return None
        with self._lock:
            if saved_s > key_s:
                self._losses.pop(scope, None)
                return None
            losses = self._losses[scope] = self._losses.get(scope, 0) + 1
            if losses < LOSSES or scope in self._off:
                return None
            reason = (f"reading the model for the key costs {key_s * 1e3:.1f} ms a request and a hit would save "
                      f"{max(saved_s, 0.0) * 1e3:.1f} ms at this prefix size ({losses} requests in a row); "
                      f"reuse stays off for this model at this size ({self.keep_on} keeps it on)")
            self._off[scope] = reason
            return reason
