"""`strategy="auto"`: the cheapest plan whose per-rank peak fits the memory budget.

Owns: `choose_plan`, which walks strategy x activation-checkpointing candidates from the
cheapest up, gives each the instant estimate (model states + traced activations,
`shardwise.memory.estimate_peak`) and simulates it (`shardwise.memory.simulate_step`)
until one fits; `device_memory` and `resolve_budget`; the `AutoPlan` table with the reason
for the choice; and `NoPlanFitsError`, which names the smallest peak found and what would
make it fit.

Cost order. Recompute dominates: activation checkpointing re-runs a forward (about a
third of a step's compute) that nothing overlaps, while the extra communication of the
sharded strategies mostly overlaps with compute. So every strategy without checkpointing
comes before any with it (then every second block, then every block), and within one
checkpointing level the strategies go by communication per step: ddp (one all-reduce) <
shard_grad_op (gather once, reduce-scatter) < hybrid_shard (full sharding inside a group
of ranks, an all-reduce across groups) < full_shard (gather twice across all ranks).
With `tp="auto"`, tensor parallelism (2, 4 or 8 ranks of a node, with sequence
parallelism) comes after every layout without it at the same checkpointing level: its
collectives sit on each layer's critical path, where FSDP's mostly overlap. The instant
estimate has no activations under tp, so tp rows are simulated, unless their model states
alone exceed the budget.

Must not: wrap anything or touch the caller's process group (simulations run on fake
tensors, in a subprocess when a process group exists).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

from shardwise.config.budget import parse_memory_budget
from shardwise.config.names import StrategyName
from shardwise.config.parallel import ParallelConfig
from shardwise.distributed.mesh import resolve_mesh
from shardwise.memory.activations import trace_activations
from shardwise.memory.compose import reuse_builds
from shardwise.memory.fake import ExampleInput
from shardwise.memory.model_states import estimate_memory, estimate_peak, format_bytes
from shardwise.memory.simulate import SimPath, simulate_step
from shardwise.plan.planner import PlanNotice, plan_wrap

__all__ = ["AutoPlan", "Candidate", "NoPlanFitsError", "choose_plan", "resolve_budget"]

COMM_ORDER: tuple[StrategyName, ...] = ("ddp", "shard_grad_op", "hybrid_shard", "full_shard")
AC_ORDER = ("none", "every_2", "full")
DEFAULT_FRACTION = 0.9
"""Of what is left after GPU_RESERVE: the rest is the caching allocator's slack (its
reserved memory exceeds the allocated peak the estimate and the simulation measure,
typically by 5-15%)."""
GPU_RESERVE = 2 * 2**30
"""Taken off a GPU's memory before the fraction: the CUDA context (about 0.5 GiB),
cuBLAS workspaces and NCCL's buffers, none of which the allocated peak counts."""
ALLOCATED_NOTE = (
    "estimate and simulated are allocated bytes (torch.cuda.max_memory_allocated); the "
    "allocator's reserved memory is typically 5-15% more, which the default budget leaves"
)
ESTIMATE_TOLERANCE = 0.10
"""How far the instant estimate may be from the simulation on the bench models (measured
within it: BENCHMARKS.md); a row whose gap is wider says so, and which figure to trust."""
_SKIP_ABOVE = 1.25
"""A candidate whose instant estimate exceeds the budget by this factor is not simulated
(the estimate is within ESTIMATE_TOLERANCE of the simulation)."""


@dataclass(frozen=True)
class Candidate:
    """One row of the table: a strategy with an activation-checkpointing level (and a
    tensor-parallel degree, with sequence parallelism when tp > 1). The instant estimate
    does not model tp: those rows have `estimate=None` and only a simulated peak."""

    strategy: StrategyName
    activation_checkpointing: str
    estimate: int | None
    simulated: int | None = None
    fits: bool | None = None
    note: str = ""
    tp: int = 1
    sequence_parallel: bool = False
    simulation: str | None = None
    """Which simulation made `simulated`: "fast" (each distinct block traced, the step
    composed) or "full" (every block traced); None where not simulated."""

    @property
    def peak(self) -> int | None:
        """The simulated peak where there is one, else the instant estimate."""
        return self.simulated if self.simulated is not None else self.estimate

    @property
    def layout(self) -> str:
        return self.strategy + (f" x tp {self.tp}" if self.tp > 1 else "")


