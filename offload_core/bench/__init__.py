"""The benchmark behind `python -m offload_core bench`; `main(argv)` is its entry point.

Imported lazily: `python -m offload_core stream` (in `stream/cli.py`) needs neither diffusers nor the models, and
`--help` needs no torch.
"""


def main(argv=None):
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
