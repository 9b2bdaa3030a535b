"""The values a forward reads, described by content for a reuse key — or refused with the reason.

A function is more than its code: what it computes depends on its defaults, its closure cells, the globals and
module attributes it names, the environment where it reads it, and on the objects it calls (a `functools.partial`
and its arguments, a callable object and its state, a bound method and its receiver). `Values.describe` turns such
a value into a plain hashable description:

- plain values (numbers, strings, dtypes, enum members) as they are; tensors and numpy arrays by content (their
  shape and dtype described, the tensors collected in `tensors` for the content digest);
- containers by their items; partials by function and arguments; bound methods by function and receiver;
  objects with a `__dict__` (callable objects, configuration objects) by type and state;
- functions and classes by identity (a serial number, held weakly), handed to `follow` (the code walk reads
  their code in turn); modules by name; `os.environ` (and `os.getenv`, which reads it) by the whole environment;
- a module of the model's own tree by identity (its state is read on its own); torch's own objects (an op, a
  schema) by identity, like torch's code; this pack's own hooks and patches by name; a function declared
  `passive` by identity, not followed;
- objects that cannot change what is computed (loggers, locks) by type. Anything else raises `Unkeyable`.

With `reads` (`codereads.Reads`), every mutable container read is registered, so the next request can tell by
identity alone whether a new description would be the same.
"""

from __future__ import annotations

import enum
import functools
import inspect
import itertools
import logging
import os
import pathlib
import re
import sys
import threading
import types
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
import xxhash

_SERIALS: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_KEEP: Dict[int, Tuple[object, int]] = {}  # id -> (object, serial) for what cannot be weakly referenced
_NEXT = itertools.count(1)
PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
         torch.memory_format, type(Ellipsis), type(NotImplemented), range, slice)
_BY_REPR = (re.Pattern, inspect.Signature, pathlib.PurePath, types.UnionType, types.GenericAlias)  # immutable
FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.WrapperDescriptorType,
             types.MethodWrapperType, types.MethodDescriptorType, types.ClassMethodDescriptorType)
_INERT = (logging.Logger, logging.LoggerAdapter, type(threading.Lock()), type(threading.RLock()), threading.local,
          types.GetSetDescriptorType, types.MemberDescriptorType, weakref.ReferenceType)
_ENV_READERS = (os.getenv, getattr(os, "getenvb", os.getenv), os.putenv)
_MAX_ITEMS = 100_000  # a value larger than this is refused: describing it every request would cost too much


class Unkeyable(Exception):
    """The key cannot read something that may change the prefix: reuse must be off for this request."""


def serial(value) -> int:
    """A number for `value`, given when first seen and never reused for another object while it is alive (held
    weakly; what cannot be weakly referenced is kept)."""
    try:
        number = _SERIALS.get(value)
        if number is None:
            number = _SERIALS[value] = next(_NEXT)
        return number
    except TypeError:  # not weakly referable, or not hashable
        kept = _KEEP.get(id(value))
        if kept is None or kept[0] is not value:
            kept = _KEEP[id(value)] = (value, next(_NEXT))
        return kept[1]


def ident(value) -> tuple:
    """A function, class or code object by identity (a function also by its code object)."""
    code = getattr(value, "__code__", None)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", "?")
    if code is not None:
        return (type(value).__name__, name, serial(value), serial(code))
    return (type(value).__name__, name, serial(value))


def environment() -> tuple:
    """The whole environment, as one digest (a code that reads a variable at call time may read any)."""
    items = repr(sorted(os.environ.items())).encode()
    return ("environment", xxhash.xxh3_128_hexdigest(items))