@dataclass(frozen=True)
class AutoPlan:
    """The candidates, in cost order, and the one chosen (None: nothing fits)."""

    world_size: int
    budget: int
    budget_source: str
    batch: int
    seq_len: int | None
    rows: list[Candidate]
    chosen: Candidate | None
    base: ParallelConfig = field(repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """Why the chosen row, or (nothing fits) the smallest peak and what would fit."""
        return _reason(self)

    @property
    def config(self) -> ParallelConfig:
        """The input config with the chosen strategy and checkpointing filled in."""
        if self.chosen is None:
            raise NoPlanFitsError(self)
        return dataclasses.replace(
            self.base,
            strategy=self.chosen.strategy,
            activation_checkpointing=self.chosen.activation_checkpointing,
            tp=self.chosen.tp,
            sequence_parallel=self.chosen.sequence_parallel or self.base.sequence_parallel,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "budget": self.budget,
            "budget_source": self.budget_source,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "chosen": dataclasses.asdict(self.chosen) if self.chosen else None,
            "reason": self.reason,
            "notes": self.notes,
        }

    def __str__(self) -> str:
        shape = (
            f"micro-batch {self.batch} x seq {self.seq_len}"
            if self.seq_len is not None
            else "the example batch"
        )
        head = (
            f"strategy='auto' at world {self.world_size}, {shape}: budget "
            f"{format_bytes(self.budget)} per rank ({self.budget_source})"
        )
        lines = [head, format_rows(self.rows, chosen=self.chosen), *self.notes, self.reason]
        return "\n".join(lines)


def format_rows(rows: list[Candidate], *, chosen: Candidate | None = None) -> str:
    """The plan table: estimate, simulation (where run) and the fit of each row."""
    layouts = [r.layout + (" +sp" if r.sequence_parallel else "") for r in rows]
    w = max([18, *(len(x) for x in layouts)])
    s = 17 if any(r.simulation for r in rows) else 12  # "27.58 GiB fast"
    header = f"  {'strategy':<{w}} {'AC':<8} {'estimate':>12} {'simulated':>{s}}  fits"
    out = [header]
    for r, layout in zip(rows, layouts, strict=True):
        sim = format_bytes(r.simulated) if r.simulated is not None else "-"
        fits = {True: "yes", False: "no", None: "-"}[r.fits]
        mark = "  <- chosen" if r is chosen else ""
        notes = [r.note] if r.note else []
        if r.estimate is not None and r.simulated:
            gap = r.estimate / r.simulated - 1
            if abs(r.estimate - r.simulated) > ESTIMATE_TOLERANCE * r.simulated:
                notes.append(f"estimate {gap:+.0%} off the simulation: trust the simulated")
        note = f"  ({'; '.join(notes)})" if notes else ""
        estimate = format_bytes(r.estimate) if r.estimate is not None else "-"
        if r.simulation is not None:
            sim += " " + r.simulation
        out.append(
            f"  {layout:<{w}} {r.activation_checkpointing:<8} "
            f"{estimate:>12} {sim:>{s}}  {fits}{mark}{note}"
        )
    return "\n".join(out)


class NoPlanFitsError(ValueError):
    """No strategy x activation-checkpointing candidate fits the budget."""

    def __init__(self, plan: AutoPlan) -> None:
        self.plan = plan
        super().__init__(plan.reason + "\n" + format_rows(plan.rows))


def device_memory(device: torch.device | str | None = None) -> tuple[int, str]:
    """Memory one rank can plan with, and where the figure came from. A GPU's memory less
    GPU_RESERVE; with no GPU visible, the host's RAM shared by the ranks of this node
    (LOCAL_WORLD_SIZE), which judges a CPU run only."""
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        index = device.index if device is not None and device.index is not None else 0
        props = torch.cuda.get_device_properties(index)
        total = int(props.total_memory)
        return total - GPU_RESERVE, (
            f"{props.name}: {format_bytes(total)} less {format_bytes(GPU_RESERVE)} for the "
            "CUDA context, cuBLAS workspaces and NCCL buffers"
        )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    share = f" / {local} local ranks" if local > 1 else ""
    return ram // local, (
        f"host RAM{share}: no GPU is visible, so this judges a CPU run; for a GPU job pass "
        "its memory, e.g. --memory-budget 80GB"
    )


