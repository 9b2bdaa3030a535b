"""`python -m offload_core bench [...]` runs the benchmark; `stream [...]` the tiers' streaming benchmark;
`python -m offload_core demo` a quick round trip."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "bench"
    if command == "bench":
        from .bench import main as bench_main
        return bench_main(argv) or 0
    if command == "stream":
        from .bench.stream import main as stream_main
        return stream_main(argv) or 0
    if command == "demo":
        from .demo import main as demo_main
        return demo_main(argv) or 0
    print(f"unknown command {command!r}; use 'bench', 'stream' or 'demo'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
