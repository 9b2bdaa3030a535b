"""What a walk of a model's code read (`codeprint`), kept so the next request can tell by identity alone whether a
new walk would read the same, and so give the same answer.

A walk reads mappings (class dicts, the globals of each function it follows, the modules those name, registries,
the builtins, the state of the objects it describes), lists and sets, each class's MRO and each followed function's mutable parts (`__code__`, defaults, closure cells).
`Reads` keeps, for each mapping, its keys in order and each value's id and type; for each function, its code,
defaults and each cell's content the same way. The values are held so that no id can be reused while kept:

- weakly where they can be (functions, classes, modules, most objects): a kept entry never keeps a model alive,
  and a value that died fails the check;
- strongly where they cannot be but the walk reads them by content (plain values, static and class methods,
  properties, builtin descriptors, code): these are immutable or class-level; a dict the walk reads (a registry,
  keyword defaults) is itself one of the mappings kept;
- not at all otherwise (a tuple, a list, a dict it does not read): the walk ignores such values, so only their
  type matters, and the type is compared. A function's defaults are kept element by element.

So `unchanged()` is True only if every value the walk read is the very object it was: C loops over each mapping's
keys, ids and types, at a tenth of a walk's cost.
"""

from __future__ import annotations

import itertools
import operator
import types
import weakref
from typing import List, Tuple

_HELD = (bool, int, float, str, bytes, type(None), staticmethod, classmethod, property,
         types.WrapperDescriptorType, types.MethodDescriptorType, types.MethodWrapperType, types.CodeType)
_ALIVE = weakref.ref.__call__
MISSING = object()


def attr(obj, name: str):
    """`getattr(obj, name)`, or `MISSING` (an absent attribute, an empty closure cell)."""
    try:
        return getattr(obj, name)
    except (AttributeError, ValueError):  # ValueError: an empty closure cell
        return MISSING


def _hold(values: tuple) -> tuple:
    """(ids, types, weak references, strong references) of `values` (see the module docstring)."""
    weak, strong = [], []
    for value in values:
        if issubclass(type(value), _HELD):  # not isinstance: a deprecated object may warn on `__class__`
            strong.append(value)
            continue
        try:
            weak.append(weakref.ref(value))
        except TypeError:
            pass  # compared by type only: the walk ignores such values
    return tuple(map(id, values)), tuple(map(type, values)), tuple(weak), tuple(strong)


def _same(values: tuple, held: tuple) -> bool:
    ids, kinds, weak, _ = held
    return (tuple(map(id, values)) == ids and tuple(map(type, values)) == kinds
            and not any(map(operator.is_, map(_ALIVE, weak), itertools.repeat(None))))


def _parts(functions: tuple) -> tuple:
    """Every mutable part of `functions` a walk reads, in one tuple: codes, defaults, keyword defaults, cells."""
    cells = tuple(itertools.chain.from_iterable(filter(None, map(_CLOSURE, functions))))
    defaults = tuple(map(_DEFAULTS, functions))
    return (*map(_CODE, functions), *map(_KWDEFAULTS, functions), *(len(d) if d else -1 for d in defaults),
            *itertools.chain.from_iterable(filter(None, defaults)), *(attr(cell, "cell_contents") for cell in cells))


_CODE, _DEFAULTS = operator.attrgetter("__code__"), operator.attrgetter("__defaults__")
_KWDEFAULTS, _CLOSURE = operator.attrgetter("__kwdefaults__"), operator.attrgetter("__closure__")


class Reads:
    """Every mapping, MRO and function a walk read (`map`, `mro`, `function`), checked by `unchanged()`."""

    def __init__(self) -> None:
        self._maps: List[Tuple[object, tuple, tuple]] = []  # (mapping, keys, held values)
        self._items: List[Tuple[object, tuple]] = []  # (list or set, held items)
        self._mros: List[Tuple[weakref.ref, tuple]] = []
        self._functions: List[weakref.ref] = []
        self._parts: tuple = ()  # `_parts()` of the functions, held, once the walk is over (`done()`)
        self._seen: set = set()

    def map(self, mapping) -> None:
        if id(mapping) not in self._seen:
            self._seen.add(id(mapping))
            self._maps.append((mapping, tuple(mapping), _hold(tuple(mapping.values()))))

    def items(self, container) -> None:
        """A list or set whose items a walk read (a global list, a mutable default, a closure's list)."""
        if id(container) not in self._seen:
            self._seen.add(id(container))
            self._items.append((container, _hold(tuple(container))))

    def mro(self, cls: type) -> tuple:
        self._mros.append((weakref.ref(cls), cls.__mro__))
        return cls.__mro__

    def function(self, func: types.FunctionType) -> tuple:
        """Reads `func`'s parts; returns its closure cells' contents (`MISSING` for an empty cell)."""
        self._functions.append(weakref.ref(func))
        if func.__kwdefaults__:
            self.map(func.__kwdefaults__)
        return tuple(attr(cell, "cell_contents") for cell in func.__closure__ or ())

    def done(self) -> "Reads":
        """The walk is over: what its functions hold now is what `unchanged()` compares with."""
        self._parts = _hold(_parts(tuple(map(_ALIVE, self._functions))))
        return self

    def unchanged(self) -> bool:
        for mapping, keys, held in self._maps:
            if len(mapping) != len(keys) or tuple(mapping) != keys or not _same(tuple(mapping.values()), held):
                return False
        for container, held in self._items:
            if not _same(tuple(container), held):
                return False
        for ref, mro in self._mros:
            cls = ref()
            if cls is None or cls.__mro__ is not mro:
                return False
        functions = tuple(map(_ALIVE, self._functions))
        if any(map(operator.is_, functions, itertools.repeat(None))):
            return False
        return _same(_parts(functions), self._parts)
