"""`shardwise plan` under expert parallelism (`parallel.ep` > 1): where each experts
module's experts go, the model states per rank, and with `--simulate` the simulated step
under a stated routing.

Owns: the ep branch of `shardwise plan` (plan.py hands over to `plan_experts`).

Must not: build a real model or start a process group (the model here was built on meta).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from shardwise.memory.model_states import format_bytes
from shardwise.parallelize.experts import EXPERT_LOAD_CHOICES, ExpertLoad, check_expert_load

__all__ = ["plan_experts"]


def plan_experts(
    args: argparse.Namespace,
    factory: Any,
    model: Any,
    parallel: Any,
    spec: Any,
    plan: Any,
    seq_len: int | None,
    example: Any,
) -> int:
    """The experts' layout, the model states per rank (tp 1) and, with --simulate, the
    simulated peak of the busiest rank under `--expert-load`."""
    from shardwise.memory.model_states import dtype_bytes, estimate_memory
    from shardwise.memory.simulate import DEFAULT_EXPERT_LOAD, simulate_step
    from shardwise.parallelize.experts import check_expert_parallel

    found = check_expert_parallel(model, spec.ep)  # the same checks wrap runs, on meta
    load = _expert_load(getattr(args, "expert_load", None), DEFAULT_EXPERT_LOAD)
    states = None
    if spec.tp == 1:  # under tp the experts are whole on every tp rank: no estimate reads that
        precision = parallel.precision
        compute = (
            dtype_bytes(str(precision.param_dtype).removeprefix("torch."))
            if precision.is_mixed
            else None
        )
        estimates = estimate_memory(
            plan, args.world, optimizer=args.optimizer_name, compute_dtype_bytes=compute
        )
        states = next(e for e in estimates if e.strategy == spec.strategy)
    sim = None
    if args.simulate:
        if seq_len is None and example is None:
            raise ValueError(
                "--simulate needs the input: give --seq-len N (and --batch B), or --input "
                "MODULE:FUNCTION returning one rank's batch."
            )
        sim = simulate_step(
            factory, parallel, world=args.world, batch=args.batch or 1, seq_len=seq_len,
            example_input=example, optimizer=args.optimizer_name, expert_load=load,
            path=args.simulate,
        )  # fmt: skip
    layers = [
        {"module": name, "num_experts": m.num_experts, "per_rank": m.num_experts // spec.ep}
        for name, m in found.items()
    ]
    if args.json:
        out: dict[str, Any] = {"mesh": str(spec), "experts": layers, "plan": plan.to_dict()}
        if states is not None:
            out["model_states"] = dataclasses.asdict(states)
        if sim is not None:
            out["simulated"] = sim.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    print(spec)
    first = layers[0]
    print(
        f"expert parallel over {spec.ep} ranks: {len(layers)} experts module(s) "
        f"({first['module']}, ...), each rank holding {first['per_rank']} of "
        f"{first['num_experts']} whole experts, sharded over {spec.ep_shard} "
        "rank(s); the router stays whole"
    )
    print()
    print(plan)
    print()
    if states is not None:
        print(
            f"model states per rank ({spec.strategy}, world {args.world}, optimizer "
            f"{args.optimizer_name}): params {format_bytes(states.params)}, grads "
            f"{format_bytes(states.grads)}, optimizer {format_bytes(states.optimizer)}, "
            f"in all {format_bytes(states.model_states)} (as without ep: each expert is "
            f"split over the {spec.dp_shard} shard ranks either way)"
        )
    if sim is None:
        print(
            "peak with activations: the experts gathered, the tokens exchanged and the "
            "imbalance of the routing need --simulate (--seq-len N --batch B; "
            f"--expert-load, default {DEFAULT_EXPERT_LOAD}, states the routing)."
        )
    else:
        print(sim)
    return 0


def _expert_load(given: str | None, default: float) -> ExpertLoad:
    """--expert-load as simulate_step takes it: a number >= 1, or 'worst'."""
    if given is None:
        return default
    try:
        return check_expert_load(given if given == "worst" else float(given))
    except ValueError:
        raise ValueError(f"--expert-load {given}: {EXPERT_LOAD_CHOICES}") from None
