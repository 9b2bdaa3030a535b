"""`OffloadConfig`'s checks of the file options (`file_dir`, `bypass_page_cache`) and of what a file place needs
from this Python: xxhash for the checksums, positional I/O and locks from the operating system."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional

from . import fileos


def check_file_options(mode, file_dir: Optional[str], bypass: Optional[bool], spills: bool = False) -> None:
    """Raises for a file option that `mode` (a `config.Mode`) gives no meaning, or a file place this Python cannot
    keep; `spills`: a RAM mode whose `host_budget` sends the overflow to files."""
    file_like = mode.takes_file_options or spills
    if (mode.is_file or spills) and importlib.util.find_spec("xxhash") is None:
        raise ValueError(
            f"mode {mode.value!r} keeps layers in files, which are checksummed with xxhash, and xxhash is not "
            "installed. Install it (`pip install xxhash`, or `pip install -r requirements.txt` in the ComfyUI pack), "
            "or pick a RAM or gpu mode.")
    missing = fileos.current().problem
    if (mode.is_file or spills) and missing:
        raise ValueError(
            f"mode {mode.value!r} keeps layers in files, which needs {missing} from the operating system; this "
            f"Python ({sys.platform}) has none of it. Pick 'ram_sync' / 'ram_async' (or 'gpu'), and no `host_budget`.")
    if bypass is not None:
        if not isinstance(bypass, bool):
            raise ValueError(f"`bypass_page_cache` must be True or False; got {bypass!r}.")
        if not file_like:
            raise ValueError(
                f"`bypass_page_cache` only applies to the file modes (and RAM modes with a `host_budget`); got "
                f"bypass_page_cache={bypass} with mode {mode.value!r}. Remove it, or pick 'file_sync' / 'file_async'.")
    if file_dir is None:
        return
    if not file_like:
        raise ValueError(
            f"`file_dir` only applies to the file modes (and RAM modes with a `host_budget`); got "
            f"file_dir={file_dir!r} with mode {mode.value!r}. Remove it, or pick 'file_sync' / 'file_async'.")
    if not isinstance(file_dir, (str, os.PathLike)):
        raise ValueError(f"`file_dir` must be a path; got {file_dir!r}.")
    path = os.fspath(file_dir)
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "missing"
        raise ValueError(
            f"`file_dir` must be an existing directory; got {path!r}, which is {what}. "
            "Create the directory first, or pass file_dir=None for a private temp dir.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(
            f"`file_dir` must be writable; got {path!r}, which this process cannot write to. "
            "Pick a writable directory, or pass file_dir=None for a private temp dir.")
