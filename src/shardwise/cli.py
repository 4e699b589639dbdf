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
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardwise.memory import format_bytes


def _plot(args: argparse.Namespace) -> int:
    from shardwise.plot import plot_run

    path = plot_run(args.run_dir, args.out)
    print(f"wrote {path}")
    return 0


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
    from shardwise.weights import export_weights

    # A corrupted checkpoint raises CheckpointError (a RuntimeError): main() exits 2 with it.
    path = export_weights(
        args.dir,
        args.out,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_bytes,
        verify=not args.no_verify,
    )
    print(f"wrote {path}")
    return 0


def _nproc(value: str) -> int:
    if value == "auto":
        import torch

        return torch.cuda.device_count() or 2  # the GPUs, or 2 CPU processes
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--nproc={value!r}: use a positive integer or 'auto'"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"--nproc={n}: use a positive integer or 'auto'")
    return n


def _nnodes(value: str) -> str:
    """--nnodes: N, or MIN:MAX for an elastic job (torchrun's syntax)."""
    lo, sep, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        low = high = 0
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(
            f"--nnodes={value!r}: use a positive integer N, or MIN:MAX with 1 <= MIN <= MAX "
            "(an elastic job that starts with MIN nodes and admits up to MAX)"
        )
    return f"{low}:{high}" if sep else str(low)


def _non_negative(flag: str) -> Any:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = -1
        if n < 0:
            raise argparse.ArgumentTypeError(f"{flag}={value!r}: use a whole number >= 0")
        return n

    return parse


def _seconds(value: str) -> float:
    try:
        s = float(value)
    except ValueError:
        s = -1.0
    if not s > 0:
        raise argparse.ArgumentTypeError(
            f"--timeout={value!r}: use a positive number of seconds (the collective timeout)"
        )
    return s


def _max_nodes(nnodes: str | int) -> int:
    return int(str(nnodes).rpartition(":")[2])


def launcher_args(args: argparse.Namespace) -> list[str]:
    """torchrun's arguments for our `run` flags (single node: --standalone)."""
    nnodes = str(args.nnodes)
    out = ["--nproc_per_node", str(args.nproc), "--nnodes", nnodes]
    if _max_nodes(nnodes) == 1 and not args.rdzv_endpoint:
        out.append("--standalone")
    else:
        if not args.rdzv_endpoint:
            raise ValueError(
                f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node) "
                "so the nodes can find each other."
            )
        if ":" not in nnodes and not 0 <= args.node_rank < int(nnodes):
            raise ValueError(
                f"--node-rank={args.node_rank} must be in [0, --nnodes={nnodes}): give each "
                "node's launcher its own number, 0 on the first."
            )
        out += [
            "--node_rank",
            str(args.node_rank),
            "--rdzv_backend",
            "c10d",
            "--rdzv_endpoint",
            args.rdzv_endpoint,
        ]
    out += ["--max_restarts", str(args.max_restarts)]
    return out


# torch's elastic agent by default hosts one TCPStore for the whole run and hands it to
# every worker generation (TORCHELASTIC_USE_AGENT_STORE). A restart re-runs
# init_process_group against the same store, where the dead generation's keys are still
# set: the process group's prefix ("default_pg/0/") does not change between restarts, so
# a new rank can read a dead peer's Gloo address ("connectFullMesh failed ... Connection
# refused") or count stale keys in a store barrier (a hang). With the sharing switched
# off, each rendezvous round hands out a fresh port and worker rank 0 hosts a new, empty
# store (dynamic_rendezvous.py, next_rendezvous). Measured with bench/soak.py (rank 1
# SIGKILLed at a random step, torch 2.13, 2 CPU ranks): with sharing 8 of 12 trials
# resumed (3 died in connectFullMesh, 1 hung); without it 8 of 8, each with one restart.
# See pytorch#135712. An explicit value set by the user is kept.
_LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _launch(torchrun_args: list[str], *, timeout_s: float | None = None) -> int:
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from shardwise.distributed import LAUNCHER_PID_ENV, TIMEOUT_ENV

    # The agent runs in this process and its workers inherit this environment.
    for key, value in _LAUNCH_ENV.items():
        os.environ.setdefault(key, value)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # workers die with us (init_distributed)
    if timeout_s is not None:
        os.environ[TIMEOUT_ENV] = repr(timeout_s)
    try:
        run(get_args_parser().parse_args(torchrun_args))
    except ChildFailedError as exc:
        print(f"shardwise: a process failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


def _run(args: argparse.Namespace) -> int:
    target = ["-m", args.script] if args.module else [args.script]
    return _launch([*launcher_args(args), *target, *args.script_args], timeout_s=args.timeout)


def _demo(args: argparse.Namespace) -> int:
    passthrough = (["--short"] if args.short else []) + (
        ["--config", args.config] if args.config else []
    )
    if args.nproc == 1:
        from shardwise.demo import main as demo_main

        return demo_main([*passthrough, *args.overrides])
    launch = ["--nproc_per_node", str(args.nproc), "--standalone"]
    return _launch([*launch, "-m", "shardwise.demo", *passthrough, *args.overrides])


def _load_factory(target: str) -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{target!r} is not MODULE:FACTORY, e.g. shardwise.models:GPT or mypkg.model:build"
        )
    import importlib

    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from None
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"{target} is not callable")
    return factory


