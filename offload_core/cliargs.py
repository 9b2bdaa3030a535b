"""Checks shared by the command-line tools: each bad value becomes a one-line usage error (exit 2) before any
work, naming the option, the value, the rule and the fix."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Optional

import torch


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def output_file(parser: argparse.ArgumentParser, option: str, path: Optional[str]) -> None:
    """`path` can be written: not a directory, in an existing, writable folder (checked before the run, so a
    long benchmark never ends in a lost result)."""
    if path is None:
        return
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        example = os.path.join(path, "out")
        parser.error(f"{option} {path!r} names a directory; give a file name inside it, e.g. {example}.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{option} {path!r}: the folder {folder!r} does not exist; create it (mkdir -p) or pick another.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        parser.error(f"{option} {path!r} is not writable by this user; pick a path you can write to.")


def device(parser: argparse.ArgumentParser, name: Optional[str]) -> torch.device:
    """The `--device` value as a device this torch build can use (default: cuda, else xpu, if available; else cpu)."""
    if name is None:
        return torch.device(next((t for t in ("cuda", "xpu") if _backend_available(t)), "cpu"))
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        parser.error(f"--device {name!r} is not a device name; use cpu, cuda, cuda:N, xpu, xpu:N or mps.")
    build = f"this torch ({torch.__version__})"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {name!r}: {build} has no CUDA device. Use --device cpu, or install a CUDA build "
                         "of torch (see README, TORCH_INDEX).")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"--device {name!r}: there are {torch.cuda.device_count()} CUDA device(s), numbered from 0.")
    elif dev.type == "xpu":
        if not _backend_available("xpu"):
            parser.error(f"--device {name!r}: {build} has no XPU device. Use --device cpu, or install the XPU build "
                         "of torch (PyTorch's xpu index).")
        if dev.index is not None and dev.index >= torch.xpu.device_count():
            parser.error(f"--device {name!r}: there are {torch.xpu.device_count()} XPU device(s), numbered from 0.")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            parser.error(f"--device {name!r}: {build} has no MPS device here (Apple silicon only). Use --device cpu.")
    elif dev.type != "cpu":
        parser.error(f"--device {name!r}: the tools run on cpu, cuda, xpu or mps; got device type {dev.type!r}.")
    return dev


def _backend_available(kind: str) -> bool:
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
