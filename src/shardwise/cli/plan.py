"""`shardwise plan`: the wrap plan, per-rank memory and the strategy choice, before any run.

Owns: importing the user's model factory, printing the plan and the memory table
(estimates, and simulations with `--simulate`), and resolving `strategy=auto`.

Must not: build a real model or start a process group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from shardwise.distributed.mesh import resolve_mesh
from shardwise.memory.model_states import format_bytes


def _load_factory(target: str) -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{target!r} is not MODULE:FACTORY, e.g. shardwise.testing.models:GPT or "
            "mypkg.model:build"
        )

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the current directory imports, as with python -m
    try:
        module = _import(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import {module_name!r}: {exc}{_path_hint(module_name, attr)}"
        ) from None
    except Exception as exc:  # the user's module failed while importing
        raise UserCodeError(_user_error(f"importing {module_name!r}", exc)) from exc
    factory = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"{target} is not callable")
    return _reported(factory, target)


def _import(name: str) -> Any:
    """A dotted module name, or the path of a .py file (its folder joins sys.path, so its
    own imports of its neighbours work, as `python path/to/file.py` does)."""
    import importlib
    import importlib.util

    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = os.path.abspath(name)
    if not os.path.isfile(path):
        raise ImportError(f"no file {name}")
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    stem = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(stem, path)
    assert spec is not None and spec.loader is not None  # a .py file always has both
    module = importlib.util.module_from_spec(spec)
    sys.modules[stem] = module
    spec.loader.exec_module(module)
    return module


def _path_hint(name: str, attr: str) -> str:
    """For a module name that reads as a path: the two forms that work."""
    if "/" not in name and "\\" not in name and not name.endswith(".py"):
        return ""
    stem = name.removesuffix(".py")
    dotted = stem.replace("\\", "/").strip("/").replace("/", ".")
    return (
        f". MODULE is a dotted module name ({dotted}:{attr}, importable from the current "
        f"directory) or the path of a .py file ({stem}.py:{attr})"
    )


class UserCodeError(RuntimeError):
    """The user's factory, input function or module raised; says which and where."""


def _user_error(what: str, exc: BaseException) -> str:
    import traceback

    # The innermost frame outside this file: the user's line (none when the call itself
    # failed, e.g. a factory that needs arguments).
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return (
        f"{what} raised {type(exc).__name__}: {str(exc).rstrip('.')}{where}. shardwise "
        "plan calls it with no arguments, under the meta device (nothing is allocated): "
        "give a function that builds with defaults, e.g. def build(): return MyModel(MyConfig())."
    )


def _reported(fn: Any, target: str) -> Any:
    """`fn` whose errors name `target` (it is called deep inside the planner and simulator)."""
    import functools

    @functools.wraps(fn)
    def call() -> Any:
        try:
            return fn()
        except Exception as exc:
            raise UserCodeError(_user_error(f"{target}()", exc)) from exc

    return call


