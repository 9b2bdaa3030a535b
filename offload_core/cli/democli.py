"""`python -m offload_core demo`: a round trip through every mode with synthetic K/V, checked, then timed.

Not the benchmark (that runs a real pipeline); a quick check that each mode works on this machine. Each row
says whether every layer came back bit-identical and whether the cache really lived in that mode's places; the command
exits 1 when any row fails either check.
"""

from __future__ import annotations

import tempfile

from . import cliargs


def build_parser() -> cliargs.Parser:
    p = cliargs.Parser(prog="python -m offload_core demo", description=__doc__)
    p.add_argument("--device", help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--layers", type=int, default=16, help="layers to put and get (default 16, at least 1)")
    p.add_argument("--mib", type=float, default=8.0, help="size of K (and of V) per layer, MiB (default 8)")
    return p


MAX_LAYERS = 10_000  # real models have 24 to 60; a round trip of more layers checks nothing more
MAX_MIB = 4096  # one K of 4 GiB: past any real layer


def check(args, parser) -> None:
    if not 1 <= args.layers <= MAX_LAYERS:
        parser.error(f"--layers must be between 1 and {MAX_LAYERS}; got {args.layers}. Real models have 24 to 60.")
    if not 2 / 2**20 <= args.mib <= MAX_MIB:  # one bfloat16 element at least (also refuses nan and inf)
        parser.error(f"--mib must be between one bfloat16 element (2 bytes, {2 / 2**20:.7f}) and {MAX_MIB}; "
                     f"got {args.mib}.")
    # Every layer lives in RAM on a CPU device (twice while a mode holds its copy, more for a moment), and on
    # disk while a file mode runs.
    total = args.layers * 2 * max(1, int(args.mib * 2**20) // 2) * 2
    on_cpu = args.device in (None, "cpu") or str(args.device).startswith("cpu")
    cliargs.room(parser, f"--layers {args.layers} --mib {args.mib:g}", total, ram=total * (3 if on_cpu else 1),
                 disk_in=tempfile.gettempdir(), disk=total)
    args.device = cliargs.device(parser, args.device)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(args, parser)
    from . import demo

    return demo.run(args)