class Values:
    """Describes values (see the module docstring). `follow(value)`: called with every function and class found;
    `reads`: registers every mutable container read; `tree`: ids of the model's own modules."""

    def __init__(self, follow: Optional[Callable[[object], None]] = None, reads=None, tree=frozenset()) -> None:
        self.tensors: List[torch.Tensor] = []
        self._follow = follow
        self._reads = reads
        self._tree = tree
        self._stack: set = set()
        self._items = 0

    def describe(self, value, where: str) -> tuple:
        self._items += 1
        if self._items > _MAX_ITEMS:
            raise Unkeyable(f"{where} is too large for the reuse key to read every request")
        if isinstance(value, enum.Enum):
            return ("enum", type(value).__qualname__, repr(value))
        if isinstance(value, PLAIN):
            return (type(value).__name__, repr(value))
        if torch.is_tensor(value):
            self.tensors.append(value.detach())
            return ("tensor", tuple(value.shape), str(value.dtype), value.device.type)
        if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
            return self._array(value, where)
        if value is os.environ or any(value is reader for reader in _ENV_READERS):
            if self._reads is not None:
                self._reads.map(getattr(os.environ, "_data", os.environ))
            return environment()
        if isinstance(value, types.ModuleType):
            return ("module", value.__name__)
        if isinstance(value, (staticmethod, classmethod)):
            return ("static", self.describe(value.__func__, where))
        if isinstance(value, property):
            return ("property", *(self.describe(f, where) for f in (value.fget, value.fset) if f is not None))
        if isinstance(value, (type, types.FunctionType, types.CodeType)):
            if ours(value):  # made anew for each run (a closure, a bound patch): by name, never followed
                return ("ours", getattr(value, "__qualname__", "?"))
            if self._follow is not None and not isinstance(value, types.CodeType) and not passive(value):
                self._follow(value)
            return ident(value)
        if id(value) in self._tree:
            return ("module of the model", type(value).__qualname__, serial(value))
        if id(value) in self._stack:
            return ("cycle",)
        self._stack.add(id(value))
        try:
            return self._compound(value, where)
        finally:
            self._stack.discard(id(value))

    def _compound(self, value, where: str) -> tuple:
        reads = self._reads
        if isinstance(value, (list, tuple, set, frozenset)):
            if reads is not None and not isinstance(value, (tuple, frozenset)):
                reads.items(value)
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            return (type(value).__qualname__,
                    tuple(self.describe(v, f"{where}[{i}]") for i, v in enumerate(items)))
        if isinstance(value, dict):
            if reads is not None:
                reads.map(value)
            return (type(value).__qualname__, tuple((self.describe(k, f"{where} key"), self.describe(v, f"{where}[{k!r}]"))
                                                    for k, v in value.items()))
        if isinstance(value, functools.partial):
            return ("partial", self.describe(value.func, f"{where}.func"), self.describe(value.args, f"{where}.args"),
                    self.describe(value.keywords, f"{where}.keywords"))
        if isinstance(value, FUNCTIONS):  # bound methods, builtins (bound to a module or to an object)
            receiver = getattr(value, "__self__", None)
            func = getattr(value, "__func__", None)
            head = self.describe(func, where) if func is not None else ident(value)
            if receiver is None or isinstance(receiver, (type, types.ModuleType)) or _native(receiver):
                return ("function", head)
            return ("bound", head, self.describe(receiver, f"{where}.__self__"))
        if ours(value):
            return ("ours", type(value).__qualname__)
        if isinstance(value, _INERT) or type(value).__module__ == "_abc":
            return ("inert", type(value).__qualname__)
        if isinstance(value, _BY_REPR) or type(value).__module__ == "typing":
            return (type(value).__qualname__, repr(value))
        if type(value).__module__.split(".")[0] == "torch" and not isinstance(value, torch.nn.Module):
            return ("torch object", type(value).__qualname__, serial(value))  # torch's own state: as its code, by identity
        state = getattr(value, "__dict__", None)
        if isinstance(state, dict) and not _slots(type(value)):
            if self._follow is not None:
                self._follow(type(value))  # its methods (`__call__`) are code the forward runs
            return ("object", ident(type(value)), self.describe(state, f"{where}.__dict__"))
        raise Unkeyable(f"{where} holds a {type(value).__qualname__}, which the reuse key cannot read")

    def _array(self, value, where: str) -> tuple:
        if value.dtype.hasobject:
            raise Unkeyable(f"{where} holds a numpy array of Python objects, which the reuse key cannot read")
        flat = value.reshape(-1)
        self.tensors.append(torch.from_numpy(flat.view("u1") if flat.flags.c_contiguous else flat.copy().view("u1")))
        return ("ndarray", value.shape, str(value.dtype))


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the pack: offload_core/reuse/..
_OURS = tuple(os.path.join(_ROOT, part) + os.sep for part in ("offload_core", "nodes"))


def ours(value) -> bool:
    """Whether `value` (a function or an object) is this pack's own: its hooks and patches, which compute what
    the prefix would be anyway, are read by name only, never followed nor described by state (they are made
    anew for each run, and a registry's entries change every request)."""
    try:
        name = getattr(value, "__module__", None) or type(value).__module__
    except Exception:  # noqa: BLE001 - an object whose attributes raise is not ours
        return False
    return (getattr(sys.modules.get(name), "__file__", None) or "").startswith(_OURS)


def passive(value) -> bool:
    """Declared passive (`fingerprint.passive`): it only observes (a counter, a timer), so what it reads is not
    followed; it is recorded by identity."""
    return getattr(value, "_kv_offload_passive", False) is True


def _native(receiver) -> bool:
    """A builtin's `__self__` that is an extension's own record (pybind11), not an object it computes with."""
    return type(receiver).__module__ == "pybind11_builtins" or type(receiver).__name__ == "PyCapsule"


def _slots(cls: type) -> bool:
    """Whether instances of `cls` keep state outside their `__dict__` (slots the description would not see)."""
    return any(set(getattr(c, "__slots__", ())) - {"__dict__", "__weakref__"} for c in cls.__mro__
               if "__slots__" in vars(c))
