"""The `shardwise` command line.

Owns: parsing the command line and dispatching to library functions; prints results.
Subcommands so far: `plot RUN_DIR` (loss, lr and throughput curves to PNG) and
`checkpoint ls|inspect|export|verify DIR`.

Must not: hold logic of its own beyond argument handling.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _plot(args: argparse.Namespace) -> int:
    from shardwise.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _checkpoint(args: argparse.Namespace) -> int:
    from shardwise import checkpoint as ck

    if args.action == "ls":
        found = ck.list_checkpoints(args.dir)
        latest = (
            (Path(args.dir) / ck.LATEST).read_text().strip()
            if (Path(args.dir) / ck.LATEST).is_file()
            else None
        )
        if not found:
            print(f"no checkpoints under {args.dir}")
        for c in found:
            state = "complete" if c.complete else "INCOMPLETE (ignored)"
            mark = "  <- latest" if c.path.name == latest else ""
            print(f"{c.path.name:<24} step {c.step:>8}  {_human(c.size_bytes):>10}  {state}{mark}")
        return 0
    if args.action == "inspect":
        manifest = ck.read_manifest(args.dir)
        metadata = ck.read_dcp_metadata(ck.resolve_checkpoint(args.dir) / ck.STATE_DIR)
        shown = {k: v for k, v in manifest.items() if k != "files"}
        print(json.dumps(shown, indent=2))
        print(f"files: {len(manifest['files'])}, {_human(manifest.get('bytes', 0))}")
        print("tensors:")
        for key, md in sorted(metadata.state_dict_metadata.items()):
            size = tuple(getattr(md, "size", ()))
            dtype = str(getattr(getattr(md, "properties", None), "dtype", "")).removeprefix(
                "torch."
            )
            print(f"  {key:<60} {size!s:<20} {dtype}")
        return 0
    if args.action == "verify":
        directory = ck.resolve_checkpoint(args.dir)
        problems = ck.verify_checkpoint(directory)
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"{directory}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 0 if not problems else 1
    from shardwise.weights import export_weights

    path = export_weights(
        args.dir, args.out, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes
    )
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

    ckpt = sub.add_parser("checkpoint", help="list, inspect, verify or export checkpoints")
    actions = ckpt.add_subparsers(dest="action", required=True)
    for name, text in (
        ("ls", "list the checkpoints under a root, newest last"),
        ("inspect", "show a checkpoint's manifest and tensors"),
        ("verify", "check every file's size and SHA-256 (exit 1 on problems)"),
        ("export", "write the model weights as consolidated safetensors"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("dir", help="a checkpoint, or a root holding checkpoints (its latest)")
        if name == "export":
            p.add_argument("--out", required=True, help="output directory")
            p.add_argument("--dtype", default=None, help="cast floating tensors (e.g. bf16)")
            p.add_argument("--max-shard-bytes", type=int, default=5 * 2**30)
    ckpt.set_defaults(func=_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError, ImportError, RuntimeError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
