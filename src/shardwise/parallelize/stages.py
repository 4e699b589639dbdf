"""This rank's pipeline stages, built in place from a `StagePlan`.

Owns: turning the whole model into what this pipeline rank holds. The blocks and modules
other ranks hold are replaced by shims without parameters, so names never change and the
model's own forward runs on every stage: positions, rotary embeddings and the causal mask
are recomputed there, and the received hidden states enter at the first block a stage
holds, never through the embeddings, so no family's embedding scale is applied twice.
A rank that holds one stage runs the model itself. A rank that holds several (interleaved
schedules) keeps the model as the union of its stages, the module that is trained,
checkpointed and given to the optimizer, and runs each stage through a copy of the path
from the root to the blocks: the copies share every block and leaf module, and so every
parameter, with the model, but each sees only its own stage's blocks.

Must not: decide the split (plan/stages.py does), run the schedule (pipeline.py does), or
shard (fsdp.py does, after this).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardwise.plan.stages import StagePlan

__all__ = ["PipelineState", "StageChunk", "build_stage", "is_shim", "pipeline_state"]

STATE_ATTR = "_shardwise_pipeline"
CHUNK_ATTR = "_shardwise_stage_chunk"
TARGET_NAMES = ("labels", "targets", "target")
"""Keyword arguments that carry the loss's targets: only the last stage, which computes the
loss, is given them (the others stop at their last block)."""


class _Skip(nn.Module):
    """A block another stage holds: hands its input on."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class _Pass(nn.Module):
    """A module before or after the blocks that another stage holds (norm, head)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else next(iter(kwargs.values()))


class _ZeroEmbedding(nn.Module):
    """An embedding the first stage holds: zeros of its output's shape (the hidden states
    that stage sends replace them at this stage's first block)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


def is_shim(module: nn.Module) -> bool:
    """Whether `module` stands in for a part another pipeline stage holds."""
    return isinstance(module, (_Skip, _Pass, _ZeroEmbedding))


@dataclass
class StageChunk:
    """One stage this rank runs: the module torch's PipelineStage drives (the model itself
    when the rank holds one stage) and what carries hidden states in and out of it."""

    index: int
    module: nn.Module
    first_param: str
    """The name of the first block's input (for blocks called with keywords)."""
    forward: Callable[..., Any]
    """The model's own forward, bound to `module`."""
    received: torch.Tensor | None = None
    captured: torch.Tensor | None = None


@dataclass
class PipelineState:
    """This rank's stages and schedule, kept on the model (`pipeline_state`)."""

    plan: StagePlan
    chunks: list[StageChunk]
    signature: inspect.Signature
    tied_names: list[str] = field(default_factory=list)
    """This rank's names of parameters the first and last stage share."""
    tied: list[nn.Parameter] = field(default_factory=list)
    """Those parameters, as sharded (found by name once sharding has replaced them)."""
    schedule: Any = None
    microbatches: int = 0
    schedule_name: str = "1f1b"
    group: Any = None
    """The process group of this rank's pipeline (one rank per pipeline coordinate)."""
    tie_group: Any = None
    """The ranks of this pipeline's first and last stage, for tied gradients."""
    last_rank: int = 0
    """The global rank of this pipeline's last stage."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where this rank's stages compute (wrap's device for the rank): what the stages
    exchange outside the schedule (the loss, the gradient norm) is put there."""
    items: Any = None
    """The tokens the whole batch's loss averages over (a 0-dim device tensor, or the
    user's own num_items_in_batch) during a step, handed to the last stage's forward; the
    schedule would split a tensor keyword by rows."""
    shapes: dict[str, tuple[int, ...]] | None = None
    """The batch's tensor shapes at the first step: the schedule's buffers are sized then."""
    running: bool = False
    cutter: Any = None
    """Under context parallel: cuts each whole batch's sequences for this rank before the
    schedule cuts it into micro-batches (parallelize/context.py)."""

    @property
    def index(self) -> int:
        """This rank's first stage, which is also its coordinate in the pipeline."""
        return self.chunks[0].index

    @property
    def is_first(self) -> bool:
        return self.chunks[0].index == 0

    @property
    def is_last(self) -> bool:
        return self.chunks[-1].index == self.plan.pp - 1

    def clear(self) -> None:
        for chunk in self.chunks:
            chunk.received = chunk.captured = None


def pipeline_state(model: nn.Module) -> PipelineState | None:
    """The stages `wrap` made of `model`, or None when it has no pipeline stages."""
    state = model.__dict__.get(STATE_ATTR)
    return state if isinstance(state, PipelineState) else None


_NOT_CALLABLE = (
    "a model wrapped with ParallelConfig.pp={pp} is one stage of a pipeline and cannot be "
    "called like a plain module: run a training step with shardwise.pipeline_step(model, "
    "batch) (forward and backward over the schedule; it returns the batch's mean loss on "
    "every rank), evaluate with shardwise.pipeline_eval(model, batch), or let the Engine "
    "or Runner step it."
)


