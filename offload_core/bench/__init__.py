"""The benchmark behind `python -m offload_core bench`; `main(argv)` is its entry point."""

from .cli import main

__all__ = ["main"]
