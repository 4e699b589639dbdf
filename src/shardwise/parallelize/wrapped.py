"""What `wrap` did to a model, and the optimizer check that follows from it.

Owns: `WrapInfo` and the attribute `wrap` sets on a model (`wrap_info`), `unwrap` (the
user's module inside a DDP wrapper), and the record of parameters sharding replaced
(`mark_replaced`, `stale_parameters`) with the process-wide optimizer step pre-hook that
refuses an optimizer built before wrapping. Applying, weights, checkpoints, training and
the host adapters all read these, so they sit below all of them.

Must not: wrap, shard or step anything.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardwise.config.parallel import ParallelConfig
from shardwise.distributed.mesh import MeshSpec
from shardwise.distributed.process_group import DistInfo
from shardwise.plan.planner import WrapPlan
from shardwise.plan.stages import StagePlan

INFO_ATTR = "_shardwise_wrap_info"


@dataclass(frozen=True)
class WrapInfo:
    """What `wrap` did to a model: the resolved mesh and plan (None when left unwrapped)."""

    config: ParallelConfig
    dist: DistInfo
    mesh_spec: MeshSpec | None
    plan: WrapPlan | None
    device_mesh: DeviceMesh | None = None
    """The mesh the model was sharded over (None for ddp and when left unwrapped); under
    tensor parallelism the whole (dp_replicate, dp_shard, tp) mesh."""
    tp_plan: dict[str, str] | None = None
    """Under tensor parallelism: each planned module pattern and its style."""
    stages: StagePlan | None = None
    """Under pipeline parallelism: the model's stages (this rank holds `pp_rank`'s)."""

    @property
    def wrapped(self) -> bool:
        return self.mesh_spec is not None

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own part of the batch (a tp group, one part)."""
        return self.mesh_spec.dp_size if self.mesh_spec is not None else self.dist.world_size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index, for a sampler: the ranks of one tp or cp group
        share it."""
        spec, mesh = self.mesh_spec, self.device_mesh
        if spec is None or (spec.tp == 1 and spec.pp == 1 and spec.cp == 1) or mesh is None:
            return self.dist.rank
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # every rank is in the mesh wrap built
        first = 1 if spec.pp > 1 else 0  # (pp, dp_replicate, dp_shard[, cp][, tp])
        return coordinate[first] * spec.dp_shard + coordinate[first + 1]

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (0 without pipeline stages)."""
        spec, mesh = self.mesh_spec, self.device_mesh
        if spec is None or spec.pp == 1 or mesh is None:
            return 0
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        return coordinate[0]

    def __str__(self) -> str:
        if self.mesh_spec is None:
            return f"unwrapped at world size {self.dist.world_size} ({self.config.precision})"
        if self.plan is None or self.mesh_spec.engine == "ddp":  # DDP has no shard units
            return str(self.mesh_spec)
        tp = "".join(f"\n  tp: {k} -> {v}" for k, v in (self.tp_plan or {}).items())
        stages = f"\n{self.stages}" if self.stages is not None else ""
        return f"{self.mesh_spec}{tp}{stages}\n{self.plan}"


def wrap_info(model: nn.Module) -> WrapInfo | None:
    """The `WrapInfo` `wrap` attached to `model`, or None if it did not wrap it."""
    return cast(WrapInfo | None, getattr(model, INFO_ATTR, None))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 wraps in place, so it is the model)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


_REPLACED_ATTR = "_shardwise_replaced_by_wrap"


# Bumped whenever wrap replaces parameters, so an optimizer checked before is checked again.
_generation = 0


_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


_hook_handle: Any = None


def mark_replaced(old: Iterable[nn.Parameter], new: Iterable[nn.Parameter]) -> None:
    """Remember the parameters sharding replaced, so a stale optimizer is caught at its
    first step (`fully_shard` swaps every parameter for a new DTensor parameter)."""
    global _generation, _hook_handle
    kept = {id(p) for p in new}
    for p in old:
        if id(p) not in kept:
            setattr(p, _REPLACED_ATTR, True)
    _generation += 1
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_refuse_stale)


def mark_before_sharding(model: nn.Module, keep: set[str]) -> None:
    """Mark every parameter of `model` that sharding is about to replace (all but the names
    in `keep`, which fully_shard leaves as they are), so an optimizer built from them is
    refused at its first step. Holds no reference: each unit's original parameters can be
    freed as soon as that unit is sharded."""
    global _generation, _hook_handle
    for name, p in model.named_parameters():
        if name not in keep:
            setattr(p, _REPLACED_ATTR, True)
    _generation += 1
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_refuse_stale)


def stale_parameters(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(parameters `wrap` replaced, parameters held) for an optimizer."""
    held = [p for g in optimizer.param_groups for p in g["params"]]
    return sum(1 for p in held if getattr(p, _REPLACED_ATTR, False)), len(held)


def _refuse_stale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _checked.get(optimizer) == _generation:  # one look per optimizer and wrap
        return
    stale, held = stale_parameters(optimizer)
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step(): {stale} of {held} parameter(s) in this "
            "optimizer were replaced when shardwise.wrap sharded the model (fully_shard swaps "
            "each parameter for a sharded DTensor parameter). The optimizer was built before "
            "wrapping, so it would update tensors the model no longer uses and training would "
            "not change the model. Build it after wrapping: model = shardwise.wrap(model, "
            "config); optimizer = torch.optim.AdamW(model.parameters(), ...)."
        )
    _checked[optimizer] = _generation
