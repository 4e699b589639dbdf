"""Pipeline stages in the simulation: each stage's step, in its schedule's order.

Owns: what the simulation needs to step one pipeline stage alone on fake tensors: the
stage built from the whole model (`stage_factory`), its input (the batch's tensors, and for
a later stage the hidden states it would receive), and the order of its micro-batches'
forwards and backwards under 1F1B or GPipe (`stage_order`). The step (`tracked_stage_step`)
runs that order under the memory tracker as torch's PipelineStage drives FSDP2: gradients
are kept unsharded and parameters gathered across the micro-batches, and synchronised at
the last backward. So the peak counts the micro-batches in flight: up to pp - i on stage
i under 1F1B, every micro-batch under GPipe.

Must not: send or receive (each stage is simulated in a fake world of its own data- and
tensor-parallel ranks; what it would receive is made here), or decide the split.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from shardwise.config.pipeline import check_microbatches, default_microbatches
from shardwise.memory.tracking import (
    _CATEGORIES,
    _create_optimizer_state,
    _follow_category_peaks,
    _peaks,
    _tracker,
)
from shardwise.memory.workers import Job, gather
from shardwise.parallelize.materialize import init_empty
from shardwise.parallelize.pipeline import build_stage
from shardwise.plan.stages import StagePlan, plan_stages

__all__ = [
    "StageSim",
    "hidden_width",
    "real_stage_step",
    "simulate_stages",
    "stage_factory",
    "stage_input",
    "stage_order",
    "tracked_stage",
    "tracked_stage_step",
]


@dataclass(frozen=True)
class StageSim:
    """One stage to simulate: its index in `plan`, the schedule and the micro-batches."""

    plan: StagePlan
    index: int
    schedule: str
    microbatches: int
    hidden: int
    """The width of the hidden states a later stage receives."""

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations this stage holds at once."""
        if self.schedule == "gpipe":
            return self.microbatches
        return min(self.plan.pp - self.index, self.microbatches)