class _StageForward:
    """Mixed into the class of each module a stage runs (and of the model): the forward
    the schedule calls."""

    def forward(self, *received: Any, **batch: Any) -> Any:
        state = pipeline_state(self)  # type: ignore[arg-type]
        chunk = self.__dict__.get(CHUNK_ATTR)
        assert state is not None  # the class is only swapped in with the state
        if not state.running or not isinstance(chunk, StageChunk):
            raise RuntimeError(_NOT_CALLABLE.format(pp=state.plan.degree))
        last = chunk.index == state.plan.pp - 1
        if chunk.index != 0:
            chunk.received = received[0]
        if not last:
            batch = {k: v for k, v in batch.items() if k not in TARGET_NAMES}
        elif state.items is not None:
            batch = {**batch, "num_items_in_batch": state.items}
        out = chunk.forward(**batch)
        if not last:
            captured, chunk.captured = chunk.captured, None
            assert captured is not None  # the last block's hook ran
            return captured
        return loss_of(out)


def loss_of(out: Any) -> torch.Tensor:
    """The last stage's output as its loss."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    if isinstance(loss, (tuple, list)) and loss:
        loss = loss[0]
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "ParallelConfig.pp: the last stage's forward must return the loss (a 0-dim "
            "tensor, or an output with .loss), but it returned "
            f"{type(out).__name__}. Pass the targets in the batch under one of "
            f"{list(TARGET_NAMES)} so the model computes its own loss."
        )
    return loss


def _first_param(block: nn.Module) -> str:
    params = [
        p
        for p in inspect.signature(block.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return params[0].name if params else "hidden_states"


def _shims(model: nn.Module, plan: StagePlan, held: set[str]) -> dict[str, nn.Module]:
    """A shim for every block and module outside the block list that `held` lacks."""
    modules = dict(model.named_modules())
    blocks = [f"{plan.container}.{i}" for i in range(len(modules[plan.container]))]
    out: dict[str, nn.Module] = {fqn: _Skip() for fqn in blocks if fqn not in held}
    for fqn in plan.before:
        if fqn not in held:
            module = modules[fqn]
            out[fqn] = (
                _ZeroEmbedding(module.embedding_dim, module.weight.dtype)
                if isinstance(module, nn.Embedding)
                else _Pass()
            )
    out.update({fqn: _Pass() for fqn in plan.after if fqn not in held})
    return out


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, name, new)


def _copy_with(model: nn.Module, shims: dict[str, nn.Module]) -> nn.Module:
    """A copy of the modules on the paths from the root to `shims`' names, with those
    names replaced; every other module is the model's own (shared, with its parameters
    and hooks). The path holds no parameters of its own (plan_stages refuses that)."""
    path = {".".join(fqn.split(".")[:k]) for fqn in shims for k in range(fqn.count(".") + 1)}

    def copy_of(name: str, module: nn.Module) -> nn.Module:
        if name in shims:
            return shims[name]
        if name not in path:
            return module
        new = copy.copy(module)
        for attr, value in vars(module).items():  # its own hooks and registries
            if isinstance(value, dict):
                new.__dict__[attr] = copy.copy(value)
        for child, sub in module._modules.items():
            if sub is not None:
                new._modules[child] = copy_of(f"{name}.{child}" if name else child, sub)
        return new

    return copy_of("", model)


def _stage_class(module: nn.Module) -> None:
    cls = type(module)
    module.__class__ = type(f"Stage{cls.__name__}", (_StageForward, cls), {})


def build_stage(model: nn.Module, plan: StagePlan, pp_rank: int) -> PipelineState:
    """Make `model` what pipeline rank `pp_rank` holds, in place: what other ranks hold is
    replaced by shims, and each stage of this rank gets the module it runs, with hooks that
    carry the hidden states in and out. Returns the state (also kept on the model)."""
    indices = plan.held_by(pp_rank)
    held = set().union(*(plan.owned(i) for i in indices))
    modules = dict(model.named_modules())
    state = PipelineState(plan=plan, chunks=[], signature=inspect.signature(type(model).forward))
    for first, last in plan.tied:
        if 0 in indices:
            state.tied_names.append(first)
        if plan.pp - 1 in indices:
            state.tied_names.append(last)
    # Each stage's shims are made from the whole model, before the rank's own replace it.
    own = {i: _shims(model, plan, plan.owned(i)) for i in indices} if len(indices) > 1 else {}
    for fqn, shim in _shims(model, plan, held).items():
        _replace(model, fqn, shim)
    for index in indices:
        stage = plan.stages[index]
        module = _copy_with(model, own[index]) if own else model
        first_block = modules[stage.blocks[0]]
        chunk = StageChunk(
            index, module, _first_param(first_block), type(module).forward.__get__(module)
        )
        state.chunks.append(chunk)
        if index != 0:
            first_block.register_forward_pre_hook(_injector(chunk), with_kwargs=True)
        if index != plan.pp - 1:
            modules[stage.blocks[-1]].register_forward_hook(_capturer(chunk))
        module.__dict__[STATE_ATTR] = state
        module.__dict__[CHUNK_ATTR] = chunk
        _stage_class(module)
    if len(indices) > 1:  # the union: trained and saved, never called
        model.__dict__[STATE_ATTR] = state
        _stage_class(model)
    return state


def _injector(chunk: StageChunk) -> Callable[..., Any]:
    def inject(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        received, chunk.received = chunk.received, None
        if received is None:
            return None
        if args:
            return (received, *args[1:]), kwargs
        return args, {**kwargs, chunk.first_param: received}

    return inject


def _capturer(chunk: StageChunk) -> Callable[..., None]:
    def capture(module: nn.Module, args: Any, output: Any) -> None:
        chunk.captured = output if isinstance(output, torch.Tensor) else output[0]

    return capture
