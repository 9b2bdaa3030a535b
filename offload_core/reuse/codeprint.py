"""The code a model's forward can reach, as a reuse key can see it: a class patched, a module function replaced,
an attention backend registered under another function, an attribute that holds another function.

A key can never list all code, so it follows the code from the model itself: every method of every class in the
module tree (their whole MRO) and of each attention processor's class, every function-valued attribute of a
module, and, from each of those functions, whatever its bytecode names in its globals and its closure — module
functions, classes and their class-level state (diffusers' attention backend registry is a class holding a dict
of functions), and, through a module it names (`F`, `torch`), the attributes of that module its code names
(`F.scaled_dot_product_attention`). Every function reached is recorded by identity and by its code object, and
functions of the project's own packages are followed further; torch's and the standard library's are recorded,
not followed (a patch of them replaces the object a model's code names, which the identity shows).

Identities are serial numbers given to each object when first seen and held in weak dictionaries, so a new object
at a dead one's address gets a new number and no model is kept alive by its key; objects that cannot be weakly
referenced (builtin functions, code objects) are module-level and kept as they are. The walk reads dictionaries
only (no call, no import), whatever the size of the weights.

A walk is a function of what it read, so each model's last walk is kept with what it read (`codereads.Reads`) and
its roots (the classes of the module tree and of its processors, the function-valued attributes). The next
request compares those by identity and walks again only when one differs: the same answer as a walk at a tenth
of its cost (`tests/core/test_codeprint.py` compares the two after every kind of change).
"""

from __future__ import annotations

import builtins
import itertools
import types
import weakref
from typing import Dict, List, Set, Tuple

import torch

from .codereads import MISSING as _MISSING, Reads

_SERIALS: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_KEEP: Dict[int, Tuple[object, int]] = {}  # id -> (object, serial) for what cannot be weakly referenced
_NEXT = itertools.count(1)
_NAMES: Dict[int, Tuple[types.CodeType, Tuple[str, ...]]] = {}  # id(code) -> (code, every name it and its nested code use)
_PLAIN = (bool, int, float, str, bytes, type(None))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType,
              types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType)


# model -> (its roots, what its last walk read, the identity it gave); weak both ways: no model is kept alive
_LAST: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def code_identity(model: torch.nn.Module, *, fresh: bool = False) -> tuple:
    """A hashable description of the code `model`'s forward can reach now (see the module docstring); `fresh`
    walks even when nothing the last walk read has changed."""
    subs = list(model.modules())
    roots = tuple(_roots(sub) for sub in subs)
    last = _LAST.get(model)
    if not fresh and last is not None and _same_roots(last[0], roots) and last[1].unchanged():
        return last[2]
    walk = _Walk({_package(type(sub)) for sub in subs} - {"torch"} | {"__main__"})
    for cls, processor, functions in roots:
        walk.klass(cls)
        if processor is not None:
            walk.klass(processor)
        for name, value in functions:
            walk.record(("attribute", cls.__qualname__, name), value)
    identity = tuple(walk.out)
    _LAST[model] = (tuple((cls, processor, _weak(functions)) for cls, processor, functions in roots),
                    walk.reads.done(), identity)
    return identity


def _roots(sub: torch.nn.Module) -> tuple:
    """Where a walk starts from `sub`: its class, its processor's class, its function-valued attributes."""
    processor = getattr(sub, "processor", None)
    functions = tuple((name, value) for name, value in vars(sub).items() if _is_function(value))
    return type(sub), None if processor is None else type(processor), functions


def _weak(functions: tuple) -> tuple:
    """The attributes kept without keeping them alive (a bound method would keep its module, so the model)."""
    kept = []
    for name, value in functions:
        try:
            kept.append((name, weakref.ref(value)))
        except TypeError:  # a descriptor or a static method: class-level, kept as it is
            kept.append((name, lambda value=value: value))
    return tuple(kept)


def _same_roots(kept: tuple, roots: tuple) -> bool:
    if len(kept) != len(roots):
        return False
    for (cls, processor, functions), (cls2, processor2, functions2) in zip(kept, roots):
        if cls is not cls2 or processor is not processor2 or len(functions) != len(functions2):
            return False
        if any(name != name2 or ref() is not value for (name, ref), (name2, value) in zip(functions, functions2)):
            return False
    return True


def _is_function(value) -> bool:
    return isinstance(value, _FUNCTIONS) or isinstance(value, (staticmethod, classmethod, property))


def _ident(value) -> tuple:
    """What an identity records of `value`: plain values as they are, functions, classes and code by identity."""
    if isinstance(value, _PLAIN):
        return ("value", repr(value))
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    code = getattr(value, "__code__", None)
    if code is not None:
        return (type(value).__name__, getattr(value, "__qualname__", "?"), _serial(value), _serial(code))
    return (type(value).__name__, getattr(value, "__qualname__", "?"), _serial(value))


