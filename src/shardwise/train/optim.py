"""Optimizers meeting wrapped models: built after wrapping, or stopped loudly.

Owns: building the optimizer and scheduler the Engine steps (from factories, given the
trainable parameters, or objects, with any frozen parameter taken out), the check that an
optimizer holds the wrapped model's own parameters, the process-wide
optimizer step hook that refuses an optimizer built before `shardwise.wrap` replaced its
parameters, and the translation of mmengine's `OptimWrapper`/`AmpOptimWrapper` (read by
duck typing: this module never imports mmengine).

Must not: step optimizers itself (engine.py does), or import a host library.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard, cast

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from shardwise.config.parallel import ParallelConfig
from shardwise.config.training import TrainConfig
from shardwise.parallelize.stages import pipeline_state
from shardwise.parallelize.wrapped import unwrap
from shardwise.train.muon import muon_context

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class OptimWrapperLike(Protocol):
    """mmengine's OptimWrapper/AmpOptimWrapper as the Engine reads it, typed by shape: this
    module never imports mmengine. The Engine takes its optimizer and settings and steps
    them itself; the two methods only identify it (whatever arguments mmengine gives them)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    def update_params(self, *args: Any, **kwargs: Any) -> object: ...
    def optim_context(self, *args: Any, **kwargs: Any) -> object: ...


class SchedulerLike(Protocol):
    """An LR scheduler as the Engine steps and checkpoints it: torch's LRScheduler, or
    mmengine's ParamScheduler (typed by shape). It repeats torch's `Stateful` rather than
    subclass it: a subclass with a property would break DCP's isinstance(x, Stateful)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    def step(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


SchedulerFactory = Callable[[torch.optim.Optimizer], SchedulerLike | None]


def is_optim_wrapper(value: object) -> TypeGuard[OptimWrapperLike]:
    """mmengine's OptimWrapper (or anything with its interface)."""
    return all(hasattr(value, a) for a in ("update_params", "optim_context", "optimizer"))


