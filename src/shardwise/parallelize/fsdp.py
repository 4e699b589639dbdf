"""fully_shard (FSDP2): every sharded strategy, from ZeRO-2 to HSDP.

Owns: one fully_shard call per planned unit in post-order (children first, the root last),
each with its unit's mixed-precision policy (fp32 for keep_fp32 units), CPU offload and
ignored parameters; explicit prefetch wiring; keeping 0-dim parameters whole with their
gradients averaged; and broadcasting rank 0's values before sharding.

Must not: decide the strategy or mesh (apply.py and distributed/mesh.py do), or
hand-write sharding: torch's fully_shard does it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from shardwise.config.parallel import ParallelConfig
from shardwise.config.precision import Precision
from shardwise.distributed.mesh import MeshSpec
from shardwise.distributed.process_group import DistInfo
from shardwise.plan.planner import WrapPlan

_BROADCAST_BUCKET_BYTES = 16 * 2**20
_IN_PLACE_BYTES = 2**20  # larger tensors are broadcast where they are, without a copy


def sync_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite every rank's `tensors` with rank `src`'s: each large one broadcast in
    place, the small ones through flat buckets per dtype and device (one copy of at most
    16 MiB at a time). Every rank passes the same tensors in the same order."""
    small: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    with torch.no_grad():
        for t in tensors:
            if t.is_meta:
                continue
            if t.numel() * t.element_size() >= _IN_PLACE_BYTES and t.is_contiguous():
                dist.broadcast(t.detach(), src=src)
            else:
                small.setdefault((t.dtype, t.device), []).append(t)
        for group in small.values():
            start = 0
            while start < len(group):
                bucket: list[torch.Tensor] = []
                size = 0
                while start < len(group) and (not bucket or size < _BROADCAST_BUCKET_BYTES):
                    bucket.append(group[start])
                    size += group[start].numel() * group[start].element_size()
                    start += 1
                flat = torch.cat([b.detach().reshape(-1) for b in bucket])
                dist.broadcast(flat, src=src)
                offset = 0
                for b in bucket:
                    b.copy_(flat[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()


def sync_module_states(model: nn.Module, src: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank `src`'s."""
    sync_tensors([*model.parameters(), *model.buffers()], src)


def unit_preparer(device: torch.device | None, sync: bool) -> Callable[[list[nn.Module]], None]:
    """What runs just before each unit is sharded: move the unit's own parameters and
    buffers (not those of units below it, already sharded) to `device` (None: leave them),
    then make them rank 0's (`sync`). Unit by unit, so no rank holds a full copy of the
    model on its device, and each unit's originals are freed as soon as it is sharded."""
    done: set[int] = set()  # ids of tensors already moved and synced (before and after)

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t if device is None or t.device == device else t.to(device)

    def prepare(targets: list[nn.Module]) -> None:
        fresh: list[torch.Tensor] = []
        for target in targets:
            for module in target.modules():
                for p in module._parameters.values():
                    if p is None or isinstance(p, DTensor) or p.is_meta or id(p) in done:
                        continue
                    moved = to_device(p.data)
                    if moved is not p.data:
                        p.data = moved
                    done.add(id(p))
                    fresh.append(p)
                for name, b in list(module._buffers.items()):
                    if b is None or b.is_meta or id(b) in done:
                        continue
                    moved = to_device(b)
                    module._buffers[name] = moved
                    done.update((id(b), id(moved)))
                    fresh.append(moved)
        if sync:
            sync_tensors(fresh)

    return prepare


def _wire_prefetch(units: list[FSDPModule], root: FSDPModule, config: ParallelConfig) -> None:
    """Explicit FSDP2 prefetch, assuming units run forward in plan (registration) order."""
    back, fwd = config.backward_prefetch_depth, config.forward_prefetch_depth
    if back > 1:
        for i, unit in enumerate(units):
            unit.set_modules_to_backward_prefetch(units[max(0, i - back) : i][::-1])
        root.set_modules_to_backward_prefetch(units[::-1][:back])
    if fwd > 0:
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + fwd])
        root.set_modules_to_forward_prefetch(units[:fwd])


def _fp32_policy(precision: Precision) -> MixedPrecisionPolicy:
    """fp32 compute for keep_fp32 units; outputs go back to the low-precision dtype so the
    next (low-precision) layer gets the input dtype it expects."""
    return MixedPrecisionPolicy(
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        output_dtype=precision.param_dtype,
        cast_forward_inputs=True,
    )


def apply_fsdp(
    model: nn.Module,
    config: ParallelConfig,
    info: DistInfo,
    spec: MeshSpec,
    plan: WrapPlan,
    mesh: Any = None,
    prepare: Callable[[list[nn.Module]], None] | None = None,
) -> Any:
    """fully_shard each planned unit in post-order, `prepare(targets)` just before."""
    mesh = mesh if mesh is not None else spec.build(info.device.type)
    modules = dict(model.named_modules(remove_duplicate=False))
    mp_policy = config.precision.to_fsdp_policy()
    fp32_policy = _fp32_policy(config.precision)
    mixed = config.precision.is_mixed
    offload = config.offload_policy
    if offload is not None and info.device.type != "cuda":
        # Pinned memory needs an accelerator; on CPU the offload is a no-op move.
        offload = type(offload)(pin_memory=False)
    extra: dict[str, Any] = {"offload_policy": offload} if offload is not None else {}
    if plan.ignored_params or plan.replicated_params:
        named = dict(model.named_parameters())
        extra["ignored_params"] = {named[n] for n in plan.ignored_params + plan.replicated_params}
    sharded: list[FSDPModule] = []
    # Post-order: children before parents, so each unit owns only what no unit below owns.
    for unit in plan.units:
        targets = list({id(modules[m]): modules[m] for m in unit.modules}.values())
        if prepare is not None:
            prepare(targets)
        fully_shard(
            targets[0] if len(targets) == 1 else targets,
            mesh=mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=fp32_policy if unit.compute_dtype == "float32" and mixed else mp_policy,
            **extra,
        )
        sharded.append(cast(FSDPModule, targets[0]))
    _wire_prefetch(sharded[:-1], sharded[-1], config)
    return mesh


def shard_experts(
    modules: list[nn.Module], config: ParallelConfig, spec: MeshSpec, mesh: Any, backend: str
) -> None:
    """fully_shard each experts module that expert parallelism spread, over the ranks ep
    leaves (its own unit, before the blocks that hold it). Each expert's gradient arrives
    summed over its ep group's tokens, so FSDP divides by every data-parallel rank, not by
    the ranks it shards over; gloo reduces only by sums, so FSDP divides separately there.

    FSDP splits a parameter's first dimension, padded to a multiple of its ranks: a rank's
    num_experts / ep experts over more ranks than that would be padded up to one expert
    per rank (DeepSeek-V3's 4 experts per rank at ep 64 over 16 ranks: 4 times the
    bytes, in the shards and in every all-gather). Such experts are split on their
    second dimension instead (`expert_placement`), as torchtitan does."""
    ranks = spec.ep_shard
    for module in modules:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=spec.reshard_after_forward,
            mp_policy=_experts_policy(config.precision, module, ranks),
            shard_placement_fn=functools.partial(expert_placement, ranks=ranks),
        )
        unit = cast(FSDPModule, module)
        # every data-parallel and cp rank's tokens reach the experts: as many shares
        unit.set_gradient_divide_factor(float(spec.dp_size * spec.cp))
        # gloo has no pre-multiplied sum: reduce by sums and divide apart. Not over a shard
        # group of one rank (ep == dp_shard), where no reduce-scatter runs: torch 2.13 then
        # divides by the factor in its copy and again after it (half the gradient).
        if backend == "gloo" and ranks > 1:
            unit.set_force_sum_reduction_for_comms(True)