def plan_command(args: argparse.Namespace) -> int:
    import warnings

    import torch

    from shardwise.cli.plan_muon import NOT_ESTIMATED, refuse_unplanned, shares_of
    from shardwise.config.run_file import Config, load_config
    from shardwise.memory.model_states import (
        dtype_bytes,
        estimate_memory,
        format_memory,
        memory_json,
    )
    from shardwise.plan.planner import PlanNotice, plan_wrap

    if args.world < 1:
        raise ValueError(
            f"--world={args.world}: the world size to plan for must be a positive integer "
            "(the total number of ranks, e.g. --world 8 for 8 GPUs)."
        )
    overrides = list(args.overrides)
    if getattr(args, "pp", None) is not None:
        if any(o.startswith("parallel.pp=") for o in overrides):
            raise ValueError("--pp and parallel.pp=... both given: keep one of them.")
        overrides.append(f"parallel.pp={args.pp}")
    for flag in ("tp", "ep", "cp"):
        value = getattr(args, flag, None)
        if value is not None:
            if any(o.startswith(f"parallel.{flag}=") for o in overrides):
                raise ValueError(f"--{flag} and parallel.{flag}=... both given: keep one of them.")
            overrides.append(f"parallel.{flag}={value}")
    config = load_config(args.config, overrides, cls=Config)
    parallel = config.parallel
    spec = None
    if parallel.strategy != "auto" and parallel.device_mesh is None:
        # The layout against the world size, before any model is built: one line.
        spec = resolve_mesh(
            parallel.strategy,
            parallel.dp_shard,
            args.world,
            tp=parallel.tp_size,
            pp=parallel.pp,
            ep=parallel.ep,
            cp=parallel.cp,
        )
    refuse_unplanned(args, config.optimizer, parallel, spec)
    factory = _load_factory(args.target)
    with torch.device("meta"):  # nothing is allocated: plans of huge models print anywhere
        model = factory()
    if spec is not None and spec.cp > 1:
        args.optimizer_name = config.optimizer.name
        return _plan_cp(args, model, parallel, spec)
    if spec is not None and spec.pp > 1:
        args.optimizer_name = config.optimizer.name
        return _plan_pp(args, factory, model, parallel, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanNotice)
        plan = plan_wrap(model, config.parallel)
    if spec is not None and spec.ep > 1:
        from shardwise.cli.plan_experts import plan_experts

        args.optimizer_name = config.optimizer.name
        example = _example_input(args)
        seq_len = args.seq_len
        if seq_len is None and example is None:
            from shardwise.memory.fake import default_seq_len

            seq_len = default_seq_len(model)
        return plan_experts(args, factory, model, parallel, spec, plan, seq_len, example)
    if spec is not None and spec.tp > 1:
        args.optimizer_name = config.optimizer.name
        return _plan_tp(args, model, parallel, spec, plan)
    precision = config.parallel.precision
    compute = (
        dtype_bytes(str(precision.param_dtype).removeprefix("torch."))
        if precision.is_mixed
        else None
    )
    estimates = estimate_memory(
        plan,
        args.world,
        optimizer=config.optimizer.name,
        compute_dtype_bytes=compute,
        muon=shares_of(config.optimizer, model),
    )
    parallel = config.parallel
    if args.memory_budget is not None:
        parallel = dataclasses.replace(parallel, memory_budget=args.memory_budget)
    example = _example_input(args)
    seq_len = args.seq_len
    if seq_len is None and example is None:
        from shardwise.memory.fake import default_seq_len

        seq_len = default_seq_len(model)
    if parallel.strategy == "auto" or parallel.activation_checkpointing == "auto":
        if seq_len is None and example is None:
            raise ValueError(_NO_INPUT.format(what="strategy=auto needs"))
        return _plan_auto(args, factory, parallel, config.optimizer.name, seq_len, example)
    from shardwise.memory.auto import ALLOCATED_NOTE, format_rows, resolve_budget

    limit, source = resolve_budget(parallel.memory_budget)
    from shardwise.memory.compose import reuse_builds

    muon = config.optimizer.name == "muon"
    rows = []
    if not muon:
        with reuse_builds({factory: model}):  # the model above, for every simulation
            rows = _plan_rows(
                args, factory, model, parallel, estimates, config.optimizer.name, seq_len,
                limit, example,
            )  # fmt: skip
    if not rows and args.simulate:
        raise ValueError(_NO_INPUT.format(what="--simulate needs"))
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
    if not rows:
        print()
        print(NOT_ESTIMATED if muon else _NO_INPUT.format(what="the peak with activations needs"))
    if rows:
        print()
        shape = (
            f"the batch of {args.input}"
            if example is not None
            else f"micro-batch {args.batch or 1} x seq {seq_len}"
        )
        print(
            f"per-rank peak with activations, {shape}, AC {parallel.activation_checkpointing}; "
            f"budget {format_bytes(limit)} ({source})"
        )
        print(format_rows([r for r, _ in rows]))
        print(f"  ({ALLOCATED_NOTE})")
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
    example: Any = None,
) -> list[tuple[Any, Any]]:
    """A row per strategy: the instant peak with activations, the simulated one with
    --simulate, and whether it fits the budget. Empty when the sequence length is unknown."""
    from shardwise.memory.auto import Candidate, InstantPeak
    from shardwise.memory.simulate import simulate_steps
    from shardwise.memory.workers import in_background

    if seq_len is None and example is None:
        return []
    batch = args.batch or 1
    instant = InstantPeak(model, args.world, batch, seq_len, optimizer, example_input=example)
    configs = [dataclasses.replace(parallel, strategy=e.strategy) for e in estimates]
    sims: list[Any] = [None] * len(configs)
    instants = lambda: [instant(cfg) for cfg in configs]  # noqa: E731
    if args.simulate:  # every strategy's traces side by side, and the estimates beside them
        instants = in_background(instants, "the instant estimates", 600.0)
        sims = simulate_steps(
            factory,
            configs,
            world=args.world,
            batch=batch,
            seq_len=seq_len,
            example_input=example,
            optimizer=optimizer,
            path=args.simulate,
        )
    rows = []
    for e, sim, estimate in zip(estimates, sims, instants(), strict=True):
        peak = sim.peak if sim is not None else estimate
        row = Candidate(
            e.strategy,
            str(parallel.activation_checkpointing),
            estimate,
            simulated=sim.peak if sim is not None else None,
            fits=peak <= limit,
            simulation=sim.path if sim is not None else None,
        )
        rows.append((row, sim))
    return rows