def build_optimizer(optimizer: object, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer to step: a torch optimizer holding `model`'s parameters, or one built
    by a factory (`OptimizerFactory`) from them; an OptimWrapper is translated by the
    Engine first. `optimizer` may be anything: what is neither is a TypeError saying so."""

    model_params = list(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"Engine(optimizer=...) got {type(optimizer).__name__}; expected a "
                "torch.optim.Optimizer, a factory such as lambda params: AdamW(params, "
                "lr=3e-4), or mmengine's OptimWrapper."
            )
        trainable = [p for p in model_params if p.requires_grad]
        if not trainable and pipeline_state(unwrap(model)) is not None:
            # A pipeline stage that trains nothing (adapters on the other stage's layers):
            # torch refuses an empty parameter list, but takes one empty group, and the
            # stage still joins the update's norm and steps.
            built = optimizer([{"params": []}])
        else:
            with muon_context(model):  # shardwise.Muon reads the names and ddp's group
                built = optimizer(trainable)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"Engine: the optimizer factory returned {type(built).__name__}, not a "
                "torch.optim.Optimizer."
            )
        check_hyperparameters(built)
        refuse_torch_muon(built)
        return built
    ids = {id(p) for p in model_params}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    foreign = [p for p in held if id(p) not in ids]
    if foreign:
        raise ValueError(
            f"Engine: the optimizer holds {len(foreign)} of {len(held)} parameter(s) that are "
            "not the wrapped model's: it was built before wrapping, and sharding replaced the "
            "parameters, so it would update tensors the model no longer uses. Pass a factory "
            "instead, Engine(model, lambda params: torch.optim.AdamW(params, lr=...)), or "
            "build the optimizer from the wrapped model's parameters after shardwise.wrap()."
        )
    _drop_frozen(optimizer)
    held_ids = {id(p) for p in held}
    missing = [
        n for n, p in unwrap(model).named_parameters() if p.requires_grad and id(p) not in held_ids
    ]
    if missing:
        warnings.warn(
            f"Engine: {len(missing)} trainable parameter(s) are not in the optimizer and will "
            f"not be updated: {missing[:10]}",
            stacklevel=3,
        )
    check_hyperparameters(optimizer)
    refuse_torch_muon(optimizer)
    return optimizer


def refuse_torch_muon(optimizer: torch.optim.Optimizer) -> None:
    """torch.optim.Muon over sharded (DTensor) parameters runs: DTensor assembles every
    matmul of Newton–Schulz (1.6x FSDP's traffic) and every rank repeats every iteration.
    Refused, naming shardwise.Muon, which takes the same hyperparameters."""
    if type(optimizer) is not torch.optim.Muon:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(isinstance(p, DTensor) for p in params):
        g = optimizer.defaults
        raise ValueError(
            "Engine: torch.optim.Muon over sharded (DTensor) parameters repeats Newton–Schulz "
            "on every rank at 1.6x FSDP's traffic; use optimizer=lambda p: shardwise.Muon(p, "
            f"lr={g['lr']}, weight_decay={g['weight_decay']}, momentum={g['momentum']}, "
            f"nesterov={g['nesterov']}, ns_steps={g['ns_steps']}), which orthogonalises each "
            "whole matrix once."
        )


def _drop_frozen(optimizer: torch.optim.Optimizer) -> None:
    """Take the frozen parameters (requires_grad=False) out of the optimizer, in place.

    `AdamW(model.parameters())` and mmengine's default optimizer constructor put an
    adapter model's frozen base in the optimizer. torch steps only parameters holding a
    gradient, which a frozen one never gets in the Engine; but one left on it (a backward
    before freezing) would be stepped and clipped, and it would take a place in every
    checkpoint's optimizer state. The groups stay (empty if need be), so their per-group
    settings and a scheduler built on them keep their places."""
    frozen = [p for g in optimizer.param_groups for p in g["params"] if not p.requires_grad]
    if not frozen:
        return
    ids = {id(p) for p in frozen}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in ids]
    for p in frozen:
        optimizer.state.pop(p, None)


def check_hyperparameters(optimizer: torch.optim.Optimizer) -> None:
    """Refuse what trains into NaN or backwards without an error from torch: an lr that is
    not a finite number >= 0 (torch accepts inf), and Adam betas outside [0, 1)."""
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if lr is not None and not (math.isfinite(float(lr)) and float(lr) >= 0):
            raise ValueError(
                f"Engine: {name} param_groups[{i}]['lr']={float(lr)!r} must be a finite "
                "number >= 0. Use a learning rate such as 3e-4."
            )
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)):
            for j, beta in enumerate(betas):
                if not 0.0 <= float(beta) < 1.0:
                    raise ValueError(
                        f"Engine: {name} param_groups[{i}]['betas'][{j}]={float(beta)!r} must "
                        "be in [0, 1) (a moment decay rate). Use e.g. betas=(0.9, 0.95)."
                    )


def build_scheduler(
    scheduler: SchedulerLike | SchedulerFactory | None, optimizer: torch.optim.Optimizer
) -> SchedulerLike | None:
    """The scheduler to step: `scheduler` if it was built for `optimizer`, or what a factory
    builds from it; None for none."""
    if scheduler is None:
        return None
    if hasattr(scheduler, "step") and hasattr(scheduler, "optimizer"):
        if scheduler.optimizer is not optimizer:
            raise ValueError(
                "Engine: the scheduler was built for a different optimizer than the engine's. "
                "Pass a factory instead: scheduler=lambda opt: torch.optim.lr_scheduler."
                "CosineAnnealingLR(opt, T_max=...)."
            )
        return cast(SchedulerLike, scheduler)
    if callable(scheduler):
        return scheduler(optimizer)
    raise TypeError(
        f"Engine(scheduler=...) got {type(scheduler).__name__}; expected an LR scheduler or a "
        "factory taking the optimizer."
    )


@dataclasses.dataclass(frozen=True)
class WrapperSettings:
    """What an mmengine OptimWrapper asks for, in shardwise's words."""

    optimizer: torch.optim.Optimizer
    accumulate_steps: int
    max_grad_norm: float | None
    amp_dtype: torch.dtype | None
    """The dtype an AmpOptimWrapper computes in (None: a plain OptimWrapper)."""
    loss_scaler: torch.amp.GradScaler | None = None
    """An AmpOptimWrapper's GradScaler (None: a plain OptimWrapper)."""
    static_scale: float | None = None
    """AmpOptimWrapper(loss_scale=<float>): the scale it restores after every step."""


def read_optim_wrapper(wrapper: OptimWrapperLike, device_type: str) -> WrapperSettings:
    """Translate mmengine's OptimWrapper/AmpOptimWrapper, or refuse what cannot carry over.

    The Engine steps the wrapper's optimizer itself: its own global-norm clipping (over
    every shard and replica, unmanaged parameters included), its own gradient-sync switch
    for accumulation, and its own loss scaler. The wrapper's
    `update_params` is therefore not called.
    """
    name = type(wrapper).__name__
    optimizer = wrapper.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"Engine: {name}.optimizer is {type(optimizer).__name__}, not a torch optimizer."
        )
    counts = int(getattr(wrapper, "_accumulative_counts", 1))
    max_norm = None
    clip = getattr(wrapper, "clip_grad_kwargs", None)
    if clip:
        clip_func = getattr(getattr(wrapper, "clip_func", None), "__name__", "clip_grad_norm_")
        norm_type = float(clip.get("norm_type", 2.0))
        extra = sorted(set(clip) - {"max_norm", "norm_type"})
        if clip_func != "clip_grad_norm_" or norm_type != 2.0 or extra or "max_norm" not in clip:
            raise ValueError(
                f"Engine: {name}(clip_grad={dict(clip)!r}) with {clip_func} is not supported: "
                "shardwise clips by the global L2 norm over every shard and replica only. Use "
                "clip_grad=dict(max_norm=...) (norm_type 2), or remove clip_grad."
            )
        max_norm = float(clip["max_norm"])
    amp_dtype, scaler, static = None, None, None
    if hasattr(wrapper, "loss_scaler") and hasattr(wrapper, "cast_dtype"):  # AmpOptimWrapper
        amp_dtype = wrapper.cast_dtype or (
            torch.float16 if device_type == "cuda" else torch.bfloat16  # autocast's default
        )
        scaler, static = wrapper.loss_scaler, getattr(wrapper, "_scale_update_param", None)
    return WrapperSettings(optimizer, counts, max_norm, amp_dtype, scaler, static)


def sharded_scaler_like(scaler: torch.amp.GradScaler) -> ShardedGradScaler:
    """A ShardedGradScaler with `scaler`'s settings and state (a torch GradScaler, as
    mmengine's AmpOptimWrapper makes). Under sharding a plain GradScaler sees inf/nan only
    in its own rank's shards, so ranks would skip different steps and their loss scales
    drift apart; the sharded one agrees on every rank."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler
    device = getattr(scaler, "_device", "cuda")
    if not scaler.is_enabled():  # torch disables it where its device is missing
        return ShardedGradScaler(device, enabled=False)
    new = ShardedGradScaler(
        device,
        init_scale=scaler.get_scale(),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
    )
    new.load_state_dict(scaler.state_dict())
    return new


def from_optim_wrapper(
    wrapper: OptimWrapperLike, train: TrainConfig, config: ParallelConfig, device_type: str
) -> tuple[torch.optim.Optimizer, TrainConfig, ShardedGradScaler | None]:
    """Take an mmengine OptimWrapper's optimizer, accumulation, clipping and loss scaler
    (the Engine then steps them itself, see `read_optim_wrapper`): (its optimizer, `train`
    with the wrapper's settings, the scaler as a ShardedGradScaler or None). A setting
    given in both places must agree."""
    name = type(wrapper).__name__
    settings = read_optim_wrapper(wrapper, device_type)
    tc = train
    theirs_by_field: tuple[tuple[str, Any, Any], ...] = (
        ("accumulate_steps", settings.accumulate_steps, 1),
        ("max_grad_norm", settings.max_grad_norm, None),
    )
    for field_name, theirs, default in theirs_by_field:
        ours = getattr(tc, field_name)
        if theirs != default and ours not in (default, theirs):
            raise ValueError(
                f"Engine: {name} asks for {field_name}={theirs} but TrainConfig."
                f"{field_name}={ours}. Set it in one place."
            )
        if theirs != default:
            tc = dataclasses.replace(tc, **{field_name: theirs})
    ours_dtype = config.precision.param_dtype or torch.float32
    if settings.amp_dtype is not None and settings.amp_dtype != ours_dtype:
        raise ValueError(
            f"Engine: {name} computes in {settings.amp_dtype} but ParallelConfig."
            f"mixed_precision={config.mixed_precision!r} computes in {ours_dtype}. "
            "Under shardwise the model's compute dtype comes from ParallelConfig (FSDP2's "
            "policy, or autocast for ddp and one process), not from the wrapper's autocast: "
            f"set ParallelConfig.mixed_precision='{_short(settings.amp_dtype)}'."
        )
    if settings.static_scale is not None:
        raise ValueError(
            f"Engine: {name}(loss_scale={settings.static_scale}) is a static loss scale, which "
            "the Engine does not keep (it scales dynamically, every rank agreeing on skipped "
            "steps). Use loss_scale='dynamic' (or a dict of GradScaler settings), or train "
            "through mmengine's Runner with ShardwiseDataParallel, which keeps it."
        )
    scaler = settings.loss_scaler
    if scaler is None or not scaler.is_enabled():
        return settings.optimizer, tc, None
    return settings.optimizer, tc, sharded_scaler_like(scaler)


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
