"""Pipeline parallel: run a step over the schedule (torch's PipelineStage with
Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B) on the stages stages.py built.

Owns: the schedule, `pipeline_step` (a step's forward and backward; the batch's mean loss
on every rank), `pipeline_eval`, the sum of tied parameters' gradients between the first
and last stage, and the gradient norm over the stages.

Must not: hand-write send/recv or schedules (torch's pipelining does both), decide the
split (plan/stages.py does), build the stages (stages.py does), or shard (fsdp.py does).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardwise.config.pipeline import check_microbatches, default_microbatches
from shardwise.distributed.mesh import PP_DIM
from shardwise.parallelize.stages import (
    PipelineState,
    build_stage,
    is_shim,
    pipeline_state,
)

__all__ = [
    "PipelineState",
    "build_stage",
    "is_shim",
    "pipeline_eval",
    "pipeline_state",
    "pipeline_step",
    "start_schedule",
]


def start_schedule(
    model: nn.Module,
    state: PipelineState,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    schedule: str,
    microbatches: int | None,
) -> None:
    """torch's PipelineStage for each of this rank's stages over the mesh's pp dimension,
    and the schedule that drives them; the groups for tied gradients."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    pp_mesh = mesh[PP_DIM]
    state.group = pp_mesh.get_group()
    state.device = device
    state.microbatches = microbatches or default_microbatches(state.plan.degree)
    state.schedule_name = schedule
    ranks = dist.get_process_group_ranks(state.group)
    state.last_rank = ranks[-1]
    if state.plan.tied:
        state.tie_group = _tie_group(mesh)
        state.tied = [model.get_parameter(name) for name in state.tied_names]
    for p in model.parameters():
        setattr(p, _STAGE_ATTR, state)
    stages: list[Any] = [
        PipelineStage(c.module, c.index, state.plan.pp, device, group=state.group)
        for c in state.chunks
    ]
    # Each micro-batch's loss is weighted by the step itself (`_weighted`), so the schedule
    # must not divide gradients again: its division would also hit gradients accumulated
    # by earlier steps of an accumulation window.
    if schedule == "interleaved_1f1b":
        state.schedule = ScheduleInterleaved1F1B(
            stages, state.microbatches, loss_fn=_weighted, scale_grads=False
        )
        return
    kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    state.schedule = kind(stages[0], state.microbatches, loss_fn=_weighted, scale_grads=False)


