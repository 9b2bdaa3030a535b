"""Ctrl-C at one line of a function: `KeyboardInterrupt` raised there as the consumer's thread reaches it, as
Python's own handler raises it between two lines. For the suites that interrupt the file tiers at every line of a
path instead of at the calls a hand-picked test thought of."""

import contextlib
import dis
import sys
from typing import Callable, List


def lines_of(function: Callable) -> List[int]:
    """The lines of `function`'s own body that run code (not those of the functions defined inside it)."""
    code = function.__code__
    return sorted({line for _, line in dis.findlinestarts(code) if line is not None and line > code.co_firstlineno})


@contextlib.contextmanager
def ctrl_c_at(function: Callable, line: int):
    """Raises KeyboardInterrupt the first time this thread reaches `line` of `function`; yields a list that holds
    the line once it has (a line the call never reaches interrupts nothing)."""
    code, fired = function.__code__, []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(line)
            raise KeyboardInterrupt
        return local

    def calls(frame, event, arg):
        return local if frame.f_code is code and not fired else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield fired
    finally:
        sys.settrace(previous)


def call_with_ctrl_c_at(function: Callable, line: int, call: Callable[[], object]) -> bool:
    """`call()` with Ctrl-C at `line` of `function`, the interrupt swallowed; returns whether it came."""
    with ctrl_c_at(function, line) as fired:
        try:
            call()
        except KeyboardInterrupt:
            pass
    return bool(fired)


def put_with_ctrl_c_at(store, function: Callable, line: int, key, k, v) -> bool:
    """`store.put(key, k, v)` with Ctrl-C at `line` of `function`, then the retry a user makes if the layer is not
    in yet; returns whether the interrupt came."""
    fired = call_with_ctrl_c_at(function, line, lambda: store.put(key, k, v))
    if key not in store._layers.layouts:
        store.put(key, k, v)
    return fired