def _plan(args: argparse.Namespace) -> int:
    import warnings

    import torch

    from shardwise.memory import dtype_bytes, estimate_memory, format_memory, memory_json
    from shardwise.schema import Config, load_config
    from shardwise.wrap.plan import PlanNotice, plan_wrap

    if args.world < 1:
        raise ValueError(
            f"--world={args.world}: the world size to plan for must be a positive integer "
            "(the total number of ranks, e.g. --world 8 for 8 GPUs)."
        )
    config = load_config(args.config, args.overrides, cls=Config)
    factory = _load_factory(args.target)
    with torch.device("meta"):  # nothing is allocated: plans of huge models print anywhere
        model = factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanNotice)
        plan = plan_wrap(model, config.parallel)
    precision = config.parallel.precision
    compute = (
        dtype_bytes(str(precision.param_dtype).removeprefix("torch."))
        if precision.is_mixed
        else None
    )
    estimates = estimate_memory(
        plan, args.world, optimizer=config.optimizer.name, compute_dtype_bytes=compute
    )
    parallel = config.parallel
    if args.memory_budget is not None:
        parallel = dataclasses.replace(parallel, memory_budget=args.memory_budget)
    seq_len = args.seq_len
    if seq_len is None:
        from shardwise.simulate import default_seq_len

        seq_len = default_seq_len(model)
    if parallel.strategy == "auto" or parallel.activation_checkpointing == "auto":
        return _plan_auto(args, factory, parallel, config.optimizer.name, seq_len)
    from shardwise.autoplan import format_rows, resolve_budget

    limit, source = resolve_budget(parallel.memory_budget)
    rows = _plan_rows(
        args, factory, model, parallel, estimates, config.optimizer.name, seq_len, limit
    )
    if args.json:
        out = {"plan": plan.to_dict(), "memory": json.loads(memory_json(estimates))}
        out["peaks"] = [dataclasses.asdict(r) for r, _ in rows]
        sims = [s for _, s in rows if s is not None]
        if sims:
            out["simulated"] = [s.to_dict() for s in sims]
        print(json.dumps(out, indent=2))
        return 0
    print(plan)
    print()
    print(f"world size {args.world}, optimizer {config.optimizer.name}, precision {precision}")
    print(format_memory(estimates))
    if rows:
        print()
        print(
            f"per-rank peak with activations, micro-batch {args.batch} x seq {seq_len}, "
            f"AC {parallel.activation_checkpointing}; budget {format_bytes(limit)} ({source})"
        )
        print(format_rows([r for r, _ in rows]))
    for _, sim in rows:
        if sim is not None and args.verbose:
            print()
            print(sim)
    return 0


def _plan_rows(
    args: argparse.Namespace,
    factory: Any,
    model: Any,
    parallel: Any,
    estimates: list[Any],
    optimizer: str,
    seq_len: int | None,
    limit: int,
) -> list[tuple[Any, Any]]:
    """A row per strategy: the instant peak with activations, the simulated one with
    --simulate, and whether it fits the budget. Empty when the sequence length is unknown."""
    from shardwise.autoplan import Candidate, InstantPeak
    from shardwise.simulate import simulate_step

    if seq_len is None:
        return []
    instant = InstantPeak(model, args.world, args.batch, seq_len, optimizer)
    rows = []
    for e in estimates:
        cfg = dataclasses.replace(parallel, strategy=e.strategy)
        estimate = instant(cfg)
        sim = None
        if args.simulate:
            sim = simulate_step(
                factory,
                cfg,
                world=args.world,
                batch=args.batch,
                seq_len=seq_len,
                optimizer=optimizer,
            )
        peak = sim.peak if sim is not None else estimate
        row = Candidate(
            e.strategy,
            str(parallel.activation_checkpointing),
            estimate,
            simulated=sim.peak if sim is not None else None,
            fits=peak <= limit,
        )
        rows.append((row, sim))
    return rows