def _experts_policy(precision: Precision, module: nn.Module, ranks: int) -> MixedPrecisionPolicy:
    """The experts unit's policy: the model's, but reducing in fp32 where the gradients
    would be reduced in fp16 over a shard group of one rank (ep == dp_shard). torch 2.13's
    fp16 path divides before the reduction against overflow, and with no reduce-scatter to
    run its copy divides by the factor again: expert gradients came out divided by dp
    twice. One rank moves nothing, so the fp32 reduction costs a cast, not traffic."""
    policy = precision.to_fsdp_policy()
    grads = policy.param_dtype or next(module.parameters()).dtype
    if ranks > 1 or (policy.reduce_dtype or grads) in (torch.float32, torch.bfloat16):
        return policy
    return dataclasses.replace(policy, reduce_dtype=torch.float32)


def expert_placement(param: nn.Parameter, ranks: int) -> Shard:
    """Where FSDP splits an experts parameter over `ranks`: its first dimension (this rank's
    experts) when that divides evenly, else the dimension after it."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return Shard(0) if local.shape[0] % ranks == 0 else Shard(1)


def replicate_scalars(model: nn.Module, names: list[str]) -> None:
    """Keep 0-dim parameters whole and equal on every rank: fully_shard cannot shard them.

    Each is broadcast from rank 0 once (a meta-built model initialised them rank by rank)
    and its gradient is averaged over all ranks as soon as backward accumulates it. During
    accumulation that happens on every micro-batch: the sum of per-micro-batch averages is
    the average of the sums, so the result is the same, for a few bytes each time.
    """
    world = dist.get_world_size()
    for name in names:
        param = model.get_parameter(name)
        with torch.no_grad():
            dist.broadcast(param.data, src=0)

        def average(p: torch.Tensor) -> None:
            if p.grad is not None:
                dist.all_reduce(p.grad)  # SUM: gloo has no AVG
                p.grad.div_(world)

        param.register_post_accumulate_grad_hook(average)


def frozen_units(model: nn.Module, plan: WrapPlan) -> list[tuple[FSDPModule, bool]]:
    """The units holding frozen parameters of their own, each with its planned
    `reshard_after_forward` (a unit resharding to a smaller mesh, an int, is left out)."""
    out: list[tuple[FSDPModule, bool]] = []
    for unit in plan.units:
        module = model.get_submodule(unit.modules[0])
        if unit.frozen_params and isinstance(module, FSDPModule):
            if isinstance(unit.reshard_after_forward, bool):
                out.append((module, unit.reshard_after_forward))
    return out


def keep_gathered(units: list[tuple[FSDPModule, bool]], keep: bool) -> None:
    """`keep`: these units stay gathered after forward and after backward (gradient
    accumulation over a frozen base); otherwise back to their plan, and resharded now."""
    for module, planned in units:
        module.set_reshard_after_forward(planned if not keep else False, recurse=False)
        module.set_reshard_after_backward(not keep, recurse=False)
        if not keep:
            module.reshard()