def resolve_budget(value: object, device: torch.device | str | None = None) -> tuple[int, str]:
    """Bytes per rank for `ParallelConfig.memory_budget`, and a description of it."""
    parsed = parse_memory_budget(value)
    if isinstance(parsed, int):
        return parsed, "memory_budget"
    fraction = DEFAULT_FRACTION if parsed is None else parsed
    total, source = device_memory(device)
    what = "default " if parsed is None else ""
    return int(total * fraction), f"{what}{fraction:.0%} of {format_bytes(total)}, {source}"


TP_CHOICES = (2, 4, 8)
"""tp degrees `tp='auto'` may choose: within one node of up to 8 GPUs."""


def _strategies(config: ParallelConfig, world: int, tp: int) -> list[StrategyName]:
    if config.strategy != "auto":
        return [config.strategy]
    out: list[StrategyName] = []
    for s in COMM_ORDER:
        if tp > 1 and s == "ddp":
            s = "no_shard"  # DDP cannot hold DTensors; no_shard replicates as it does
        try:
            resolve_mesh(s, config.dp_shard if s.startswith("hybrid") else -1, world, tp=tp)
        except ValueError:
            continue  # hybrid needs a 2-D mesh
        out.append(s)
    return out


def _tp_degrees(config: ParallelConfig, world: int, meta_model: nn.Module) -> dict[int, str]:
    """tp degree -> '' (usable) or why not. Fixed tp: itself. tp='auto': 1, then the
    TP_CHOICES that divide the world and pass the plan's checks (heads, sizes)."""
    if config.tp != "auto":
        return {config.tp_size: ""}
    from shardwise.parallelize.tensor import check_tensor_parallel

    out = {1: ""}
    for tp in TP_CHOICES:
        if world % tp:
            continue
        try:
            cfg = dataclasses.replace(config, strategy="full_shard", tp=tp, sequence_parallel=True)
            check_tensor_parallel(meta_model, cfg)
            out[tp] = ""
        except (ValueError, NotImplementedError) as exc:
            out[tp] = str(exc).split(". ")[0]
    return out


def _candidates(
    config: ParallelConfig, world: int, meta_model: nn.Module
) -> tuple[list[Candidate], list[str]]:
    """Rows to fill (no figures yet) in cost order, and a note per tp degree left out.
    Within one checkpointing level, every layout without tp comes before any with it: tp's
    collectives sit on the critical path of each layer (FSDP's mostly overlap), within one
    node; then by degree."""
    degrees = _tp_degrees(config, world, meta_model)
    levels = AC_ORDER if config.activation_checkpointing == "auto" else (None,)
    sp = {tp: tp > 1 and (config.tp == "auto" or config.sequence_parallel) for tp in degrees}
    layouts = [
        Candidate(
            s, ac or str(config.activation_checkpointing), None, tp=tp, sequence_parallel=sp[tp]
        )
        for ac in levels
        for tp, why in degrees.items()
        if not why
        for s in _strategies(config, world, tp)
    ]
    skipped = [f"tp {tp} not considered: {why}" for tp, why in degrees.items() if why]
    return layouts, skipped


