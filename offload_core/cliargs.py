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


def at_least(parser: argparse.ArgumentParser, option: str, value, low, why: str = "") -> None:
    """`value` of `option` is >= `low`, else a usage error (`why`: the sentence after the rule)."""
    if not value >= low:  # also refuses nan
        parser.error(f"{option} must be >= {low}; got {value}.{' ' + why if why else ''}")


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