def stage_order(schedule: str, pp: int, index: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage `index`'s forwards ("F", micro-batch) and backwards ("B", micro-batch) in
    order: GPipe runs every forward, then every backward; 1F1B runs pp - index - 1 warm-up
    forwards, then one forward and one backward at a time, then the remaining backwards."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(pp - index - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    return order


def hidden_width(model: nn.Module, plan: StagePlan) -> int:
    """The width of the residual stream: the first-stage embedding's output."""
    for name in plan.before:
        module = model.get_submodule(name)
        if isinstance(module, nn.Embedding):
            return int(module.embedding_dim)
    raise ValueError(
        "simulate_step with ParallelConfig.pp: the first stage holds no nn.Embedding, so the "
        "width of the hidden states the later stages receive is unknown."
    )


def stage_factory(
    model_factory: Callable[[], nn.Module], pp: int, split: Any, index: int
) -> Callable[[], nn.Module]:
    """A factory of stage `index`: the whole model built, then cut as wrap cuts it
    (picklable when `model_factory` is, for a simulation in a subprocess)."""
    return functools.partial(_built_stage, model_factory, pp, split, index)


def _built_stage(
    model_factory: Callable[[], nn.Module], pp: int, split: Any, index: int
) -> nn.Module:
    model = model_factory()
    state = build_stage(model, plan_stages(model, pp, split), index)
    state.running = True  # stepped here directly, not through a schedule
    return model


def stage_input(
    model: nn.Module, stage: StageSim, rows: int, seq_len: int, dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One micro-batch for the stage: what it would receive (a later stage: hidden states
    that require a gradient), and the batch's tensors as keywords (every stage gets them)."""
    from shardwise.memory.fake import default_input
    from shardwise.parallelize.pipeline import batch_keywords, pipeline_state

    state = pipeline_state(model)
    assert state is not None  # built by stage_factory
    kwargs = batch_keywords(state, default_input(model, rows, seq_len))
    if stage.index == 0:
        return (), kwargs
    hidden = torch.zeros(rows, seq_len, stage.hidden, dtype=dtype, requires_grad=True)
    return (hidden,), kwargs


def tracked_stage_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    make_input: Callable[[], tuple[tuple[Any, ...], dict[str, Any]]],
    order: list[tuple[str, int]],
    tracker: Any,
    recorder: Any = None,
) -> None:
    """The stage's step in `order`, inside `tracker` (entered here): forwards keep their
    outputs until their backward; FSDP2 is told what PipelineStage tells it. A `recorder`
    (the fast simulation's) is told each position in the order."""
    from shardwise.memory.fake import loss_of

    backwards = [mb for kind, mb in order if kind == "B"]
    pending: dict[int, torch.Tensor] = {}
    phase = recorder.set_phase if recorder is not None else lambda step, name: None
    with tracker:
        for step, (kind, mb) in enumerate(order):
            phase(step, kind)
            if kind == "F":
                # The tracker keeps per-module figures for one forward of the root; its
                # total and peak, which this measures, run on across the calls.
                tracker.reset_mod_stats()
                received, kwargs = make_input()
                pending[mb] = loss_of(model(*received, **kwargs))
                continue
            last = mb == backwards[-1]
            if isinstance(model, FSDPModule):
                model.set_is_last_backward(last)
                model.set_reshard_after_backward(last)
                model.set_requires_gradient_sync(last)
            pending.pop(mb).backward()
        phase(len(order), "O")
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def real_stage_step(
    model_factory: Callable[[], nn.Module],
    config: Any,
    *,
    batch: int,
    seq_len: int,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
) -> dict[str, Any]:
    """The real counterpart of a stage's simulation, on every rank of a job with pipeline
    stages: wrap, one untracked step (the schedule's first infers its shapes and the
    optimizer makes its state), then one step of `batch` rows per data-parallel rank under
    torch's memory tracker. Returns this rank's stage, peak and categories at the peak.

    The tracker refuses a module called more than once per tracked step; its per-module
    figures are cleared before each of the root's forwards (its totals and peak, which
    this reads, run on)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn.modules.module import register_module_forward_pre_hook

    from shardwise.memory.fake import default_input
    from shardwise.parallelize.apply import wrap
    from shardwise.parallelize.pipeline import pipeline_state, pipeline_step

    model = wrap(model_factory(), config)
    opt = (optimizer or torch.optim.AdamW)(model.parameters())
    inputs = default_input(model, batch, seq_len)
    pipeline_step(model, inputs)
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()  # FSDPMemTracker refuses a root called once per micro-batch
    tracker.track_external(model, opt)
    _follow_category_peaks(tracker)

    def clear(module: nn.Module, args: Any) -> None:
        if module is model:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(clear)
    try:
        with tracker:
            pipeline_step(model, inputs)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        handle.remove()
    total, at_peak, _ = _peaks(tracker)
    state = pipeline_state(model)
    assert state is not None
    return {"stage": state.index, "peak": total, "at_peak": at_peak}


def tracked_stage(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    stage: StageSim,
    rows: int,
    seq_len: int,
    dtype: torch.dtype,
    recorder: Any = None,
) -> dict[str, Any]:
    """`tracked_step` for one pipeline stage: its micro-batches in its schedule's order."""
    _create_optimizer_state(model, optimizer)

    def make_input() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return stage_input(model, stage, rows, seq_len, dtype)

    received, kwargs = make_input()
    tracker = _tracker(model, optimizer, (*received, *kwargs.values()))
    _follow_category_peaks(tracker)
    if recorder is not None:
        recorder.attach(tracker, _CATEGORIES)
    order = stage_order(stage.schedule, stage.plan.pp, stage.index, stage.microbatches)
    tracked_stage_step(model, optimizer, make_input, order, tracker, recorder)
    total, at_peak, own = _peaks(tracker)
    result = {"peak": total, "at_peak": at_peak, "category_peaks": own}
    if recorder is not None:
        result["segments"] = recorder.finish(0)
    return result


def simulate_stages(
    kwargs: dict[str, Any], run: Callable[[dict[str, Any]], Job], grouping: Any = None
) -> Job:
    """Each stage simulated alone over its own data- and tensor-parallel ranks (`run` is
    the job simulating one, given simulate_step's arguments and `stage`; every stage's
    traces are asked together), as a job whose answer is the report of the stage with the
    highest peak, listing every stage. `grouping` (the fast path's
    memory/stage_groups.py): stages holding the same blocks are simulated once per
    in-flight count needed, the others derived."""
    config = kwargs["config"]
    pp, world, batch = config.pp, kwargs["world"], kwargs["batch"]
    if world % pp:
        raise ValueError(f"simulate_step: ParallelConfig.pp={pp} does not divide world={world}.")
    if config.stages_per_rank > 1:
        raise NotImplementedError(
            f"simulate_step with pp_schedule={config.pp_schedule!r} is not built yet: a rank "
            "holds several stages whose micro-batches interleave, and the simulation runs "
            "one stage per rank. `shardwise plan --pp N` gives each rank's model states; the "
            "same split under pp_schedule='1f1b' simulates the activations of one stage per "
            "rank (not a bound for interleaving, which keeps more micro-batches in flight)."
        )
    if kwargs["example_input"] is not None:
        raise NotImplementedError(
            "simulate_step with ParallelConfig.pp and example_input is not built yet: each "
            "stage takes the default (batch, seq_len) token input."
        )
    microbatches = config.pp_microbatches or default_microbatches(pp)
    check_microbatches(pp, config.pp_schedule, microbatches, batch)
    with init_empty():
        whole = kwargs["model_factory"]()
    plan = plan_stages(whole, pp, config.pp_split)
    hidden = hidden_width(whole, plan)
    traced = grouping.traced_stages(whole, plan, config, microbatches) if grouping else {}
    simulated = []
    for index in range(pp):
        stage = StageSim(plan, index, config.pp_schedule, microbatches, hidden)
        if index in traced and traced[index] is not None:
            continue
        one = dict(
            kwargs,
            model_factory=stage_factory(kwargs["model_factory"], pp, config.pp_split, index),
            config=dataclasses.replace(config, pp=1),
            world=world // pp,
            batch=batch // microbatches,
            stage=stage,
        )
        simulated.append((stage, run(one)))
    answers = yield from gather([job for _, job in simulated])
    reports = [(stage, report) for (stage, _), report in zip(simulated, answers, strict=True)]
    derived = (
        grouping.derived_stages(plan, config.pp_schedule, microbatches, hidden, traced, reports)
        if grouping
        else []
    )
    reports = sorted([*reports, *derived], key=lambda sr: sr[0].index)
    stages = [
        {
            "index": st.index,
            "peak": r.peak,
            "model_states": r.model_states,
            "in_flight": st.in_flight,
            "path": r.path,
        }
        for st, r in reports
    ]
    worst = max(reports, key=lambda sr: sr[1].peak)[1]
    note = (
        f"pp {pp}, {config.pp_schedule}, {microbatches} micro-batches of {batch // microbatches} "
        f"row(s); each stage over world // pp = {world // pp} rank(s); the stage with the "
        "highest peak is reported"
    )
    paths = {r.path for _, r in reports}
    if len(paths) > 1:
        note += "; stages simulated fast and in full (each stage's path is listed)"
    if derived:
        note += (
            f"; stage(s) {', '.join(str(st.index) for st, _ in derived)} hold the same blocks "
            "as other stages and were derived from them (same micro-batches in flight: "
            "copied; 1F1B, between two traced in-flight counts: interpolated)"
        )
    return dataclasses.replace(
        worst, world_size=world, batch=batch, pp=pp, stages=stages, notes=[note, *worst.notes]
    )
