"""The store's checks against misuse: engine calls outside inference mode, one consumer thread, valid devices
and layer pairs. Each raises before anything is allocated, naming the value, the rule and the fix.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Hashable, Optional

import torch

# Forks this process descends from: 0 in the process that imported the engine, one more in each forked child.
# A store records it when made (`Owner`), so a child's use of a store it inherited is one int comparison away.
_generation = 0


def _forked() -> None:
    global _generation
    _generation += 1


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_forked)


class Owner:
    """The process that made a store. A forked child (multiprocessing's default start on Linux before Python
    3.14) inherits the store's memory, open files and locks but not its I/O threads: it must neither use the
    store nor close it, which would delete or unlock what the parent still uses."""

    __slots__ = ("pid", "generation")

    def __init__(self) -> None:
        self.pid, self.generation = os.getpid(), _generation

    @property
    def here(self) -> bool:
        return self.generation == _generation

    def check(self, what: str, store: str) -> None:
        if self.generation != _generation:
            raise RuntimeError(
                f"KVStore.{what}: store {store!r} belongs to process {self.pid}, which made it; this is a forked "
                f"child (pid {os.getpid()}), which shares the store's files and buffers but not its I/O threads. "
                "Create a new store in the child, or start it with multiprocessing's 'spawn' method.")


def engine_mode(method):
    """Runs a public method outside inference mode and autograd.

    Hosts such as ComfyUI call us under `torch.inference_mode()`: buffers allocated there would be inference
    tensors, which the file tier's I/O thread (not in inference mode) may not write in place. Ordinary tensors
    made here are read fine by inference-mode code.
    """
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled():
            if not torch.is_inference_mode_enabled():
                return method(*args, **kwargs)  # already so (a diffusers pipeline's call): no context at all
            if _InferenceMode is not None:  # ComfyUI's every call: the guard alone, a fifth of the public context
                with _InferenceMode(False):  # restores the whole autograd state on exit, grad mode included
                    torch._C._set_grad_enabled(False)  # InferenceMode(False) turns grad mode on
                    return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)
    return wrapper


# The C++ guard behind `torch.inference_mode(mode)`, whose Python wrapper costs 4 us a call: a `get` runs
# 60 x 2 times per denoising step. Where a torch lacks it, the public context is used.
_InferenceMode = getattr(torch._C, "_InferenceMode", None)


def one_consumer(method):
    """Lets only the store's consumer thread (the first to put or get) in, one call at a time, outside the host's
    allocation graph (`HostServices.pause_graph`): what a put or get allocates on the device outlives the block
    that asked for it, so a host recording each block's allocations must not count it as the block's."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._owner.generation != _generation:  # a forked child: nothing of the parent's is touched
            self._owner.check(method.__name__, self.name)
        self._consumer.claim(method.__name__, self.name)
        with self._busy, self._paused():
            return method(self, *args, **kwargs)
    return wrapper


class Consumer:
    """The one thread a store serves: the first to put or get, until `release` (the next request's)."""

    def __init__(self) -> None:
        self._owner: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def claim(self, what: str, store: str) -> None:
        me = threading.current_thread()
        if self._owner is me:  # the consumer's every call after its first: the owner only changes under the lock
            return
        with self._lock:
            if self._owner is None:
                self._owner = me
        if self._owner is not me:
            raise RuntimeError(
                f"KVStore.{what}: store {store!r} serves one consumer, thread {self._owner.name!r} (the first "
                f"to put or get); called from thread {me.name!r}. A get's tensors are only valid until the next "
                "get, so two threads would read each other's layers. Create one store per consumer thread.")

    def release(self) -> None:
        with self._lock:
            self._owner = None


def check_device(device) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"KVStore: `device` {device!r} is not a torch device ({exc}). Pass e.g. 'cuda:0'.") from None
    if device.type not in ("cpu", "cuda", "xpu", "mps"):
        raise ValueError(f"KVStore: `device` must be a cpu, cuda, xpu or mps device; got {str(device)!r}, which holds "
                         "no data the store could copy. Pass the device the model computes on, e.g. 'cuda:0'.")
    if device.type in ("cuda", "xpu"):  # (ROCm devices are `cuda` to torch)
        backend = getattr(torch, device.type)
        if not backend.is_available():
            raise ValueError(f"KVStore: `device` is {device}, but {device.type.upper()} is not available in this torch "
                             f"({torch.__version__}). Pass the device the model computes on, or device='cpu'.")
        if device.index is None:
            device = torch.device(device.type, backend.current_device())
    return device


def check_pair(key: Hashable, k, v, device: torch.device) -> None:
    if key is None:
        raise TypeError("KVStore.put: layer key None is reserved; use e.g. the layer index or ('double', i).")
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"KVStore.put: layer key {key!r} is not hashable; use e.g. an int or a tuple.") from None
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"KVStore.put: `{name}` must be a torch.Tensor; got {type(t).__name__}.")
        same = t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
        if not same:
            raise ValueError(f"KVStore.put: `{name}` is on {t.device}, but this store serves {device}. "
                             f"Create the store with device={str(t.device)!r}, or move the tensor first.")