def _plan_auto(
    args: argparse.Namespace,
    factory: Any,
    parallel: Any,
    optimizer: str,
    seq_len: int | None,
    example: Any = None,
) -> int:
    from shardwise.memory.auto import NoPlanFitsError, choose_plan

    try:
        auto = choose_plan(
            factory,
            parallel,
            world=args.world,
            batch=args.batch or 1,
            seq_len=seq_len,
            example_input=example,
            optimizer=optimizer,
            simulate=args.simulate or False,
        )
    except NoPlanFitsError as exc:
        if args.json:
            print(json.dumps(exc.plan.to_dict(), indent=2))
        print(f"shardwise plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(auto.to_dict(), indent=2) if args.json else auto)
    return 0


_NO_INPUT = (
    "{what} the batch the model trains on, and this model's sequence length is unknown: "
    "pass --seq-len N (with --batch B) for a model of token ids, or --input MODULE:FUNCTION "
    "returning one rank's example batch for any model."
)


def _plan_cp(args: argparse.Namespace, model: Any, parallel: Any, spec: Any) -> int:
    """The layout under context parallel, and with --simulate each rank's simulated peak
    (its 1/cp of every sequence's activations, the all-to-alls' buffers). The instant
    estimate does not model the sequence split, so it is not shown."""
    sim = None
    if args.simulate:
        from shardwise.memory.simulate import simulate_step

        example = _example_input(args)
        seq_len = args.seq_len
        if seq_len is None and example is None:
            from shardwise.memory.fake import default_seq_len

            seq_len = default_seq_len(model)
            if seq_len is None:
                raise ValueError(_NO_INPUT.format(what="--simulate needs"))
        sim = simulate_step(
            _load_factory(args.target), parallel, world=args.world, batch=args.batch or 1,
            seq_len=seq_len, example_input=example, optimizer=args.optimizer_name,
            path=args.simulate,
        )  # fmt: skip
    note = (
        f"peak with activations: the instant estimate does not model cp={spec.cp}; add "
        "--simulate (--seq-len N --batch B) for each rank's simulated peak"
    )
    if args.json:
        out: dict[str, Any] = {"mesh": json.loads(spec.to_json())}
        out["simulated"] = sim.to_dict() if sim is not None else None
        print(json.dumps(out, indent=2))
        return 0
    print(spec)
    print(sim if sim is not None else note)
    return 0


def _plan_tp(args: argparse.Namespace, model: Any, parallel: Any, spec: Any, plan: Any) -> int:
    """The 2-D layout: the mesh, each tp plan entry with its style and the modules it
    names, then the data-parallel units; with --simulate, the simulated per-rank peak.
    The instant estimate does not model tensor parallelism, so it is not shown (a figure
    that ignored tp would be wrong)."""
    from shardwise.memory.model_states import format_memory, memory_json
    from shardwise.parallelize.tensor import check_tensor_parallel, plan_matches

    tp = check_tensor_parallel(model, parallel)  # the same checks wrap runs, on meta
    sim = None
    if args.simulate:
        from shardwise.memory.simulate import simulate_step

        example = _example_input(args)
        seq_len = args.seq_len
        if seq_len is None and example is None:
            from shardwise.memory.fake import default_seq_len

            seq_len = default_seq_len(model)
            if seq_len is None:
                raise ValueError(_NO_INPUT.format(what="--simulate needs"))
        sim = simulate_step(
            _load_factory(args.target), parallel, world=args.world, batch=args.batch or 1,
            seq_len=seq_len, example_input=example, optimizer=args.optimizer_name,
            path=args.simulate,
        )  # fmt: skip
    estimates = _tp_estimates(model, parallel, spec, plan, tp, args.world, args.optimizer_name)
    if args.json:
        out: dict[str, Any] = {"mesh": str(spec), "tp_plan": tp.described, "plan": plan.to_dict()}
        out["memory"] = json.loads(memory_json(estimates))
        if sim is not None:
            out["simulated"] = sim.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    names = [n for n, _ in model.named_modules() if n]
    print(spec)
    print(f"tensor parallel over {spec.tp} adjacent ranks ({len(tp.described)} plan entries):")
    for pattern, style in tp.described.items():
        hits = sum(plan_matches(pattern, n) for n in names)
        print(f"  {pattern:<48} {style:<24} {hits} module(s)")
    print()
    print(plan)
    print()
    if estimates:
        print(f"world size {args.world}, tp {spec.tp}, optimizer {args.optimizer_name}")
        print(format_memory(estimates))
        print()
    if sim is None:
        print(
            "peak with activations: the instant estimate does not model them under tensor "
            "parallelism; add --simulate (--seq-len N --batch B) for the simulated peak."
        )
    else:
        print(sim)
    return 0


def _plan_pp(args: argparse.Namespace, factory: Any, model: Any, parallel: Any, spec: Any) -> int:
    """The stages: each one's blocks, other modules and parameters, and the model states
    per rank of each stage, sharded over its data-parallel ranks (the instant estimate; the
    simulation of each stage's step, with its micro-batches in flight, with --simulate)."""
    import warnings

    import torch

    from shardwise.memory.model_states import dtype_bytes, estimate_memory, format_memory
    from shardwise.parallelize.pipeline import build_stage
    from shardwise.parallelize.tensor import check_tensor_parallel
    from shardwise.plan.planner import PlanNotice, plan_wrap
    from shardwise.plan.stages import plan_stages

    stages = plan_stages(model, spec.pp, parallel.pp_split, parallel.stages_per_rank)
    precision = parallel.precision
    compute = (
        dtype_bytes(str(precision.param_dtype).removeprefix("torch."))
        if precision.is_mixed
        else None
    )
    per_stage = []
    for index in range(spec.pp):
        with torch.device("meta"):
            stage_model = factory()
        build_stage(stage_model, stages, index)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanNotice)
            stage_plan = plan_wrap(stage_model, parallel)
        if spec.tp > 1:  # this stage's layers split over tp, then sharded over dp
            tp = check_tensor_parallel(stage_model, parallel)
            estimates = _tp_estimates(
                stage_model, parallel, spec, stage_plan, tp, spec.dp_size * spec.tp,
                args.optimizer_name,
            )  # fmt: skip
        else:
            estimates = estimate_memory(
                stage_plan, spec.dp_size, optimizer=args.optimizer_name,
                compute_dtype_bytes=compute,
            )  # fmt: skip
        per_stage.append([e for e in estimates if e.strategy != "ddp"])  # refused under pp
    if args.json:
        out = {
            "mesh": str(spec),
            "stages": json.loads(stages.to_json()),
            "memory": [[dataclasses.asdict(e) for e in est] for est in per_stage],
        }
        print(json.dumps(out, indent=2))
        return 0
    print(spec)
    print(stages)
    for index, estimates in enumerate(per_stage):
        print()
        held = stages.held_by(index)
        which = f"stage {index}" if len(held) == 1 else f"pipeline rank {index} (stages {held})"
        print(
            f"{which}, over its {spec.dp_size} data-parallel rank(s)"
            f"{f' x tp {spec.tp}' if spec.tp > 1 else ''}, optimizer "
            f"{args.optimizer_name}, precision {precision}:"
        )
        print(format_memory(estimates))
    print()
    if not args.simulate:
        print(
            "activations: not in these figures (--simulate adds them); under 1F1B the first "
            f"stage holds up to {spec.pp} micro-batches' activations in flight, the last one."
        )
        return 0
    from shardwise.config.pipeline import default_microbatches
    from shardwise.memory.fake import default_seq_len
    from shardwise.memory.simulate import simulate_step

    seq_len = args.seq_len or default_seq_len(model)
    if seq_len is None:
        raise ValueError(_NO_INPUT.format(what="--simulate needs"))
    batch = args.batch or parallel.pp_microbatches or default_microbatches(spec.pp)
    report = simulate_step(
        factory, parallel, world=args.world, batch=batch, seq_len=seq_len,
        optimizer=args.optimizer_name, path=args.simulate,
    )  # fmt: skip
    print(report)
    return 0


