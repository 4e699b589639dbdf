"""Apply a strategy: `wrap(model, config)` with DistributedDataParallel or FSDP2's fully_shard.

Owns: the order of operations when wrapping (checks → device → sync from rank 0 →
plan → shard → prefetch wiring), the refusal of already-wrapped models, and the record
of what was done (`wrap_info`).

Must not: hand-write collectives or sharding (torch does both), or read config files.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardwise.activation import apply_activation_checkpointing
from shardwise.config import ParallelConfig
from shardwise.distributed import (
    DistInfo,
    _register_shutdown_hook,
    env_world_size,
    get_dist_info,
)
from shardwise.materialize import has_meta, materialize
from shardwise.mesh import MeshSpec, from_user_mesh, resolve_mesh
from shardwise.optim import mark_replaced
from shardwise.precision import Precision, apply_autocast
from shardwise.wrap.plan import WrapPlan, plan_wrap

_INFO_ATTR = "_shardwise_wrap_info"
_live_ddp: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()
_BROADCAST_BUCKET_BYTES = 64 * 2**20


@dataclass(frozen=True)
class WrapInfo:
    """What `wrap` did to a model: the resolved mesh and plan (None when left unwrapped)."""

    config: ParallelConfig
    dist: DistInfo
    mesh_spec: MeshSpec | None
    plan: WrapPlan | None
    device_mesh: Any = None

    @property
    def wrapped(self) -> bool:
        return self.mesh_spec is not None

    def __str__(self) -> str:
        if self.mesh_spec is None:
            return f"unwrapped at world size {self.dist.world_size} ({self.config.precision})"
        if self.plan is None or self.mesh_spec.engine == "ddp":  # DDP has no shard units
            return str(self.mesh_spec)
        return f"{self.mesh_spec}\n{self.plan}"


def wrap_info(model: nn.Module) -> WrapInfo | None:
    """The `WrapInfo` `wrap` attached to `model`, or None if it did not wrap it."""
    return cast(WrapInfo | None, getattr(model, _INFO_ATTR, None))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 wraps in place, so it is the model)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _sharded_description(module: nn.Module) -> str | None:
    if isinstance(module, DistributedDataParallel):
        return "DistributedDataParallel"
    if isinstance(module, FSDPModule):
        return "fully_shard (FSDP2)"
    if isinstance(module, FullyShardedDataParallel):
        return "FullyShardedDataParallel (FSDP1)"
    if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
        return "DTensor parameters (already sharded)"
    return None


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model that is already wrapped or partly sharded, naming the submodule."""
    for fqn, module in model.named_modules():
        how = _sharded_description(module)
        if how is not None:
            where = f"submodule {fqn!r}" if fqn else f"the model ({type(model).__name__})"
            raise ValueError(
                f"shardwise.wrap: {where} is already wrapped by {how}. wrap() applies the "
                "strategy itself and cannot nest wrappers: pass the plain, unwrapped model "
                "(build it fresh, or use shardwise.unwrap(model) for a DDP-wrapped one)."
            )


def _check_process_group(config: ParallelConfig) -> DistInfo:
    world_env = env_world_size()
    if not dist.is_initialized():
        if world_env > 1:
            raise RuntimeError(
                f"shardwise.wrap: WORLD_SIZE={world_env} is set in the environment but no "
                "process group is initialised, so the ranks cannot talk to each other. Call "
                "shardwise.init_distributed() before shardwise.wrap()."
            )
        if config.force_wrap:
            raise RuntimeError(
                "shardwise.wrap: ParallelConfig.force_wrap=True needs a process group even "
                "at world size 1. Call shardwise.init_distributed() first (it makes a "
                "one-rank group when no launcher is present)."
            )
    return get_dist_info()


