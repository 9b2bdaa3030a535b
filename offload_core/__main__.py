"""`python -m offload_core COMMAND [...]`: the engine's command-line tools.

Each command is a module with a `main(argv) -> int`; a new command registers itself in `COMMANDS`.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one line for the help). Modules are imported only when their command runs.
COMMANDS = {
    "bench": ("offload_core.bench", "the speed/memory table of every KV-cache mode on this machine"),
    "stream": ("offload_core.bench.streamcli", "each tier's throughput against this machine's raw disk, RAM and PCIe "
               "limits, and how much of it compute hides"),
    "demo": ("offload_core.democli", "a round trip through every tier with synthetic K/V: checked, then timed"),
}


def usage() -> str:
    from . import __version__

    width = max(map(len, COMMANDS))
    lines = [f"usage: python -m offload_core COMMAND [options]   (KV Offload {__version__})", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "python -m offload_core COMMAND --help shows the options of one command."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Runs one command. No command prints the help to stderr and returns 2 (a usage error); --help returns 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    command = argv.pop(0)
    if command in ("-h", "--help", "help"):
        print(usage())
        return 0
    if command in ("-V", "--version"):
        from . import __version__

        print(__version__)
        return 0
    if command not in COMMANDS:
        print(f"python -m offload_core: unknown command {command!r}; choose from {', '.join(COMMANDS)} "
              "(python -m offload_core --help lists them).", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
