"""Apply a strategy: `wrap(model, config)` with DistributedDataParallel or FSDP2's fully_shard.

Owns: the order of operations when wrapping (checks → device → sync from rank 0 →
plan → shard → prefetch wiring), the refusal of already-wrapped models, and the record
of what was done (`wrap_info`).

Must not: hand-write collectives or sharding (torch does both), or read config files.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardwise.config.parallel import ParallelConfig
from shardwise.distributed.mesh import (
    CP_DIM,
    EP_DIM,
    TP_DIM,
    MeshSpec,
    dp_mesh,
    experts_dp_mesh,
    from_user_mesh,
    resolve_mesh,
)
from shardwise.distributed.process_group import DistInfo, env_world_size, get_dist_info, serves_cpu
from shardwise.distributed.worker_errors import refused
from shardwise.parallelize.autocast import apply_autocast, tf32_advice
from shardwise.parallelize.batch_stats import prepare as prepare_batch_statistics
from shardwise.parallelize.context import cutter_for, install
from shardwise.parallelize.ddp import apply_ddp, ddp_group
from shardwise.parallelize.experts import (
    apply_expert_parallel,
    check_expert_parallel,
    plan_without_experts,
)
from shardwise.parallelize.from_env import translation_from_env
from shardwise.parallelize.fsdp import apply_fsdp, replicate_scalars, shard_experts, unit_preparer
from shardwise.parallelize.global_batch import attach, groups_of
from shardwise.parallelize.materialize import has_meta
from shardwise.parallelize.materialize import materialize as materialize  # memory/fake.py swaps it
from shardwise.parallelize.pipeline import build_stage, start_schedule
from shardwise.parallelize.quantized import prepare_quantized
from shardwise.parallelize.recompute import apply_activation_checkpointing
from shardwise.parallelize.tensor import (
    apply_tensor_parallel,
    check_split_ties,
    check_tensor_parallel,
)
from shardwise.parallelize.ulysses import check_context_parallel, register_attention
from shardwise.parallelize.weights import load_weights
from shardwise.parallelize.wrapped import INFO_ATTR, WrapInfo, mark_before_sharding
from shardwise.plan.adapters import adapter_model
from shardwise.plan.planner import WrapPlan, plan_wrap
from shardwise.plan.quantized import check_quantized
from shardwise.plan.stages import plan_stages


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


class PerformanceNotice(UserWarning):
    """A setting that trains correctly but slower than it could (rank 0 only)."""


def materialize_device(config: ParallelConfig, info: DistInfo) -> torch.device:
    """Where a meta-built model's shards are allocated: the rank's device, or the CPU under
    CPU offload (FSDP2 refuses offloaded parameters materialised on the GPU: "FSDP
    parameters should be materialized on CPU when enabling CPU offloading")."""
    return torch.device("cpu") if config.offload_policy is not None else info.device


def _check_job(config: ParallelConfig, info: DistInfo) -> None:
    """What the config asks of the process group and the launcher, checked before any mesh
    or collective, identically on every rank."""
    if config.offload_policy is not None and not serves_cpu(info.backend):
        raise ValueError(
            f"ParallelConfig.cpu_offload on a process group whose backend is "
            f"{info.backend!r}, which refuses CPU tensors: offloaded parameters, gradients "
            "and optimizer state are reduced and broadcast on CPU. Use a group with a CPU "
            "backend: shardwise.init_distributed() makes one, or "
            "torch.distributed.init_process_group('cpu:gloo,cuda:nccl')."
        )
    hybrid = config.strategy in ("hybrid_shard", "hybrid_shard_zero2")
    if hybrid and config.dp_shard == -1 and config.device_mesh is None:
        if info.local_world_size is None:
            raise ValueError(
                f"ParallelConfig.strategy={config.strategy!r} with dp_shard=-1 shards within "
                "a node, but this job's launcher did not set LOCAL_WORLD_SIZE (Lightning's "
                "sets only LOCAL_RANK), so the ranks per node are unknown and a guess could "
                "put shard groups across nodes. Set ParallelConfig.dp_shard to the number of "
                "ranks per node (e.g. 8), or launch with torchrun / shardwise run."
            )


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
    planned blocks → shard (post-order, root last) → wire prefetch → make the
    data-parallel groups current in training forwards (for losses built from statistics
    of the whole batch: `global_batch_sum`, a mixture of experts' load balancing). At
    world size 1 the model comes back unwrapped, with its precision applied through
    autocast, unless `config.force_wrap`. Build the optimizer *after* this call, from the
    returned model's parameters.

    A model built on the meta device (`with shardwise.init_empty(): ...`) is sharded
    first and then materialised: each rank allocates only its shards and fills them from
    `weights` (safetensors from export_weights) or through the model's initialisers.
    Every rank reads its own slices of `weights`, unless `broadcast_from_rank0=True`: then
    only rank 0 reads the file and sends each rank its shards (see `load_weights`).

    With no `config`, a script started by `shardwise run --from FILE` takes its layout from
    that DeepSpeed, Accelerate or torchtitan file (`translation_from_env`); any other takes
    `ParallelConfig()`.
    """
    if config is None:  # the file `shardwise run --from` launched with, else the defaults
        launched = translation_from_env()
        config = launched.config.parallel if launched is not None else ParallelConfig()
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
    if config.pp > 1 and weights is not None:
        raise NotImplementedError(
            f"shardwise.wrap(weights=...) with ParallelConfig.pp={config.pp} is not built yet: "
            "a stage holds part of the model, and no test proves a file read into it. Load "
            "the weights into the whole model first (shardwise.load_weights(model, path)), "
            "then wrap it, or load a checkpoint after wrapping."
        )
    info = _check_process_group(config)
    on_meta = has_meta(model)
    sharded = info.world_size > 1 or config.force_wrap
    # A quantized base (QLoRA): what cannot train correctly is refused before any mesh.
    quantized = check_quantized(model, config, sharded=sharded, on_meta=on_meta)
    # Under CPU offload parameters stay on the CPU; sharded ones move unit by unit below.
    move = not on_meta and config.offload_policy is None

    def fill(target: nn.Module, mesh: DeviceMesh | None = None) -> None:
        if on_meta:
            materialize(
                target,
                materialize_device(config, info),
                mesh=mesh,
                weights=weights,
                param_init_fn=config.param_init_fn,
                seed=config.init_seed,
                broadcast_from_rank0=broadcast_from_rank0,
            )
        elif weights is not None:
            load_weights(target, weights, broadcast_from_rank0=broadcast_from_rank0)

    _check_placement(config._placement, info)
    advice = tf32_advice(info.device.type, config.precision, torch.get_float32_matmul_precision())
    if advice and info.rank == 0:
        warnings.warn(advice, PerformanceNotice, stacklevel=2)
    if info.world_size > 1 or config.force_wrap:
        _check_job(config, info)
    if info.world_size == 1 and not config.force_wrap:
        if config.pp > 1:
            raise refused(
                ValueError(
                    f"ParallelConfig.pp={config.pp} at world size 1: each pipeline stage needs "
                    f"ranks of its own. Launch at least {config.pp} processes (shardwise run "
                    f"--nproc {config.pp} ...), or use pp=1."
                )
            )
        if move:
            model.to(info.device)
        prepare_quantized(model, quantized)
        plan = plan_wrap(model, config, sharded=False)
        _prepare_blocks(model, plan, config)
        fill(model)
        apply_autocast(model, config.precision, info.device.type)
        setattr(model, INFO_ATTR, WrapInfo(config, info, None, plan))
        return model

    spec, user_mesh = _resolve_layout(config, info)
    if spec.engine == "ddp":  # one replica per rank: no mesh dimension to apply
        plan = plan_wrap(model, config, reshard_after_forward=spec.reshard_after_forward)
        _prepare_blocks(model, plan, config)
        if move:
            model.to(info.device)
        fill(model)  # DDP replicates: every rank holds the full model anyway
        prepare_quantized(model, quantized, sync=config.sync_module_states)
        wrapped = apply_ddp(model, config, info, plan, user_mesh)
        prepare_batch_statistics(wrapped, model, groups_of(None, ddp_group(wrapped)))
        setattr(wrapped, INFO_ATTR, WrapInfo(config, info, spec, plan))
        return wrapped
    _apply_dimensions(model, config, info, spec, user_mesh, on_meta, quantized, fill)
    return model


def _resolve_layout(config: ParallelConfig, info: DistInfo) -> tuple[MeshSpec, DeviceMesh | None]:
    """The degrees of every mesh dimension for this job (and the user's own mesh, if any)."""
    if config.device_mesh is not None:
        for name in ("pp", "ep"):
            if getattr(config, name) > 1:
                raise NotImplementedError(
                    f"ParallelConfig.{name}={getattr(config, name)} with a device_mesh of your "
                    "own is not built yet: shardwise lays out the (pp, dp_replicate, dp_shard, "
                    "tp) mesh and the experts' mesh itself. Leave device_mesh unset."
                )
        return from_user_mesh(
            config.strategy,
            config.dp_shard,
            config.device_mesh,
            info.device.type,
            config.reshard_after_forward,
        )
    spec = resolve_mesh(
        config.strategy,
        config.dp_shard,
        info.world_size,
        local_world_size=info.local_world_size,
        reshard_after_forward=config.reshard_after_forward,
        tp=config.tp_size,
        pp=config.pp,
        ep=config.ep,
        cp=config.cp,
    )
    return spec, None


def _apply_dimensions(
    model: nn.Module,
    config: ParallelConfig,
    info: DistInfo,
    spec: MeshSpec,
    user_mesh: DeviceMesh | None,
    on_meta: bool,
    quantized: Any,
    fill: Callable[[nn.Module, DeviceMesh | None], None],
) -> None:
    """The one order over the mesh's dimensions; each step applies when its degree is
    above 1 (torchtitan's parallelize functions read the same way):

    1. split into pipeline stages (pp): every later step sees only this rank's stage;
    2. tensor parallel (tp): torch's documented order is TP before FSDP, which shards the
       DTensors TP made; then the experts (ep) and context parallel (cp), whose hook cuts
       each call's sequences before FSDP's own hooks run;
    3. activation checkpointing, then compile, on the planned blocks: inside FSDP's
       hooks, so parameters are gathered before a recompute;
    4. fully_shard over the data-parallel dimensions, post-order, root last;
    5. materialise or load: after sharding, so each rank allocates and reads only its part;
    6. start the pipeline schedule: it drives the sharded stage.

    Splitting (stages, tp) cuts each rank's part from the whole model, so a model built
    on the CPU is moved whole to the device and takes rank 0's values first; otherwise each
    unit moves and syncs just before it is sharded, and no rank holds the whole model on
    its device. A meta-built model is split and sharded on meta and filled in step 5."""
    stage_plan = (
        plan_stages(model, spec.pp, config.pp_split, config.stages_per_rank)
        if spec.pp > 1
        else None
    )
    tp_plan = check_tensor_parallel(model, config) if spec.tp > 1 else None  # before any group
    experts = check_expert_parallel(model, spec.ep) if spec.ep > 1 else None
    if spec.cp > 1:
        check_context_parallel(model, spec.cp, spec.tp)
    if experts is not None and tp_plan is not None:
        tp_plan = plan_without_experts(tp_plan, spec.ep)
    _refuse_unbuilt(model, config, spec, on_meta, quantized)
    if stage_plan is not None and tp_plan is not None:
        check_split_ties(model, tp_plan, stage_plan.tied)
    mesh = user_mesh if user_mesh is not None else spec.build(info.device.type)
    assert mesh is not None  # only ddp builds none
    move = not on_meta and config.offload_policy is None
    sync = config.sync_module_states and not on_meta  # a meta model has no values yet
    whole_first = stage_plan is not None or tp_plan is not None or experts is not None
    # An optimizer built from the parameters sharding replaces would train nothing: refuse
    # it at its first step. Marked now, so no list of them keeps a full copy alive.
    if whole_first:
        mark_before_sharding(model, keep=set())
        if quantized:  # before the codes are synced: as bytes, their scales on the device
            prepare_quantized(model, quantized, device=info.device, sync=sync)
        if not on_meta:
            unit_preparer(info.device, config.sync_module_states)([model])
    state = None
    if stage_plan is not None:  # 1
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # every rank is in the mesh wrap built
        state = build_stage(model, stage_plan, coordinate[0])
    if tp_plan is not None:  # 2
        apply_tensor_parallel(model, mesh[TP_DIM], tp_plan)
    experts_mesh = None
    if experts is not None:  # 2b: this rank's stage's experts
        kept = {id(m) for m in model.modules()}
        experts = {name: m for name, m in experts.items() if id(m) in kept}
        experts_mesh = spec.build_experts(info.device.type)
        tp_mesh = mesh[TP_DIM] if spec.ep_borrows_tp else None
        apply_expert_parallel(experts, experts_mesh[EP_DIM], tp_mesh)
    if spec.cp > 1:  # 2c: whole sequences in, each rank's chunk through the model
        adapters = adapter_model(model)  # peft hands its call to the model it adapts
        called = adapters.base if adapters is not None else model
        transformers = register_attention(called)
        if state is not None:  # the stages are never called whole: the step cuts the batch
            state.cutter = cutter_for(mesh[CP_DIM].get_group(), transformers)
        else:
            install(called, mesh[CP_DIM].get_group(), transformers)
    rf = spec.reshard_after_forward
    plan = plan_wrap(model, config, reshard_after_forward=rf)
    _prepare_blocks(model, plan, config)  # 3
    if not whole_first:
        mark_before_sharding(model, keep={*plan.ignored_params, *plan.replicated_params})
        if quantized:
            # The quant_state goes where the layer computes, also under cpu_offload, whose
            # codes FSDP gathers to the device: bitsandbytes' dequantize reads both there.
            prepare_quantized(model, quantized, device=info.device, sync=sync)
    prepare = None if whole_first else unit_preparer(info.device if move else None, sync)
    data_parallel = dp_mesh(spec, mesh)
    # A rank that holds several stages runs each through its own module: each is an FSDP
    # root the schedule drives; the model, their union, shares their parameters.
    runs = [c.module for c in state.chunks] if state is not None else [model]
    if experts is not None:  # 4a: the experts over what ep leaves, before their blocks
        assert experts_mesh is not None
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        over = experts_dp_mesh(spec, experts_mesh)
        shard_experts(list(experts.values()), config, spec, over, backend)
    for root in runs:  # 4
        own = plan if root is model else plan_wrap(root, config, reshard_after_forward=rf)
        apply_fsdp(root, config, info, spec, own, data_parallel, prepare=prepare)
    fill(model, mesh)  # 5
    replicate_scalars(model, plan.replicated_params)
    if state is not None:  # 6
        start_schedule(
            model,
            state,
            mesh,
            info.device,
            schedule=config.pp_schedule,
            microbatches=config.pp_microbatches,
        )
    groups = groups_of(data_parallel)
    prepare_batch_statistics(runs[0], model, groups)
    for other in {id(m): m for m in (model, *runs)}.values():
        if other is not runs[0]:
            attach(other, groups)  # `global_batch_sum(model=...)` and each stage's forwards
    described = tp_plan.described if tp_plan is not None else None
    setattr(
        model,
        INFO_ATTR,
        WrapInfo(config, info, spec, plan, mesh, tp_plan=described, stages=stage_plan),
    )


def _refuse_unbuilt(
    model: nn.Module,
    config: ParallelConfig,
    spec: MeshSpec,
    on_meta: bool,
    quantized: Any,
) -> None:
    """Combinations not built yet, refused with the reason before any group is made."""
    if spec.tp > 1 and config.offload_policy is not None:
        raise NotImplementedError(
            f"ParallelConfig.tp={spec.tp} with cpu_offload is not built yet: tp cuts each "
            "rank's slice from the model on its device, so the whole model would sit on the "
            "GPU before anything is offloaded, and no GPU test covers the combination. Leave "
            "cpu_offload off (tp and sequence_parallel divide the memory instead), or use tp=1."
        )
    if spec.pp == 1:
        return
    unbuilt = {
        "cpu_offload": config.offload_policy is not None,
        "a model built on the meta device": on_meta,
        "a quantized base (QLoRA)": bool(quantized),
        "sequence_parallel": config.sequence_parallel,
        "loss_parallel": config.loss_parallel,
        # Each stage would see only its own layers' router logits: a silent wrong.
        "a mixture of experts' router auxiliary loss (output_router_logits)": bool(
            getattr(getattr(model, "config", None), "output_router_logits", False)
        ),
    }
    for what, present in unbuilt.items():
        if present:
            raise NotImplementedError(
                f"ParallelConfig.pp={spec.pp} with {what} is not built yet: the stage is cut "
                "from the whole model on each rank's device, and no test proves this "
                f"combination equal to one process. Use pp=1 with {what}, or leave it out."
            )
