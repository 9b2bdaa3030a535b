"""Numbers read from environment variables: checked once, and a value that breaks the rule is logged, not hidden.

A bad value does not stop the process (the variable may be set for another version, or for every program on a
machine): the warning names the variable, the value, the rule and the number used instead.
"""

from __future__ import annotations

import logging
import math
import os
import threading

log = logging.getLogger(__name__)


def env_int(name: str, default: int, low: int, high: int) -> int:
    """`name` as a whole number from `low` to `high`; `default` when unset or not a whole number, the nearest
    bound when outside them."""
    text = _text(name)
    if text is None:
        return default
    rule = f"a whole number from {low} to {high}"
    try:
        value = int(text)
    except ValueError:
        return _refused(name, text, rule, default, "the default")
    if not low <= value <= high:
        return _refused(name, text, rule, min(max(value, low), high), "the nearest allowed")
    return value


# The longest wait a seconds variable may ask for: the engine multiplies a timeout by small factors (a load spans
# several file operations) and hands it to Python's lock waits, which refuse anything above TIMEOUT_MAX.
LONGEST_S = float(int(threading.TIMEOUT_MAX / 1000))


def env_seconds(name: str, default: float) -> float:
    """`name` as a number of seconds > 0 (finite); `default` when unset or not such a number, `LONGEST_S` (about
    three months) when above it."""
    text = _text(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        return _refused(name, text, "a finite number of seconds > 0", default, "the default")
    if value > LONGEST_S:
        return _refused(name, text, f"a number of seconds up to {LONGEST_S:g}", LONGEST_S, "the nearest allowed")
    return value


def is_set(name: str) -> bool:
    """True where `name` holds something (set to nothing is the same as unset)."""
    return _text(name) is not None


def _text(name: str):
    text = os.environ.get(name, "").strip()
    return text or None  # set to nothing is the same as unset


def _refused(name: str, text: str, rule: str, used, which: str):
    log.warning("KV offload: %s=%r is not %s; using %s, %s.", name, text, rule, used, which)
    return used
