"""The `shardwise` command line.

Owns: parsing the command line and dispatching to library functions; prints results.
Subcommands so far: `plot RUN_DIR` (loss, lr and throughput curves to PNG).

Must not: hold logic of its own beyond argument handling.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _plot(args: argparse.Namespace) -> int:
    from shardwise.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Scale a PyTorch model from one process to DDP, ZeRO-2, FSDP or HSDP.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plot = sub.add_parser("plot", help="render a run's loss, lr and throughput curves to PNG")
    plot.add_argument("run_dir", help="a run directory written by shardwise.Runner")
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    plot.set_defaults(func=_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