class InstantPeak:
    """The instant per-rank peak of a config: `estimate_memory`'s model states plus a
    traced forward's activations (`estimate_peak`). Traces are shared between configs that
    compute alike (FSDP's cast parameters, or DDP's autocast)."""

    def __init__(
        self,
        meta_model: nn.Module,
        world: int,
        batch: int,
        seq_len: int | None,
        optimizer: str = "adamw",
        example_input: ExampleInput | None = None,
    ) -> None:
        self.model, self.world, self.batch, self.seq_len = meta_model, world, batch, seq_len
        self.optimizer, self.example_input = optimizer, example_input
        self._traces: dict[tuple[bool, str], Any] = {}

    def __call__(self, cfg: ParallelConfig) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanNotice)
            plan = plan_wrap(self.model, cfg)
        precision = cfg.precision
        compute = precision.param_dtype if precision.is_mixed else None
        width = compute.itemsize if compute else None
        states = estimate_memory(
            plan,
            self.world,
            optimizer=self.optimizer,
            compute_dtype_bytes=width,
            strategies=(cfg.strategy,),
        )[0]
        key = (cfg.strategy == "ddp", str(compute))
        if key not in self._traces:
            self._traces[key] = trace_activations(
                self.model,
                batch=self.batch,
                seq_len=self.seq_len,
                blocks=[u.modules[0] for u in plan.units if u.reason == "policy"],
                compute_dtype=compute,
                keep_fp32=[
                    m for u in plan.units if u.compute_dtype == "float32" for m in u.modules
                ],
                autocast=cfg.strategy == "ddp",
                example_input=self.example_input,
            )
        return estimate_peak(states, self._traces[key], cfg.checkpoint_every).peak


P = ParamSpec("P")
R = TypeVar("R")


