"""The `shardwise` command line.

Owns: parsing the command line and dispatching to library functions; prints results.
Subcommands: `run` (torch's elastic launcher, as torchrun), `plan` (the wrap plan and
per-rank memory of a model built on the meta device), `demo` (the main job), `config`
(show a resolved config, generate the reference), `plot RUN_DIR` and
`checkpoint ls|inspect|export|verify DIR`.

Must not: hold logic of its own beyond argument handling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise.cli.grace import GRACE_S
from shardwise.cli.launch import (
    demo_command,
    grace_arg,
    nnodes_arg,
    non_negative_arg,
    nproc_arg,
    run_command,
    seconds_arg,
)
from shardwise.cli.plan import plan_command
from shardwise.config.run_file import REFERENCE_PAGE
from shardwise.memory.model_states import format_bytes


class _SourceFlag(argparse.Action):
    """Store the file of --from/--deepspeed/--accelerate-config, and which flag named it
    (the flag must agree with the suffix that picks the reader: `check_flag`)."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, values)
        namespace.source_flag = option_string


def _plot(args: argparse.Namespace) -> int:
    from shardwise.train.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    import shardwise.checkpoint as ck

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
            size = format_bytes(c.size_bytes)
            print(f"{c.path.name:<24} step {c.step:>8}  {size:>10}  {state}{mark}")
        return 0
    if args.action == "inspect":
        manifest = ck.read_manifest(args.dir)
        metadata = ck.read_dcp_metadata(ck.resolve_checkpoint(args.dir) / ck.STATE_DIR)
        shown = {k: v for k, v in manifest.items() if k != "files"}
        print(json.dumps(shown, indent=2))
        print(f"files: {len(manifest['files'])}, {format_bytes(manifest.get('bytes', 0))}")
        print("tensors:")
        for key, md in sorted(metadata.state_dict_metadata.items()):
            shape = tuple(getattr(md, "size", ()))
            dtype = str(getattr(getattr(md, "properties", None), "dtype", "")).removeprefix(
                "torch."
            )
            print(f"  {key:<60} {shape!s:<20} {dtype}")
        return 0
    if args.action == "verify":
        directory = ck.resolve_checkpoint(args.dir)
        problems = ck.verify_checkpoint(directory)
        for p in problems:
            print(f"PROBLEM {p}")
        print(f"{directory}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 0 if not problems else 1
    from shardwise.checkpoint.export import export_weights

    # A corrupted checkpoint raises CheckpointError (a RuntimeError): main() exits 2 with it.
    path = export_weights(
        args.dir,
        args.out,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        verify=not args.no_verify,
        kind=args.kind,
    )
    print(f"wrote {path}")
    return 0


def _config(args: argparse.Namespace) -> int:
    from shardwise.config import run_file as schema

    if args.action == "show" and getattr(args, "source", None):
        from shardwise.config.foreign import read_foreign

        if args.config is not None or args.overrides:
            raise ValueError(
                "config show --from FILE reads that file alone: drop --config and the "
                "overrides (apply them to the translated YAML this prints)."
            )
        translation = read_foreign(args.source)
        print(translation.table())
        print()
        config = translation.config  # a ConfigError naming every refused key
        if translation.schedule is not None:
            print("# scheduler: the DeepSpeed schedule above is built by")
            print("# Translation.build_scheduler(optimizer); this section stays 'none'.")
        print(schema.dump_config(config), end="")
        return 0
    if args.action == "show":
        print(
            schema.dump_config(schema.load_config(args.config, args.overrides, cls=schema.Config)),
            end="",
        )
        return 0
    if args.update:
        changed = schema.update_reference(args.update)
        print(f"{args.update}: {'updated' if changed else 'already up to date'}")
        return 0
    print(schema.reference_markdown(), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise",
        description="Scale a PyTorch model from one process to DDP, ZeRO-2, FSDP or HSDP.",
    )
    parser.add_argument("--version", action="version", version=f"shardwise {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="launch SCRIPT on N processes per node (torch's elastic launcher)"
    )
    run.add_argument(
        "--nproc",
        type=nproc_arg,
        default=None,
        help="processes per node, or 'auto' (GPUs, or 2 on CPU; default $PET_NPROC_PER_NODE "
        "when set, as torchrun, else auto)",
    )
    run.add_argument(
        "--nnodes",
        type=nnodes_arg,
        default=None,
        help="number of nodes, or MIN:MAX for an elastic job (needs --rdzv-endpoint; default "
        "$PET_NNODES when set, else 1)",
    )
    run.add_argument(
        "--node-rank",
        type=non_negative_arg("--node-rank"),
        default=None,
        help="this node's rank (multi-node; default $PET_NODE_RANK when set, else 0)",
    )
    run.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT every node can reach (multi-node; default "
        "$PET_MASTER_ADDR:$PET_MASTER_PORT when the port is set, hosted by node rank 0)",
    )
    run.add_argument(
        "--rdzv-id",
        default=None,
        help="the job's name at the rendezvous, the same on every node: jobs sharing one "
        "store (`shardwise rendezvous`) stay apart when their ids differ (default: "
        "$SLURM_JOB_ID under SLURM, else torchrun's 'none'; multi-node)",
    )
    run.add_argument(
        "--max-restarts",
        type=non_negative_arg("--max-restarts"),
        default=0,
        help="restart the job this many times on failure; it resumes from its last checkpoint "
        "when the script uses RunnerConfig(resume='latest')",
    )
    run.add_argument(
        "--timeout",
        type=seconds_arg,
        default=None,
        help="seconds a collective may wait before the job fails, naming the stuck rank in "
        "steps wrapped by shardwise.distributed.guard (default 300; sets SHARDWISE_TIMEOUT_S)",
    )
    run.add_argument(
        "--grace",
        type=grace_arg,
        default=GRACE_S,
        help="seconds the other workers may run on after one fails, to end or fail on their "
        f"own, before the launcher stops them (default {GRACE_S:g}; 0: at once, as torchrun)",
    )
    run.add_argument(
        "--from",
        "--deepspeed",
        "--accelerate-config",
        dest="source",
        action=_SourceFlag,
        default=None,
        metavar="FILE",
        help="another tool's config (DeepSpeed .json, Accelerate .yaml, torchtitan .toml), "
        "checked before anything starts; shardwise.wrap(model) with no config takes its "
        "layout, shardwise.translation_from_env() its training values",
    )
    run.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m"
    )
    run.add_argument("script", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(func=run_command)

    plan = sub.add_parser(
        "plan", help="print the wrap plan and per-rank memory, built on the meta device"
    )
    plan.add_argument(
        "target",
        help="MODULE:FACTORY that returns the model, e.g. shardwise.testing.models:GPT or "
        "path/to/models.py:build",
    )
    plan.add_argument("--world", type=int, required=True, help="world size to plan for")
    plan.add_argument(
        "--config", default=None, help="a YAML config (its parallel/optimizer sections)"
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.add_argument(
        "--simulate",
        nargs="?",
        const="fast",
        default=None,
        action=_SimulateAction,
        metavar="{fast,full}",
        help="also run one training step per strategy on fake tensors with a fake process "
        "group of --world ranks (CPU, no real memory): each rank's peak, activations "
        "included. fast (the default): each distinct block traced and the step composed; "
        "--simulate=full traces every block, to check it",
    )
    plan.add_argument(
        "--batch",
        type=int,
        default=None,
        help="micro-batch per rank of the default token input (default 1)",
    )
    plan.add_argument(
        "--input",
        default=None,
        help="MODULE:FUNCTION returning one rank's example batch (a tensor, tuple or dict of "
        "the model's arguments): the input for any model, instead of --batch/--seq-len",
    )
    plan.add_argument(
        "--memory-budget",
        default=None,
        help="per-rank budget each row is checked against, e.g. 70GiB, 80GB or 85%% "
        "(default: parallel.memory_budget, else 90%% of this machine's device memory)",
    )
    plan.add_argument(
        "--verbose", action="store_true", help="with --simulate: each simulation's categories"
    )
    plan.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="sequence length for the peak with activations (default: the model config's seq_len)",
    )
    plan.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel degree (the same as the override parallel.tp=N)",
    )
    plan.add_argument(
        "--pp",
        type=int,
        default=None,
        help="pipeline stages (the same as the override parallel.pp=N): each stage's part "
        "and model states",
    )
    plan.add_argument(
        "--ep",
        type=int,
        default=None,
        help="expert-parallel degree (the same as the override parallel.ep=N): where each "
        "rank's experts go, and the model states per rank",
    )
    plan.add_argument(
        "--cp",
        type=int,
        default=None,
        help="context-parallel degree (the same as the override parallel.cp=N): the layout",
    )
    plan.add_argument(
        "--expert-load",
        default=None,
        help="with --ep and --simulate: the busiest rank's received rows over the balanced "
        "count, a number >= 1 (default 2.0), or 'worst'",
    )
    plan.add_argument("overrides", nargs="*", help="section.key=value")
    plan.set_defaults(func=plan_command)

    demo = sub.add_parser(
        "demo", help="train a small GPT on Python's own source with FSDP (about a minute)"
    )
    demo.add_argument(
        "--nproc",
        type=nproc_arg,
        default=None,
        help="processes (default 2, or 1 on a machine with one GPU)",
    )
    demo.add_argument("--short", action="store_true", help="a few steps only")
    demo.add_argument("--config", default=None, help="a YAML file with the demo's sections")
    demo.add_argument("overrides", nargs="*", help="section.key=value, e.g. runner.max_steps=50")
    demo.set_defaults(func=demo_command)

    config = sub.add_parser("config", help="show a resolved config, or the generated reference")
    config_actions = config.add_subparsers(dest="action", required=True)
    show = config_actions.add_parser(
        "show", help="the config after the file and overrides, as YAML"
    )
    show.add_argument("--config", default=None, help="a YAML config file")
    show.add_argument(
        "--from",
        dest="source",
        default=None,
        metavar="FILE",
        help="a DeepSpeed JSON, Accelerate YAML or torchtitan TOML config: print what each key "
        "becomes "
        "(exact, differs, no effect or refused), then the shardwise config it implies",
    )
    show.add_argument("overrides", nargs="*", help="section.key=value")
    reference = config_actions.add_parser("reference", help="the Markdown reference of every key")
    reference.add_argument(
        "--update",
        nargs="?",
        const=REFERENCE_PAGE,
        default=None,
        metavar="FILE",
        help=f"rewrite the generated block in FILE (default: {REFERENCE_PAGE})",
    )
    config.set_defaults(func=_config)

    rdzv = sub.add_parser(
        "rendezvous",
        help="host an elastic job's rendezvous store, so that any node may leave the job",
    )
    rdzv.add_argument("--host", default="0.0.0.0", help="address to listen on")
    rdzv.add_argument("--port", type=int, required=True, help="the port of --rdzv-endpoint")
    rdzv.set_defaults(func=_rendezvous)

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
        ("export", "verify, then write the model weights as consolidated safetensors"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("dir", help="a checkpoint, or a root holding checkpoints (its latest)")
        if name == "export":
            p.add_argument("--out", required=True, help="output directory")
            p.add_argument("--dtype", default=None, help="cast floating tensors (e.g. bf16)")
            p.add_argument("--max-shard-bytes", type=int, default=5 * 2**30)
            p.add_argument(
                "--no-verify",
                action="store_true",
                help="skip the size and SHA-256 check of the checkpoint's files (done by default)",
            )
            kinds = p.add_mutually_exclusive_group()
            for flag, kind, text in (
                ("--adapter", "adapter", "peft's format: adapter_model.safetensors and "
                 "adapter_config.json (the default for a checkpoint of a peft model)"),
                ("--merged", "merged", "LoRA merged into the base weights, in the base "
                 "model's names (from a full checkpoint of a LoRA model)"),
                ("--full", "full", "every tensor under the model's own names (the default "
                 "for any other checkpoint)"),
            ):  # fmt: skip
                kinds.add_argument(flag, dest="kind", action="store_const", const=kind, help=text)
            p.set_defaults(kind="auto")
    ckpt.set_defaults(func=_checkpoint)
    return parser


def _rendezvous(args: argparse.Namespace) -> int:
    from shardwise.cli.launch import host_rendezvous

    return host_rendezvous(args.host, args.port)


class _SimulateAction(argparse.Action):
    """`--simulate` (fast), `--simulate=fast`, `--simulate full` or `--simulate=full`."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        if value not in (None, "fast", "full"):
            parser.error(f"--simulate={value}: --simulate takes fast or full (--simulate=full)")
        setattr(namespace, self.dest, value or "fast")


def _bare_simulate(argv: Sequence[str]) -> list[str]:
    """A bare `--simulate` followed by anything but fast or full (the model, an override,
    another option) is `--simulate=fast`: the flag never takes the next word from them, so
    `plan --simulate MODEL:FACTORY` reads as it did when --simulate took no value."""
    out = list(argv)
    if next((a for a in out if not a.startswith("-")), None) != "plan":
        return out  # `shardwise run script.py --simulate` is the script's own flag
    for i, arg in enumerate(out):
        if arg == "--simulate" and (i + 1 == len(out) or out[i + 1] not in ("fast", "full")):
            out[i] = "--simulate=fast"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_bare_simulate(sys.argv[1:] if argv is None else argv))
    # Overrides may follow options (plan X --world 4 runner.max_steps=3); argparse leaves
    # positionals after an option unparsed, so take the key=value ones here.
    if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "source_flag", None):  # `--deepspeed file.yaml`: one line, nothing run
            from shardwise.config.foreign import check_flag

            check_flag(args.source_flag, args.source)
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:  # `shardwise checkpoint inspect ... | head` closed our stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (FileNotFoundError, ValueError, ImportError, RuntimeError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shardwise")
    except PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
