"""The code a model's forward can reach and the values that code reads, as a reuse key can see them: a class
patched, a module function replaced, a backend registered under another function or partial, a default, a
closure cell, a global or a module attribute changed, an environment variable set.

A key can never list all code, so it follows the code from the model itself: every method of every class in the
module tree (their whole MRO; torch's own module classes too, whose `forward` calls `F.layer_norm`) and of each
attention processor's class, every callable attribute of a module, and, from each of those functions, whatever
its bytecode names in its globals and its closure, its defaults, and, through a module it names (`F`, `torch`,
a settings module), the attributes of that module its code names. Each value found is described by
`valueprint.Values`: functions and classes by identity (and followed further when they belong to the project's
own packages or `__main__`; torch's and the standard library's are recorded, not followed), everything else by
content — containers by their items, partials by function and arguments, callable objects by type and state,
tensors by content (returned beside the identity for the content digest), the environment where code reads it.
A value it cannot read raises `Unkeyable`: reuse is off for that request.

A walk is a function of what it read, so each model's last walk is kept with what it read (`codereads.Reads`:
every mapping, list and set, by the identity of each item) and its roots (the classes of the module tree and of
its processors, the callable attributes). The next request compares those by identity and walks again only when
one differs: the same answer as a walk at a tenth of its cost (`tests/core/test_codeprint.py` compares the two
after every kind of change). The tensors read are digested every request: an in-place write changes no identity.
"""

from __future__ import annotations

import builtins
import functools
import sys
import types
import weakref
from typing import Dict, List, Set, Tuple

import torch

from .codereads import MISSING as _MISSING, Reads
from .valueprint import FUNCTIONS as _FUNCTIONS, Values, ident as _ident, ours, passive

_NAMES: Dict[int, Tuple[types.CodeType, Tuple[str, ...]]] = {}  # id(code) -> (code, every name it and its nested code use)
_TORCH_NN = "torch.nn.modules."  # torch's own module classes: their code is followed (not nn.Module's own)


# model -> (its roots, what its last walk read, the identity it gave); weak both ways: no model is kept alive
_LAST: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def code_identity(model: torch.nn.Module, *, fresh: bool = False) -> tuple:
    """A hashable description of the code `model`'s forward can reach now (see the module docstring); `fresh`
    walks even when nothing the last walk read has changed."""
    return code_reads(model, fresh=fresh)[0]


def code_reads(model: torch.nn.Module, *, fresh: bool = False) -> Tuple[tuple, List[torch.Tensor]]:
    """`(code_identity, tensors)`: the tensors the code reads (globals, closure cells, defaults), to be compared
    by content every request. Raises `Unkeyable` for a value the key cannot read."""
    subs = list(model.modules())
    roots = tuple(_roots(sub) for sub in subs)
    last = _LAST.get(model)
    if not fresh and last is not None and _same_roots(last[0], roots) and last[1].unchanged():
        return last[2], last[3]
    walk = _Walk({_package(type(sub)) for sub in subs} - {"torch"} | {"__main__"}, frozenset(map(id, subs)))
    for cls, processor, functions in roots:
        walk.klass(cls)
        if processor is not None:
            walk.klass(processor)
        for name, value in functions:
            walk.value(("attribute", cls.__qualname__, name), value)
    identity = tuple(walk.out)
    _LAST[model] = (tuple((cls, processor, _weak(functions)) for cls, processor, functions in roots),
                    walk.reads.done(), identity, walk.values.tensors)
    return identity, walk.values.tensors