def _serial(value) -> int:
    """The number of `value` (see the module docstring)."""
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


def _package(value) -> str:
    return (getattr(value, "__module__", None) or "").split(".")[0]


def _names(code: types.CodeType) -> Tuple[str, ...]:
    """Every global or attribute name `code` and the code nested in it (lambdas, comprehensions) use."""
    got = _NAMES.get(id(code))
    if got is None:
        names: List[str] = []
        stack = [code]
        while stack:
            c = stack.pop()
            names += c.co_names
            stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        got = _NAMES[id(code)] = (code, tuple(dict.fromkeys(names)))  # the code kept: its id stays its own
    return got[1]


class _Walk:
    def __init__(self, packages: Set[str]) -> None:
        self.out: List[tuple] = []
        self._seen: Set[int] = set()
        self._packages = packages  # whose functions and classes are followed
        self._modules_seen: Set[tuple] = set()
        self.reads = Reads()

    def _leaf(self, value) -> bool:
        return _package(value) not in self._packages

    def record(self, where: tuple, value, follow: bool = True) -> None:
        self.out.append((where, _ident(value)))
        if follow:
            self.follow(value)

    def klass(self, cls: type) -> None:
        for base in self.reads.mro(cls):
            if base is object or id(base) in self._seen:
                continue
            self._seen.add(id(base))
            self.out.append(("class", _ident(base)))
            leaf = self._leaf(base)  # torch's own classes (nn.Module, nn.Linear): their methods by identity alone
            self.reads.map(vars(base))
            for name, value in sorted(vars(base).items()):
                self._member(base, name, value, follow=not leaf)

    def _member(self, cls: type, name: str, value, follow: bool = True) -> None:
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for part in (value.fget, value.fset):
                if part is not None:
                    self.record(("property", cls.__qualname__, name), part, follow)
        elif isinstance(value, _FUNCTIONS):
            self.record(("method", cls.__qualname__, name), value, follow)
        elif not follow:
            return
        elif isinstance(value, _PLAIN):
            self.out.append(("class value", cls.__qualname__, name, repr(value)))
        elif isinstance(value, dict) and not name.startswith("__"):  # a registry: its functions by identity
            self.reads.map(value)
            for key, item in sorted(value.items(), key=lambda kv: repr(kv[0])):
                if _is_function(item):
                    self.record(("registry", cls.__qualname__, name, repr(key)), item)

    def follow(self, value) -> None:
        """Follows a function of the project's own code into what its code names; a class into its members."""
        if isinstance(value, type):
            if not self._leaf(value):
                self.klass(value)
            return
        func = getattr(value, "__func__", value)
        code = getattr(func, "__code__", None)
        if type(func) is not types.FunctionType or id(func) in self._seen or self._leaf(func):
            return
        self._seen.add(id(func))
        contents = self.reads.function(func)
        scope = getattr(func, "__globals__", {})
        self.reads.map(scope)
        self.reads.map(_BUILTINS)
        names = _names(code)
        for name in names:
            target = scope.get(name, _BUILTINS.get(name, _MISSING))
            if target is _MISSING:
                continue  # an attribute name, or a global not defined (yet)
            if isinstance(target, types.ModuleType):
                self._module_names(target, names, depth=3)
            elif isinstance(target, (type, *_FUNCTIONS)):
                self.record(("global", func.__qualname__, name), target)
            elif isinstance(target, _PLAIN):
                self.out.append(("global value", func.__qualname__, name, repr(target)))
        for i, content in enumerate(contents):
            if _is_function(content) or isinstance(content, type):
                self.record(("closure", func.__qualname__, i), content)
            elif isinstance(content, _PLAIN):
                self.out.append(("closure value", func.__qualname__, i, repr(content)))
        for default in (func.__defaults__ or ()) + tuple((func.__kwdefaults__ or {}).values()):
            if _is_function(default):
                self.record(("default", func.__qualname__), default)

    def _module_names(self, module: types.ModuleType, names: Tuple[str, ...], depth: int) -> None:
        """The attributes of `module` that the code names (`F.scaled_dot_product_attention`, `torch.sigmoid`),
        through its submodules the code names too (`torch.nn.functional.silu`), `depth` levels down."""
        key = (id(module), names)
        if key in self._modules_seen:
            return
        self._modules_seen.add(key)
        scope = vars(module)
        self.reads.map(scope)
        for name in names:
            target = scope.get(name, _MISSING)
            if isinstance(target, types.ModuleType):
                if depth > 1:
                    self._module_names(target, names, depth - 1)
            elif target is not _MISSING and isinstance(target, (type, *_FUNCTIONS)):
                self.record(("attribute of", module.__name__, name), target)


_BUILTINS = vars(builtins)