def sync_module_states(model: nn.Module, src: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with rank `src`'s, bucketed by dtype."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not t.is_meta]
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in by_dtype.values():
        size = _BROADCAST_BUCKET_BYTES  # forces a new bucket for each dtype/device
        for t in group:
            if size >= _BROADCAST_BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(t)
            size += t.numel() * t.element_size()
    with torch.no_grad():
        for bucket in buckets:
            flat = torch.cat([b.detach().reshape(-1) for b in bucket])
            dist.broadcast(flat, src=src)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


def _release_ddp_reducers() -> None:
    """Free DDP's Reducer while the default group is still referenced elsewhere.

    Otherwise the Reducer can hold the group's last reference, and its destructor (run
    with the GIL held) joins gloo threads that may be waiting for the GIL: a hang at
    exit (pytorch#56297). The DDP modules are unusable after shutdown anyway.
    """
    for ddp in list(_live_ddp):
        for attr in ("logger", "reducer"):
            if hasattr(ddp, attr):
                setattr(ddp, attr, None)
    _live_ddp.clear()


_register_shutdown_hook(_release_ddp_reducers)


def _prepare_blocks(model: nn.Module, plan: WrapPlan, config: ParallelConfig) -> None:
    """Activation checkpointing, then compilation, on the planned blocks: before DDP or
    sharding, so FSDP2's hooks stay outside the compiled region."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for unit in plan.units:
        if unit.activation_checkpointing:
            for fqn in unit.modules:
                apply_activation_checkpointing(modules[fqn])
    if config.compile:
        backend = "inductor" if config.compile is True else str(config.compile)
        for unit in plan.units:
            if unit.reason == "policy":
                for fqn in unit.modules:
                    modules[fqn].compile(backend=backend)  # in place: names are unchanged


def _check_placement(placement: dict[str, Any], info: DistInfo) -> None:
    """DDP's device_ids/output_device and FSDP1's device_id, accepted when they name this
    rank's own device: shardwise puts rank r on its LOCAL_RANK device itself."""
    mine = {None, info.local_rank, info.device.index, str(info.device), info.device}
    for word, value in placement.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if len(values) > 1 or any(v not in mine for v in values):
            raise ValueError(
                f"ParallelConfig: {word}={value!r} on rank {info.rank}, whose device is "
                f"{info.device} (LOCAL_RANK {info.local_rank}). shardwise places each rank on "
                "its own local device and cannot use another: remove it, or give "
                f"[{info.local_rank}]."
            )


def _apply_ddp(
    model: nn.Module, config: ParallelConfig, info: DistInfo, plan: WrapPlan, mesh: Any = None
) -> nn.Module:
    precision = config.precision
    apply_autocast(model, precision, info.device.type)
    if plan.ignored_params:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, plan.ignored_params
        )
    ddp = DistributedDataParallel(
        model,
        device_ids=[info.device.index] if info.device.type == "cuda" else None,
        process_group=None if mesh is None else mesh.get_group(),
        find_unused_parameters=bool(config.find_unused_parameters),
        bucket_cap_mb=config.bucket_cap_mb,
        broadcast_buffers=config.broadcast_buffers is not False,
        gradient_as_bucket_view=bool(config.gradient_as_bucket_view),
        static_graph=bool(config.static_graph),
        init_sync=config.sync_module_states,
    )
    reduce_dtype = precision.reduce_dtype
    if reduce_dtype in (torch.bfloat16, torch.float16):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = (
            default_hooks.bf16_compress_hook
            if reduce_dtype == torch.bfloat16
            else default_hooks.fp16_compress_hook
        )
        ddp.register_comm_hook(None, hook)
    _live_ddp.add(ddp)
    return ddp


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


def _apply_fsdp(
    model: nn.Module,
    config: ParallelConfig,
    info: DistInfo,
    spec: MeshSpec,
    plan: WrapPlan,
    mesh: Any = None,
) -> Any:
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


def _replicate(model: nn.Module, names: list[str]) -> None:
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


