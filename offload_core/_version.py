"""The package version, written once: `version` in the project's pyproject.toml.

A git clone that ComfyUI loads without `pip install` has the pyproject.toml beside this package, so that file
is read first (it is also what an editable install points at); an installed wheel has no pyproject.toml and
answers from its metadata, which was built from the same file.
"""

from __future__ import annotations

import os
import re
from typing import Optional

DISTRIBUTION = "comfyui-kv-offload"
_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def from_pyproject(path: str = _PYPROJECT) -> Optional[str]:
    """`version` of the [project] table of `path`, or None when there is no such file or line.

    A line scan, not a TOML parser: `tomllib` is Python 3.11+ and the pack supports 3.10.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    project = re.search(r"^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project is None or not re.search(rf'^name\s*=\s*"{DISTRIBUTION}"', project.group(1), re.M):
        return None  # someone else's pyproject.toml (the package was copied into another project)
    found = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return found.group(1) if found else None


def package_version() -> str:
    found = from_pyproject()
    if found is not None:
        return found
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return "unknown"
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