def _plan_auto(
    args: argparse.Namespace, factory: Any, parallel: Any, optimizer: str, seq_len: int | None
) -> int:
    from shardwise.autoplan import NoPlanFitsError, choose_plan

    try:
        auto = choose_plan(
            factory,
            parallel,
            world=args.world,
            batch=args.batch,
            seq_len=seq_len,
            optimizer=optimizer,
            simulate=args.simulate,
        )
    except NoPlanFitsError as exc:
        if args.json:
            print(json.dumps(exc.plan.to_dict(), indent=2))
        print(f"shardwise plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(auto.to_dict(), indent=2) if args.json else auto)
    return 0


def _config(args: argparse.Namespace) -> int:
    from shardwise import schema

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
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="launch SCRIPT on N processes per node (torch's elastic launcher)"
    )
    run.add_argument(
        "--nproc",
        type=_nproc,
        default=_nproc("auto"),
        help="processes per node, or 'auto' (GPUs, or 2 on CPU)",
    )
    run.add_argument(
        "--nnodes",
        type=_nnodes,
        default="1",
        help="number of nodes, or MIN:MAX for an elastic job (needs --rdzv-endpoint)",
    )
    run.add_argument(
        "--node-rank",
        type=_non_negative("--node-rank"),
        default=0,
        help="this node's rank (multi-node)",
    )
    run.add_argument(
        "--rdzv-endpoint", default=None, help="HOST:PORT every node can reach (multi-node)"
    )
    run.add_argument(
        "--max-restarts",
        type=_non_negative("--max-restarts"),
        default=0,
        help="restart the job this many times on failure; it resumes from its last checkpoint "
        "when the script uses RunnerConfig(resume='latest')",
    )
    run.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="seconds a collective may wait before the job fails, naming the stuck rank in "
        "steps wrapped by shardwise.watchdog.guard (default 300; sets SHARDWISE_TIMEOUT_S)",
    )
    run.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m"
    )
    run.add_argument("script", help="the training script (or module with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(func=_run)

    plan = sub.add_parser(
        "plan", help="print the wrap plan and per-rank memory, built on the meta device"
    )
    plan.add_argument(
        "target", help="MODULE:FACTORY that returns the model, e.g. shardwise.models:GPT"
    )
    plan.add_argument("--world", type=int, required=True, help="world size to plan for")
    plan.add_argument(
        "--config", default=None, help="a YAML config (its parallel/optimizer sections)"
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of tables")
    plan.add_argument(
        "--simulate",
        action="store_true",
        help="also run one training step per strategy on fake tensors with a fake process "
        "group of --world ranks (CPU, no real memory): each rank's peak, activations included",
    )
    plan.add_argument(
        "--batch", type=int, default=1, help="micro-batch per rank for the peak with activations"
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
    plan.add_argument("overrides", nargs="*", help="section.key=value")
    plan.set_defaults(func=_plan)

    demo = sub.add_parser(
        "demo", help="train a small GPT on Python's own source with FSDP (about a minute)"
    )
    demo.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    demo.add_argument("--short", action="store_true", help="a few steps only")
    demo.add_argument("--config", default=None, help="a YAML file with the demo's sections")
    demo.add_argument("overrides", nargs="*", help="section.key=value, e.g. runner.max_steps=50")
    demo.set_defaults(func=_demo)

    config = sub.add_parser("config", help="show a resolved config, or the generated reference")
    config_actions = config.add_subparsers(dest="action", required=True)
    show = config_actions.add_parser(
        "show", help="the config after the file and overrides, as YAML"
    )
    show.add_argument("--config", default=None, help="a YAML config file")
    show.add_argument("overrides", nargs="*", help="section.key=value")
    reference = config_actions.add_parser("reference", help="the Markdown reference of every key")
    reference.add_argument(
        "--update", default=None, help="rewrite the generated block in this file"
    )
    config.set_defaults(func=_config)

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
    ckpt.set_defaults(func=_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (plan X --world 4 runner.max_steps=3); argparse leaves
    # positionals after an option unparsed, so take the key=value ones here.
    if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError, ImportError, RuntimeError) as exc:
        print(f"shardwise {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
