"""Said once a process: a failure the pack works around is said at WARNING the first time, at DEBUG after that.

One set for the whole pack, keyed by what failed, so a failure that repeats every step (a readout push, a run
folder that cannot be removed) neither floods the log nor goes unsaid. No ComfyUI import.
"""

from __future__ import annotations

import logging

_SAID: set = set()  # the keys said at WARNING in this process


def warn_once(logger: logging.Logger, key: str, msg: str, *args) -> None:
    """`logger` says `msg % args`, with the exception being handled: at WARNING the first time `key` is said in
    this process, at DEBUG after that."""
    level = logging.DEBUG if key in _SAID else logging.WARNING
    _SAID.add(key)
    logger.log(level, msg, *args, exc_info=True)
