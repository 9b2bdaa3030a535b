"""`python -m offload_core COMMAND [...]`: the engine's command-line tools.

Each command is a module with a `main(argv) -> int`; a new command registers itself in `COMMANDS`.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread as an interrupt: every cleanup a Ctrl-C runs runs for it too
    (stores closed, their files and folders deleted), instead of the process dying with its files left."""


def _terminate(signum, frame):
    raise Terminated(signal.Signals(signum).name)


def run_interruptible(fn, *args) -> int:
    """`fn(*args)`, with SIGTERM and SIGHUP turned into `Terminated` meanwhile; an interrupt of any kind is one
    line on stderr and the shell's status for it (130 for Ctrl-C, 128 + the signal's number otherwise)."""
    signals = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    if threading.current_thread() is not threading.main_thread():
        signals = []  # only the main thread may set handlers (a program calling main() from a thread of its own)
    previous = {s: signal.signal(s, _terminate) for s in signals}
    try:
        return fn(*args) or 0
    except KeyboardInterrupt as exc:
        number = getattr(signal, str(exc), None) if isinstance(exc, Terminated) else signal.SIGINT
        print(f"python -m offload_core: interrupted ({signal.Signals(number).name}); cleaned up.", file=sys.stderr)
        return 128 + int(number)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

# name -> (module, one line for the help). Modules are imported only when their command runs.
COMMANDS = {
    "bench": ("offload_core.bench", "the speed/memory table of every KV-cache mode on this machine"),
    "stream": ("offload_core.bench.stream.cli", "each mode's throughput against this machine's raw disk, RAM and PCIe "
               "limits, and how much of it compute hides"),
    "arvideo": ("offload_core.bench.arvideo", "the autoregressive video cache (Causal-WAN) at real layer shapes: device "
                "bytes, bytes moved and step time per mode"),
    "demo": ("offload_core.cli.democli", "a round trip through every mode with synthetic K/V: checked, then timed"),
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
    return run_interruptible(module.main, argv)


if __name__ == "__main__":
    sys.exit(main())