def wrap(
    model: nn.Module,
    config: ParallelConfig | None = None,
    *,
    weights: str | Path | None = None,
    broadcast_from_rank0: bool = False,
) -> nn.Module:
    """Parallelise `model` as `config` says and return the module to train.

    Order (each step needs the previous one): refuse already-wrapped models → move to
    this rank's device → make every rank hold rank 0's weights (before sharding, so each
    shard is cut from the same tensor) → plan units → activation checkpointing on the
    planned blocks → shard (post-order, root last) → wire prefetch. At world size 1 the
    model comes back unwrapped, with its precision applied through autocast, unless
    `config.force_wrap`. Build the optimizer *after* this call, from the returned
    model's parameters.

    A model built on the meta device (`with shardwise.init_empty(): ...`) is sharded
    first and then materialised: each rank allocates only its shards and fills them from
    `weights` (safetensors from export_weights) or through the model's initialisers.
    Every rank reads its own slices of `weights`, unless `broadcast_from_rank0=True`: then
    only rank 0 reads the file and sends each rank its shards (see `load_weights`).
    """
    config = config if config is not None else ParallelConfig()
    if not isinstance(config, ParallelConfig):
        raise TypeError(
            f"shardwise.wrap(config=...) expects a ParallelConfig, got {type(config).__name__}."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardwise.wrap expects an nn.Module, got {type(model).__name__}.")
    check_not_wrapped(model)
    if config.strategy == "auto" or config.activation_checkpointing == "auto":
        raise ValueError(
            f"shardwise.wrap: ParallelConfig(strategy={config.strategy!r}, "
            f"activation_checkpointing={config.activation_checkpointing!r}) is chosen by "
            "simulating the model at your micro-batch, which wrap does not know. Resolve it "
            "first: config = shardwise.choose_plan(make_model, config, world=..., batch=..., "
            "seq_len=...).config (or read the choice from `shardwise plan --world N "
            "--simulate parallel.strategy=auto`), then wrap with that config."
        )
    info = _check_process_group(config)
    on_meta = has_meta(model)
    if not on_meta and config.offload_policy is None:
        model.to(info.device)

    def fill(target: nn.Module, mesh: Any = None) -> None:
        if on_meta:
            materialize(
                target,
                info.device,
                mesh=mesh,
                weights=weights,
                param_init_fn=config.param_init_fn,
                seed=config.init_seed,
                broadcast_from_rank0=broadcast_from_rank0,
            )
        elif weights is not None:
            from shardwise.weights import load_weights

            load_weights(target, weights, broadcast_from_rank0=broadcast_from_rank0)

    _check_placement(config._placement, info)
    if info.world_size == 1 and not config.force_wrap:
        plan = plan_wrap(model, config, sharded=False)
        _prepare_blocks(model, plan, config)
        fill(model)
        apply_autocast(model, config.precision, info.device.type)
        setattr(model, _INFO_ATTR, WrapInfo(config, info, None, plan))
        return model

    user_mesh = None
    if config.device_mesh is not None:
        spec, user_mesh = from_user_mesh(
            config.strategy,
            config.dp_shard,
            config.device_mesh,
            info.device.type,
            config.reshard_after_forward,
        )
    else:
        spec = resolve_mesh(
            config.strategy,
            config.dp_shard,
            info.world_size,
            local_world_size=info.local_world_size,
            reshard_after_forward=config.reshard_after_forward,
        )
    plan = plan_wrap(model, config, reshard_after_forward=spec.reshard_after_forward)
    _prepare_blocks(model, plan, config)
    if spec.engine == "ddp":
        fill(model)  # DDP replicates: every rank holds the full model anyway
        wrapped = _apply_ddp(model, config, info, plan, user_mesh)
        setattr(wrapped, _INFO_ATTR, WrapInfo(config, info, spec, plan))
        return wrapped

    if config.sync_module_states and not on_meta:  # a meta model has no values to sync
        sync_module_states(model)
    originals = list(model.parameters())
    mesh = _apply_fsdp(model, config, info, spec, plan, user_mesh)
    fill(model, mesh)  # after sharding: each rank allocates and fills only its shards
    _replicate(model, plan.replicated_params)
    # An optimizer built from `originals` would train nothing: refuse it at its first step.
    mark_replaced(originals, model.parameters())
    setattr(model, _INFO_ATTR, WrapInfo(config, info, spec, plan, mesh))
    return model
