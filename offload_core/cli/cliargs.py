"""Checks shared by the command-line tools: each bad value becomes a one-line usage error (exit 2) before any
work, naming the option, the value, the rule and the fix.

Nothing here imports torch at module level: `--help` and every usage error that needs no device answer in a
fraction of a second. Only `device` imports it, after the torch-free checks of the command have passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
from typing import Optional

DEVICE_NAME = re.compile(r"(cpu|cuda|xpu|mps)(:\d+)?")
# Device types torch knows that the tools do not run on (torch's list; told apart from a misspelling).
OTHER_TORCH_DEVICES = ("meta", "hpu", "xla", "mtia", "maia", "ipu", "hip", "lazy", "vulkan", "ve", "fpga",
                       "mkldnn", "opengl", "opencl", "ideep", "privateuseone")
# --dtype spellings -> torch dtype names (looked up in torch once the options have passed)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def deprecated_alias(parser, old: str, new: str) -> None:
    """Accept `old` for one release as another name of option `new` (same value); using it says so on stderr.
    `parser`: the parser, or the mutually exclusive group that also holds `new`, so that giving both is refused."""

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"{parser.prog}: {old} is deprecated and goes in the next release; use {new}.", file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=Alias, default=argparse.SUPPRESS,
                        metavar=new.lstrip("-").upper(), help=f"deprecated alias of {new}, kept for one release")


def at_least(parser: argparse.ArgumentParser, option: str, value, low, why: str = "", high=None) -> None:
    """`value` of `option` is >= `low` (and <= `high`, if given), else a usage error (`why`: the sentence after
    the rule). The upper bounds are far past any real run: a value beyond them is a typo that would otherwise
    run for hours or fail halfway for want of memory."""
    if high is not None and not low <= value <= high:  # also refuses nan
        parser.error(f"{option} must be between {low} and {high}; got {value}.{' ' + why if why else ''}")
    if not value >= low:
        parser.error(f"{option} must be >= {low}; got {value}.{' ' + why if why else ''}")


def room(parser: argparse.ArgumentParser, what: str, nbytes: int, *, ram: int = 0, disk_in: Optional[str] = None,
         disk: int = 0) -> None:
    """The run's `ram` bytes fit in the RAM available now and its `disk` bytes on the disk of `disk_in`, else a
    usage error naming `what` (the options that size the run), the figures and the fix: refused before anything
    is allocated, instead of failing (or swapping) halfway."""
    import shutil

    import psutil

    free_ram = psutil.virtual_memory().available
    if ram > free_ram:
        parser.error(f"{what} needs about {_gib(ram)} of RAM ({_gib(nbytes)} of K/V, several copies at once); "
                     f"{_gib(free_ram)} is available. Pick fewer or smaller layers.")
    if disk_in is not None and disk > shutil.disk_usage(disk_in).free:
        parser.error(f"{what} needs about {_gib(disk)} of disk in {disk_in}; {_gib(shutil.disk_usage(disk_in).free)} "
                     "is free there. Pick fewer or smaller layers, or another folder.")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def output_file(parser: argparse.ArgumentParser, option: str, path: Optional[str]) -> None:
    """`path` can be written, proven by creating it (and removing it again if it did not exist before).

    Checked before the run, so a long benchmark never ends in a lost result. Permission bits are not asked
    (`os.access` says yes to root, also on /proc or a read-only mount); the filesystem is. An existing file is
    opened for appending, so nothing in it changes until the run writes it.
    """
    if path is None:
        return
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        example = os.path.join(path, "out")
        parser.error(f"{option} {path!r} names a directory; give a file name inside it, e.g. {example}.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} {path!r}: the folder {folder!r} does not exist; create it (mkdir -p) or pick another.")
    existed = os.path.exists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        parser.error(f"{option} {path!r} cannot be written ({exc.strerror or exc}); pick a path you can write to.")
    if not existed:
        os.remove(path)


def output_folder(parser: argparse.ArgumentParser, option: str, folder: str) -> None:
    """Files can be created in the existing folder `folder`, proven by creating (and removing) one there."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kv_offload-check-", dir=folder))
    except OSError as exc:
        parser.error(f"{option} {folder!r}: nothing can be created there ({exc.strerror or exc}); pick a folder you "
                     "can write to.")


def device(parser: argparse.ArgumentParser, name: Optional[str]):
    """The `--device` value as a torch.device this build can use (default: cuda, else xpu, if available; else cpu)."""
    if name is not None and not DEVICE_NAME.fullmatch(name):
        if name.split(":")[0] in OTHER_TORCH_DEVICES:
            parser.error(f"--device {name!r}: the tools run on cpu, cuda, xpu or mps; got device type "
                         f"{name.split(':')[0]!r}.")
        parser.error(f"--device {name!r} is not a device name; use cpu, cuda, cuda:N, xpu, xpu:N or mps.")
    import torch

    if name is None:
        return torch.device(next((t for t in ("cuda", "xpu") if _backend_available(torch, t)), "cpu"))
    dev = torch.device(name)
    build = f"this torch ({torch.__version__})"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {name!r}: {build} has no CUDA device. Use --device cpu, or install a CUDA build "
                         "of torch (see README, TORCH_INDEX).")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"--device {name!r}: there are {torch.cuda.device_count()} CUDA device(s), numbered from 0.")
    elif dev.type == "xpu":
        if not _backend_available(torch, "xpu"):
            parser.error(f"--device {name!r}: {build} has no XPU device. Use --device cpu, or install the XPU build "
                         "of torch (PyTorch's xpu index).")
        if dev.index is not None and dev.index >= torch.xpu.device_count():
            parser.error(f"--device {name!r}: there are {torch.xpu.device_count()} XPU device(s), numbered from 0.")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        parser.error(f"--device {name!r}: {build} has no MPS device here (Apple silicon only). Use --device cpu.")
    return dev


def _backend_available(torch, kind: str) -> bool:
    backend = getattr(torch, kind, None)
    return bool(backend is not None and backend.is_available())


def missing(*modules: str) -> list:
    """The names among `modules` that cannot be imported here (looked up, not imported)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            absent.append(name)
    return absent