def _one_build(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` with the fast simulation building its model once for every candidate."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        with reuse_builds():
            return fn(*args, **kwargs)

    return call


@_one_build
def choose_plan(
    model_factory: Callable[[], nn.Module],
    config: ParallelConfig,
    *,
    world: int,
    batch: int,
    seq_len: int | None,
    example_input: ExampleInput | None = None,
    optimizer: str = "adamw",
    budget: object = None,
    device: torch.device | str | None = None,
    simulate: bool | SimPath = True,
) -> AutoPlan:
    """The cheapest strategy x activation checkpointing (see the module docstring) whose
    per-rank peak fits `budget` (default `config.memory_budget`, else 90% of `device`'s
    memory). Candidates are fixed where `config` fixes them: only `strategy="auto"` varies
    the strategy and only `activation_checkpointing="auto"` the checkpointing.

    Each candidate gets the instant estimate; in cost order, candidates are simulated
    (`simulate_step`, fake tensors) until one fits, and the rest are left unsimulated.
    `simulate=True` (or "fast") uses the fast simulation, "full" traces every block;
    each row's `simulation` says which made it. With `simulate=False` the estimate decides.
    Raises `NoPlanFitsError` when nothing
    fits; returns the `AutoPlan` otherwise (`.config` is the resolved config).
    """
    limit, source = resolve_budget(config.memory_budget if budget is None else budget, device)
    with torch.device("meta"):
        meta_model = model_factory()
    rows: list[Candidate] = []
    chosen: Candidate | None = None
    estimator = InstantPeak(meta_model, world, batch, seq_len, optimizer, example_input)
    layouts, skipped = _candidates(config, world, meta_model)
    for row in layouts:
        cfg = dataclasses.replace(
            config,
            strategy=row.strategy,
            activation_checkpointing=row.activation_checkpointing,
            tp=row.tp,
            sequence_parallel=row.sequence_parallel,
        )
        estimate = estimator(cfg) if row.tp == 1 else None  # no activations under tp
        row = dataclasses.replace(row, estimate=estimate)
        if chosen is None:
            if simulate and estimate is not None and estimate > _SKIP_ABOVE * limit:
                row = dataclasses.replace(
                    row, fits=False, note=f"estimate over {_SKIP_ABOVE:.2f}x budget: not simulated"
                )
            elif simulate and row.tp > 1 and _tp_states(meta_model, cfg, world, optimizer) > limit:
                row = dataclasses.replace(
                    row, fits=False, note="model states alone over budget: not simulated"
                )
            elif simulate:
                sim = simulate_step(
                    model_factory,
                    cfg,
                    world=world,
                    batch=batch,
                    seq_len=seq_len,
                    example_input=example_input,
                    optimizer=optimizer,
                    path="full" if simulate == "full" else "fast",
                )
                row = dataclasses.replace(
                    row, simulated=sim.peak, fits=sim.peak <= limit, simulation=sim.path
                )
            elif estimate is None:
                row = dataclasses.replace(row, note="tp is only simulated: not checked")
            else:
                row = dataclasses.replace(row, fits=estimate <= limit)
            if row.fits:
                chosen = row
        else:
            row = dataclasses.replace(row, note="not checked: a cheaper plan fits")
        rows.append(row)
    plan_ = AutoPlan(
        world_size=world,
        budget=limit,
        budget_source=source,
        batch=batch,
        seq_len=seq_len,
        rows=rows,
        chosen=chosen,
        base=config,
        notes=skipped,
    )
    if chosen is None:
        raise NoPlanFitsError(plan_)
    return plan_


def _tp_states(meta_model: nn.Module, cfg: ParallelConfig, world: int, optimizer: str) -> int:
    """Model states plus the gathered layer per rank under tp (a lower bound of the peak:
    no activations), or 0 where the plan's splits cannot be read (a callable plan)."""
    from shardwise.memory.model_states import tp_shares
    from shardwise.parallelize.tensor import check_tensor_parallel, split_parameters

    split = split_parameters(meta_model, check_tensor_parallel(meta_model, cfg))
    if split is None:
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanNotice)
        plan = plan_wrap(meta_model, cfg)
    compute = cfg.precision.param_dtype if cfg.precision.is_mixed else None
    (states,) = estimate_memory(
        plan,
        world,
        optimizer=optimizer,
        compute_dtype_bytes=compute.itemsize if compute else None,
        strategies=(cfg.strategy,),
        tp=cfg.tp_size,
        tp_share=tp_shares(meta_model, plan, split, cfg.tp_size),
    )
    return states.peak


def _reason(plan: AutoPlan) -> str:
    rows, chosen, limit = plan.rows, plan.chosen, plan.budget
    if chosen is not None:
        cheaper = rows.index(chosen)
        why = (
            f"; the {cheaper} cheaper candidate(s) above it do not fit"
            if cheaper
            else "; it is the cheapest candidate"
        )
        tp = (
            f", tp={chosen.tp}, sequence_parallel={chosen.sequence_parallel}"
            if chosen.tp > 1
            else ""
        )
        return (
            f"chosen: strategy={chosen.strategy!r}{tp}, activation_checkpointing="
            f"{chosen.activation_checkpointing!r}, per-rank peak "
            f"{format_bytes(chosen.peak or 0)} <= budget {format_bytes(limit)}{why}."
        )
    measured = [r for r in rows if r.peak is not None]
    if not measured:
        return (
            "No plan fits: no candidate has a peak (tp layouts are only simulated; run with "
            "the simulation)."
        )
    best = min(measured, key=lambda r: r.peak or 0)
    peak = best.peak or 0
    over = peak / limit
    more_ranks = plan.world_size * max(2, int(over + 0.999))
    return (
        f"No plan fits: the smallest per-rank peak is {format_bytes(peak)} "
        f"({'simulated' if best.simulated is not None else 'estimated'}, "
        f"strategy={best.strategy!r}{f', tp={best.tp}' if best.tp > 1 else ''}, "
        f"activation_checkpointing={best.activation_checkpointing!r}), {over:.2f}x the budget of "
        f"{format_bytes(limit)} ({plan.budget_source}). To fit: shard over more ranks "
        f"(e.g. --world {more_ranks}; model states shrink with the shard group), offload "
        "to CPU (cpu_offload=True), "
        + ("let the planner split layers (tp='auto'), " if plan.base.tp == 1 else "")
        + "use a smaller micro-batch than "
        f"{plan.batch} (activations shrink with it; keep the global batch with "
        "gradient accumulation), checkpoint activations (activation_checkpointing='full' "
        "or 'auto'), compute in bf16 (mixed_precision='bf16'), or raise memory_budget."
    )
