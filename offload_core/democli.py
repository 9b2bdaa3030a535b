"""`python -m offload_core demo`: a round trip through every tier with synthetic K/V, checked, then timed.

Not the benchmark (that runs a real pipeline); a quick check that each tier works on this machine. Each row
says whether every layer came back bit-identical and whether the cache really lived in that tier; the command
exits 1 when any row fails either check.
"""

from __future__ import annotations

from . import cliargs


def build_parser() -> cliargs.Parser:
    p = cliargs.Parser(prog="python -m offload_core demo", description=__doc__)
    p.add_argument("--device", help="compute device (default: cuda if available, else cpu)")
    p.add_argument("--layers", type=int, default=16, help="layers to put and get (default 16, at least 1)")
    p.add_argument("--mib", type=float, default=8.0, help="size of K (and of V) per layer, MiB (default 8)")
    return p


def check(args, parser) -> None:
    if args.layers < 1:
        parser.error(f"--layers must be >= 1; got {args.layers}. A round trip of no layers checks nothing.")
    if not args.mib * 2**20 >= 2:  # one bfloat16 element (also refuses nan)
        parser.error(f"--mib must be at least one bfloat16 element (2 bytes); got {args.mib}.")
    args.device = cliargs.device(parser, args.device)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check(args, parser)
    from . import demo

    return demo.run(args)