def _tp_estimates(
    model: Any, parallel: Any, spec: Any, plan: Any, tp: Any, world: int, optimizer: str
) -> list[Any]:
    """Model states per rank under tp, for each FSDP strategy the world takes (none for a
    callable plan, whose splits shardwise cannot read)."""
    from shardwise.memory.model_states import dtype_bytes, estimate_memory, tp_shares
    from shardwise.parallelize.tensor import split_parameters

    split = split_parameters(model, tp)
    if split is None:
        return []
    precision = parallel.precision
    compute = (
        dtype_bytes(str(precision.param_dtype).removeprefix("torch."))
        if precision.is_mixed
        else None
    )
    return estimate_memory(
        plan, world, optimizer=optimizer, compute_dtype_bytes=compute, tp=spec.tp,
        tp_share=tp_shares(model, plan, split, spec.tp),
    )  # fmt: skip


def _example_input(args: argparse.Namespace) -> Any:
    """The --input function, refusing the flags it replaces (they would be ignored)."""
    if args.input is None:
        return None
    given = [flag for flag, v in (("--batch", args.batch), ("--seq-len", args.seq_len)) if v]
    if given:
        verb = "describes" if len(given) == 1 else "describe"
        raise ValueError(
            f"{' and '.join(given)} {verb} the default token input, but --input "
            f"{args.input} gives the batch itself (its size is what the function returns). "
            f"Drop {' and '.join(given)}, or --input."
        )
    return _load_factory(args.input)