def _roots(sub: torch.nn.Module) -> tuple:
    """Where a walk starts from `sub`: its class, its processor's class, its callable attributes (functions,
    partials, bound methods, callable objects)."""
    processor = getattr(sub, "processor", None)
    functions = tuple((name, value) for name, value in vars(sub).items()
                      if callable(value) and not isinstance(value, torch.nn.Module))
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
    def __init__(self, packages: Set[str], tree: frozenset) -> None:
        self.out: List[tuple] = []
        self._seen: Set[int] = set()
        self._packages = packages  # whose functions and classes are followed
        self._modules_seen: Set[tuple] = set()
        self.reads = Reads()
        self.values = Values(self.follow, self.reads, tree)

    def _leaf(self, value) -> bool:
        """Code not followed: torch's (but its module classes' own, `nn.LayerNorm.forward` calling
        `F.layer_norm`), the standard library's, other packages'."""
        module = getattr(value, "__module__", None) or ""
        if module.startswith(_TORCH_NN) and module != _TORCH_NN + "module":
            return False
        return _package(value) not in self._packages

    def record(self, where: tuple, value, follow: bool = True) -> None:
        self.out.append((where, _ident(value)))
        if follow:
            self.follow(value)

    def value(self, where: tuple, value) -> None:
        """A value the code reads, by content (`valueprint`); the functions and classes in it are followed."""
        if where[0] in ("class value", "attribute"):  # a registry's entries, a module's callable attribute
            for item in _installed(value):
                self._adopt(item)
        self.out.append((where, self.values.describe(value, " ".join(map(str, where)))))

    def _adopt(self, value) -> None:
        """A function installed into the model's code (a method of its classes, a registry's entry, a module's
        attribute, a torch function replaced) from a package the walk does not follow is a patch: its package
        is followed from then on, so what the patch wraps and reads is read too (a wrapper of a `__main__`
        patch, a package's patch that reads a flag of its own)."""
        func = getattr(value, "__func__", value)
        if type(func) is types.FunctionType and not ours(func) and not passive(func):
            package = _package(func)
            if package and package not in _LIBRARIES:
                self._packages.add(package)

    def klass(self, cls: type) -> None:
        for base in self.reads.mro(cls):
            if base is object or id(base) in self._seen:
                continue
            self._seen.add(id(base))
            self.out.append(("class", _ident(base)))
            leaf = self._leaf(base)  # torch's own nn.Module, other packages' classes: methods by identity alone
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
            if follow:
                self._adopt(value)
            self.record(("method", cls.__qualname__, name), value, follow)
        elif follow and not (name.startswith("__") and name.endswith("__")) and name != "_abc_impl":
            self.value(("class value", cls.__qualname__, name), value)  # a registry, a default, a table

    def follow(self, value) -> None:
        """Follows a function of the project's own code into what it reads; a class into its members."""
        if isinstance(value, type):
            if not self._leaf(value):
                self.klass(value)
            return
        func = getattr(value, "__func__", value)
        if type(func) is not types.FunctionType or id(func) in self._seen or self._leaf(func):
            return
        self._seen.add(id(func))
        contents = self.reads.function(func)
        scope = func.__globals__
        self.reads.map(scope)
        self.reads.map(_BUILTINS)
        names = _names(func.__code__)
        where = func.__qualname__
        for name in names:
            target = scope.get(name, _BUILTINS.get(name, _MISSING))
            if target is _MISSING:
                continue  # an attribute name, or a global not defined (yet)
            if isinstance(target, types.ModuleType):
                self._module_names(target, names, depth=3)
            else:
                self.value(("global", where, name), target)
        for i, content in enumerate(contents):
            if isinstance(content, types.ModuleType):  # `import os` in an enclosing function
                self._module_names(content, names, depth=3)
            elif content is not _MISSING:
                self.value(("closure", where, i), content)
        self.value(("defaults", where), (func.__defaults__, func.__kwdefaults__))

    def _module_names(self, module: types.ModuleType, names: Tuple[str, ...], depth: int) -> None:
        """The attributes of `module` that the code names (`F.scaled_dot_product_attention`, `mod.SCALE`),
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
            elif target is not _MISSING:
                if module.__name__.split(".")[0] == "torch":  # a torch function replaced by a patch
                    self._adopt(target)
                self.value(("attribute of", module.__name__, name), target)


_BUILTINS = vars(builtins)
_LIBRARIES = frozenset(sys.stdlib_module_names) | {"torch", "numpy"}  # never a patch: their code is not followed


def _installed(value):
    """The functions in a value installed into the model: itself, a partial's or a bound method's function, a
    registry's entries."""
    items = list(value.values()) if isinstance(value, dict) else [value]
    for item in items:
        yield getattr(item, "func", None) if isinstance(item, functools.partial) else item