def _tie_group(mesh: DeviceMesh) -> Any:
    """The (first stage, last stage) pair of every pipeline, made on every rank in the same
    order; this rank's pair."""
    grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)
    mine = None
    me = dist.get_rank()
    for column in range(grid.shape[1]):
        pair = [int(grid[0, column]), int(grid[-1, column])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine


# Each stage's parameters carry their stage, for norms over the whole pipeline from a list
# of parameters alone (shardwise.clip_grad_norm_ in a plain loop is given no model).
_STAGE_ATTR = "_shardwise_stage"


# The weight of each micro-batch's loss in the step, set by pipeline_step around the
# schedule (one step runs at a time in a process).
_WEIGHT = [1.0]


def _weighted(output: torch.Tensor, target: Any) -> torch.Tensor:
    return output * _WEIGHT[0]


def batch_keywords(state: PipelineState, batch: object) -> dict[str, Any]:
    """The batch as the forward's keyword arguments: the schedule hands keywords to every
    stage, positional arguments only to the first."""
    if isinstance(batch, Mapping):
        return dict(batch)
    args = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
    bound = state.signature.bind(None, *args)  # None stands for self
    self_name = next(iter(state.signature.parameters))
    return {k: v for k, v in bound.arguments.items() if k != self_name}


def _rows(kwargs: dict[str, Any]) -> int:
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(
        "ParallelConfig.pp: the batch holds no tensor to cut into micro-batches; give the "
        "model's inputs as tensors whose first dimension is the batch."
    )


def _check_shapes(state: PipelineState, kwargs: dict[str, Any]) -> None:
    """Every step's batch has the first step's shapes: torch's schedule sizes the buffers
    it sends and receives at its first step, and a batch of another shape would make
    the stages' sends and receives disagree (gloo aborts the process)."""
    shapes = {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    if state.shapes is None:
        state.shapes = shapes
    elif shapes != state.shapes:
        raise ValueError(
            f"ParallelConfig.pp={state.plan.degree}: this batch's tensors have shapes {shapes}, "
            f"but the pipeline's first batch had {state.shapes}; the schedule sends buffers "
            "of the first batch's size. Give every batch the same shape: a fixed sequence "
            "length, and no short last batch (RunnerConfig.drop_last=True, or drop_last=True "
            "on your DataLoader)."
        )


def _counted_tokens(model: nn.Module, kwargs: dict[str, Any]) -> Any:
    """The tokens the whole batch's loss averages over, so that each micro-batch's loss is
    a share of the batch's mean: the caller's own `num_items_in_batch` (taken out of the
    keywords the schedule splits), or for a Hugging Face causal LM with labels the labels
    that count, as a 0-dim tensor on their device (no wait for it on the host); None for
    any other model."""
    if "num_items_in_batch" in kwargs:
        return kwargs.pop("num_items_in_batch")
    labels = kwargs.get("labels")
    if labels is None or getattr(model, "loss_type", None) != "ForCausalLM":
        return None
    return (labels[..., 1:] != -100).sum().clamp_min(1)


def _run_schedule(
    model: nn.Module,
    state: PipelineState,
    batch: object,
    scale: float,
    *,
    forward_only: bool,
    sync: bool = True,
) -> list[torch.Tensor]:
    """The checks every step makes, then the schedule over the batch's micro-batches; the
    last stage's weighted micro-batch losses (empty on the other stages)."""
    kwargs = batch_keywords(state, batch)
    if state.cutter is None:
        return _run_cut(model, state, kwargs, scale, forward_only=forward_only, sync=sync)
    try:  # under cp: this rank's part of every sequence, its layout current for the step
        kwargs = state.cutter.keywords(model, state.signature, kwargs)
        losses = _run_cut(model, state, kwargs, scale, forward_only=forward_only, sync=sync)
        state.cutter.after(model, (), {}, None)  # at the first step: attention read it whole
        return losses
    finally:
        state.cutter.forget()


def _run_cut(
    model: nn.Module,
    state: PipelineState,
    kwargs: dict[str, Any],
    scale: float,
    *,
    forward_only: bool,
    sync: bool,
) -> list[torch.Tensor]:
    rows = _rows(kwargs)
    check_microbatches(state.plan.degree, state.schedule_name, state.microbatches, rows)
    _check_shapes(state, kwargs)
    state.items = _counted_tokens(model, kwargs)
    _WEIGHT[0] = scale if state.items is not None else scale / state.microbatches
    losses: list[torch.Tensor] = []
    extra: dict[str, Any] = {}
    if state.is_last:
        extra = {"target": torch.zeros(rows), "losses": losses}
    state.running = True
    try:
        if forward_only:
            with torch.no_grad():
                state.schedule.eval(**kwargs, **extra, return_outputs=False)
        else:
            with _reduced_on_last_step(state, sync):
                state.schedule.step(**kwargs, **extra, return_outputs=False)
    finally:
        state.running = False
        state.items = None
        state.clear()
    return losses


@contextlib.contextmanager
def _reduced_on_last_step(state: PipelineState, sync: bool) -> Iterator[None]:
    """The stages' gradients reduced over the data-parallel ranks only on the last step of
    an accumulation window (`sync`). torch's schedule ends every step by turning FSDP's
    gradient sync on and reducing (`perform_reduce_grad`), which under accumulation over k
    steps reduce-scattered (and under HSDP all-reduced) k times; held back, FSDP keeps the
    unsharded gradients and reduces their sum once, as without pp."""
    if sync:
        yield
        return
    held: list[nn.Module] = []
    for chunk in state.chunks:
        module = chunk.module
        if isinstance(module, FSDPModule):
            turn = type(module).set_requires_gradient_sync
            # An instance attribute over the method, for this step only: torch's call of it
            # inside perform_reduce_grad keeps the sync off.
            module.__dict__["set_requires_gradient_sync"] = functools.partial(
                _sync_off, turn, module
            )
            held.append(module)
    try:
        yield
    finally:
        for module in held:
            del module.__dict__["set_requires_gradient_sync"]


def _sync_off(turn: Callable[..., None], module: nn.Module, requires: bool, **kwargs: Any) -> None:
    turn(module, False, **kwargs)


def pipeline_step(
    model: nn.Module, batch: object, *, scale: float = 1.0, sync: bool = True
) -> torch.Tensor:
    """One step's forward and backward over the schedule; the batch's loss on every rank
    (a 0-dim fp32 tensor), as one process would compute it on this rank's batch.

    `batch` is what the model's forward takes: a mapping of keyword arguments or a tuple
    of positional ones, with the targets under one of `TARGET_NAMES`. It is cut into
    `pp_microbatches` equal micro-batches. A Hugging Face causal LM's loss is weighted by
    the tokens it counts in the whole batch (exact with padding), or by the batch's own
    `num_items_in_batch`; any other model's per-micro-batch mean counts each micro-batch
    equally. Gradients are multiplied by `scale` (the Engine passes 1 / accumulate_steps).
    With `sync` (the default) the gradients are reduced over the data-parallel ranks and
    tied parameters' gradients are summed between the first and last stage after the
    backward: pass sync=False on all but the last step of an accumulation window."""
    state = _checked_state(model)
    losses = _run_schedule(model, state, batch, scale, forward_only=False, sync=sync)
    if sync:
        sync_tied_grads(model)
    return _loss_on_every_rank(state, losses, scale)


def pipeline_eval(model: nn.Module, batch: object) -> torch.Tensor:
    """The batch's loss, forward only over the schedule, on every rank (no gradients)."""
    state = _checked_state(model)
    losses = _run_schedule(model, state, batch, 1.0, forward_only=True)
    return _loss_on_every_rank(state, losses, 1.0)


def _checked_state(model: nn.Module) -> PipelineState:
    state = pipeline_state(model)
    if state is None or state.schedule is None:
        raise ValueError(
            "shardwise.pipeline_step: the model has no pipeline stages. It takes a model "
            "wrapped with ParallelConfig(pp=N) for N > 1; train any other model as usual."
        )
    return state


def _loss_on_every_rank(
    state: PipelineState, losses: list[torch.Tensor], scale: float
) -> torch.Tensor:
    """The last stage's loss (the weighted micro-batch losses summed, unscaled), sent to
    the other stages of its pipeline, for logging, metrics and non-finite checks."""
    if state.is_last:
        value = torch.stack([x.detach().float() for x in losses]).sum() / scale
        value = value.to(state.device)
    else:
        value = torch.zeros((), device=state.device)
    dist.broadcast(value, src=state.last_rank, group=state.group)
    return value


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """On the last stage: each tied parameter's name here -> its name on the first stage
    (the name a whole model's optimizer keys its state by), for checkpoints that move
    between pp degrees. Empty elsewhere."""
    state = pipeline_state(model)
    if state is None or state.is_first or not state.is_last:
        return {}
    return {last: first for first, last in state.plan.tied}


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def sync_tied_grads(model: nn.Module) -> None:
    """Sum the gradients of parameters the first and last stage share (tied embeddings)
    between those two stages, so both copies step identically. Each stage's copy is
    sharded the same way over its data-parallel ranks, so local shards are summed."""
    state = pipeline_state(model)
    if state is None or state.tie_group is None or not state.tied:
        return
    for p in state.tied:
        if p.grad is None:
            raise RuntimeError(
                "ParallelConfig.pp: a tied parameter has no gradient on stage "
                f"{state.index} after the backward; both ends of the tie must use it."
            )
        dist.all_reduce(_local(p.grad), group=state.tie_group)


def stage_grad_norm_squared(
    parameters: list[nn.Parameter],
    norm_of: Callable[[list[nn.Parameter]], torch.Tensor],
    stage: PipelineState | None = None,
) -> torch.Tensor | None:
    """The squared gradient norm over every stage of the pipeline `parameters` belong to
    (or `stage`'s, which may hold none of them), or None when they belong to none: each
    stage's own (`norm_of`), a tied parameter counted once (on the first stage), summed
    over the pipeline's stages."""
    states = {id(s): s for p in parameters if (s := getattr(p, _STAGE_ATTR, None)) is not None}
    if stage is not None:
        states[id(stage)] = stage
    if not states:
        return None
    (state,) = states.values()  # one model's parameters
    skip = {id(p) for p in state.tied} if not state.is_first else set()
    mine = [p for p in parameters if id(p) not in skip]
    # On the stage's device also where this stage trains nothing (LoRA on some layers):
    # the norm of no gradient is a CPU zero, which a cpu:gloo,cuda:nccl group would reduce
    # over gloo on this rank and over NCCL on the others (a hang).
    squared = norm_of(mine).float().to(state.device) ** 2
    dist.all_reduce(squared, group=state.group)
    return squared
