"""The training engine: train/val/test steps on a wrapped model.

Owns: the model contract (plain `forward(batch)` or OpenMMLab-style `data_preprocessor`
+ `forward(..., mode=)`), loss parsing, gradient accumulation that synchronises only on
the last micro-batch, clipping by the true global norm over every shard and replica,
fp16 loss scaling that agrees across ranks, and the optimizer/scheduler built after
wrapping.

Must not: loop over data, log or print (runner.py does), or hand-write collectives:
norms come from torch's DTensor reductions, syncing from DDP/FSDP2's own switches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from shardwise.config import ParallelConfig
from shardwise.losses import VIS_KEYS, model_parse_losses, parse_losses, split_outputs
from shardwise.optim import (
    OptimizerFactory,
    build_optimizer,
    build_scheduler,
    is_optim_wrapper,
    read_optim_wrapper,
)
from shardwise.strategies import unwrap, wrap, wrap_info

__all__ = [
    "VIS_KEYS",
    "Engine",
    "NonFiniteError",
    "TrainConfig",
    "clip_grad_norm_",
    "parse_losses",
    "total_grad_norm",
]

MODES = ("loss", "predict", "tensor")

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass(kw_only=True)
class TrainConfig:
    """How `Engine.train_step` turns micro-batches into optimizer steps."""

    accumulate_steps: int = 1
    """Micro-batches per optimizer step; gradients synchronise on the last one only."""
    sync_each_microbatch: bool = False
    """Reduce gradients after every micro-batch: more communication, less memory (FSDP
    keeps sharded instead of full gradients between micro-batches)."""
    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm (over all shards and replicas)."""
    grad_scaler: bool | None = None
    """Dynamic loss scaling; None turns it on for fp16 compute."""
    init_scale: float = 2.0**16
    """Initial loss scale when scaling is on."""
    detect_anomalous_params: bool = False
    """Debug: list trainable parameters that received no gradient in a step."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss (keys containing 'loss') or gradient norm on any rank: 'stop' raises
    NonFiniteError on every rank; 'skip' drops that update on every rank (parameters and
    optimizer state unchanged, counted in skipped_steps) and warns. Under fp16 loss
    scaling, a step with inf/nan gradients stays the grad scaler's to skip (and back off);
    a non-finite loss with finite gradients is still caught."""

    def __post_init__(self) -> None:
        k = self.accumulate_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"TrainConfig.accumulate_steps={k!r} must be an int >= 1 (micro-batches per "
                "optimizer step; 1 means no accumulation)."
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"TrainConfig.max_grad_norm={self.max_grad_norm!r} must be > 0, or None to "
                "not clip."
            )
        if not self.init_scale > 0:
            raise ValueError(f"TrainConfig.init_scale={self.init_scale!r} must be > 0.")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(
                f"TrainConfig.on_nonfinite={self.on_nonfinite!r} is not allowed. Choose 'stop' "
                "(raise on every rank) or 'skip' (drop that update on every rank)."
            )


class NonFiniteError(FloatingPointError):
    """A loss or the gradient norm was NaN/inf (TrainConfig.on_nonfinite='stop'); raised on
    every rank at the same step."""


def total_grad_norm(parameters: list[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients over every shard and replica (a plain tensor).

    Sharded gradients are DTensors, whose norm torch reduces across their mesh (both
    dimensions under HSDP); unmanaged (ignored) gradients count with their local norm.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    local = [g for g in grads if not isinstance(g, DTensor)]
    squares = []
    for group in (sharded, local):
        if group:
            norm = torch.nn.utils.get_total_norm(group, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    return torch.stack([s.cpu() for s in squares]).sum().sqrt()


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global norm (`total_grad_norm`) is at most `max_norm`, by
    torch's `clip_grad_norm_` rule; returns the norm before clipping. A non-finite norm
    clips nothing (fp16 scaling skips that step anyway). `max_norm=None` only measures."""
    norm = total_grad_norm(parameters)
    _clip_to(parameters, norm, max_norm)
    return norm


def _clip_to(parameters: list[nn.Parameter], norm: torch.Tensor, max_norm: float | None) -> None:
    if max_norm is not None and math.isfinite(float(norm)):
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        if coef < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coef)


class Engine:
    """One object that steps a wrapped model: `train_step`, `val_step`, `test_step`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | Any,
        config: ParallelConfig | None = None,
        scheduler: Any = None,
        *,
        train: TrainConfig | None = None,
    ) -> None:
        self.train_config = train or TrainConfig()
        info = wrap_info(model)
        if info is not None:
            if config is not None and config != info.config:
                differ = [
                    f"{f.name}={getattr(config, f.name)!r} (wrapped with "
                    f"{getattr(info.config, f.name)!r})"
                    for f in dataclasses.fields(config)
                    if getattr(config, f.name) != getattr(info.config, f.name)
                ]
                raise ValueError(
                    "Engine(model, config=...): the model was already wrapped by "
                    f"shardwise.wrap with another ParallelConfig: {', '.join(differ)}. A "
                    "wrapped model cannot be re-wrapped. Pass config=None (the wrap's config "
                    "is used), or pass the unwrapped model and let the Engine wrap it."
                )
            self.config = info.config
            self.model = model
        elif _already_parallel(model):
            self.config = config or ParallelConfig()
            self.model = model
        else:
            self.config = config or ParallelConfig()
            self.model = wrap(model, self.config)
        self.device = _model_device(self.model)
        if is_optim_wrapper(optimizer):
            optimizer = self._adopt_optim_wrapper(optimizer)
        self.optimizer = build_optimizer(optimizer, self.model)
        self.scheduler = build_scheduler(scheduler, self.optimizer)
        self.scaler = self._build_scaler()
        self.micro_step = 0
        self.step = 0
        self.skipped_steps = 0
        self.last_outputs: Any = None
        self._stop_requested = False
        self._nonfinite_ranks = 0
        self._window: list[dict[str, torch.Tensor]] = []

    # --- set-up ---------------------------------------------------------------------

    def _adopt_optim_wrapper(self, wrapper: Any) -> torch.optim.Optimizer:
        """Take an mmengine OptimWrapper's optimizer, accumulation and clipping; the Engine
        then steps them itself (see `optim.read_optim_wrapper`)."""
        name = type(wrapper).__name__
        settings = read_optim_wrapper(wrapper, self.device.type)
        tc = self.train_config
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
        self.train_config = tc
        ours_dtype = self.config.precision.param_dtype or torch.float32
        if settings.amp_dtype is not None and settings.amp_dtype != ours_dtype:
            raise ValueError(
                f"Engine: {name} computes in {settings.amp_dtype} but ParallelConfig."
                f"mixed_precision={self.config.mixed_precision!r} computes in {ours_dtype}. "
                "Under shardwise the model's compute dtype comes from ParallelConfig (FSDP2's "
                "policy, or autocast for ddp and one process), not from the wrapper's autocast: "
                f"set ParallelConfig.mixed_precision='{_short(settings.amp_dtype)}'."
            )
        return settings.optimizer

    def _build_scaler(self) -> ShardedGradScaler | None:
        use = self.train_config.grad_scaler
        if use is None:
            use = self.config.precision.param_dtype == torch.float16
        if not use:
            return None
        # ShardedGradScaler all-reduces "found inf" so every rank skips the same steps.
        return ShardedGradScaler(self.device.type, init_scale=self.train_config.init_scale)

    # --- forward ----------------------------------------------------------------------

    def forward(self, batch: Any, mode: str = "loss") -> Any:
        """Run the model on `batch` under the model contract, in `mode`."""
        if mode not in MODES:
            raise ValueError(
                f"Engine.forward(mode={mode!r}) is not a known mode. Use one of {list(MODES)}."
            )
        batch = _to_device(batch, self.device)
        inner = unwrap(self.model)
        preprocessor = getattr(inner, "data_preprocessor", None)
        if callable(preprocessor):  # OpenMMLab-style contract
            data = preprocessor(batch, mode == "loss")
            if isinstance(data, Mapping):
                return self.model(**data, mode=mode)
            if isinstance(data, (list, tuple)):
                return self.model(*data, mode=mode)
            return self.model(data, mode=mode)
        if isinstance(batch, Mapping):
            return self.model(**batch)
        if isinstance(batch, (list, tuple)):
            return self.model(*batch)
        return self.model(batch)

    @contextlib.contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        model = self.model
        if isinstance(model, DistributedDataParallel):
            with contextlib.nullcontext() if sync else model.no_sync():
                yield
        elif isinstance(model, FSDPModule):
            # Without sync FSDP2 keeps unsharded gradients locally until the last micro-batch.
            model.set_requires_gradient_sync(sync)
            yield
        else:
            yield

    # --- steps ------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask every rank to stop after the current optimizer step (safe in a signal handler).

        The request rides on the all-reduce each update already makes, so ranks asked at
        different moments still agree: the update that first sees any rank's request
        returns `stop=1.0` on every rank."""
        self._stop_requested = True

    def train_step(self, batch: Any, *, force_update: bool = False) -> dict[str, Any]:
        """Forward + backward one micro-batch; update on the last of the window.

        Returns the micro-batch's loss values. On the micro-batch that updates (or with
        `force_update`, e.g. at the end of an epoch), returns instead the window's mean
        values averaged across ranks, plus `grad_norm`, `lr`, `loss_scale`, `skipped`
        (1.0 when the update was dropped: fp16 scaling found inf/nan gradients, or
        `on_nonfinite='skip'` found a non-finite loss or norm) and `stop` (1.0 when any
        rank called `request_stop`). A non-finite loss or norm with `on_nonfinite='stop'`
        raises `NonFiniteError` on every rank.
        A model returning `(losses, preds[, masks])` gets them back, untouched, under
        `vis_preds`/`vis_masks`. A model with its own `parse_losses` has it called.
        """
        tc = self.train_config
        update = force_update or self.micro_step + 1 >= tc.accumulate_steps
        if not self.model.training:  # train() walks every module: not on each micro-step
            self.model.train()
        with self._gradient_sync(update or tc.sync_each_microbatch):
            outputs = self.forward(batch, "loss")
            losses, passed = split_outputs(outputs)
            loss, logs = model_parse_losses(unwrap(self.model), losses)
            scaled = loss / tc.accumulate_steps
            (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        self.last_outputs = outputs
        self._window.append(logs)
        self.micro_step += 1
        result: dict[str, Any]
        if not update:
            result = {k: float(v) for k, v in logs.items()}
        else:
            result = self._update()
        result.update(passed)  # predictions for visualisation: as returned, never averaged
        return result

    def _reduce_window(
        self, norm: torch.Tensor
    ) -> tuple[dict[str, float], list[str], list[str], bool]:
        """(window means averaged over ranks, the keys, this rank's non-finite keys, whether
        any rank asked to stop), with the one all-reduce each update makes: it also carries
        each rank's non-finite and stop flags, so the guard and preemption cost nothing."""
        keys = sorted(self._window[0])
        means = torch.stack(
            [torch.stack([w[k].float().cpu() for w in self._window]).mean() for k in keys]
        )
        self._window = []
        bad = [k for k, v in zip(keys, means, strict=True) if "loss" in k and not v.isfinite()]
        if not math.isfinite(float(norm)):
            # With fp16 scaling, inf/nan gradients (from an overflow, or from an inf loss)
            # are the grad scaler's to skip, as in any AMP loop; without it they are ours.
            bad = [] if self.scaler is not None else [*bad, "grad_norm"]
        asked = self._stop_requested
        flags = torch.tensor([float(bool(bad)), float(asked)])
        values = torch.cat([means, flags])
        if dist.is_initialized() and dist.get_world_size() > 1:
            values = values.to(self.device)
            dist.all_reduce(values)  # SUM (gloo has no AVG)
            values = values.cpu()
            values[: len(keys)] /= dist.get_world_size()
        self._nonfinite_ranks = int(values[-2])
        stop = bool(values[-1] > 0)
        if asked:  # sent: a request that arrives from here on rides on the next update
            self._stop_requested = False
        return {k: float(v) for k, v in zip(keys, values, strict=False)}, keys, bad, stop

    def _nonfinite_report(self, bad: list[str], keys: list[str]) -> str:
        """'rank 1: loss, loss_cls; rank 3: grad_norm' (a collective: every rank calls it,
        and only after the reduce said some rank was non-finite). Each rank sends one
        flag per name of `keys` (the window's keys, the same list on every rank)."""
        names = ["grad_norm", *keys]
        mine = torch.tensor([float(n in bad) for n in names], device=self.device)
        rows = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
        found = []
        for rank, row in enumerate(rows):
            named = [n for n, flag in zip(names, row.tolist(), strict=True) if flag]
            if named:
                found.append(f"rank {rank}: {', '.join(named)}")
        return "; ".join(found)

    def _update(self) -> dict[str, Any]:
        tc = self.train_config
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*scalar.*")
                self.scaler.unscale_(self.optimizer)
        anomalous = self._anomalous_params() if tc.detect_anomalous_params else []
        norm = total_grad_norm(params)
        result, keys, bad, stop = self._reduce_window(norm)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the lr this update uses
        self.micro_step = 0
        if self._nonfinite_ranks:
            self._drop_update(self._nonfinite_report(bad, keys))
            result.update(grad_norm=float(norm), lr=lr, skipped=1.0, stop=float(stop))
            return result
        _clip_to(params, norm, tc.max_grad_norm)
        skipped = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*scalar.*")
                self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.skipped_steps += 1
        else:
            self.step += 1
            if self.scheduler is not None:
                self.scheduler.step()
        result.update(grad_norm=float(norm), lr=lr, skipped=float(skipped), stop=float(stop))
        if self.scaler is not None:
            result["loss_scale"] = float(self.scaler.get_scale())
        if tc.detect_anomalous_params:
            result["anomalous_params"] = float(len(anomalous))
        return result

    def _drop_update(self, where: str) -> None:
        """The update found a non-finite loss or norm on some rank: stop or skip, everywhere."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update(self.scaler.get_scale())  # forget this step's inf checks
        step = self.step + self.skipped_steps + 1
        what = (
            f"Engine: non-finite loss or gradient norm at optimizer step {step} on "
            f"{self._nonfinite_ranks} rank(s) ({where})."
        )
        if self.train_config.on_nonfinite == "stop":
            raise NonFiniteError(
                f"{what} Training stopped on every rank (TrainConfig.on_nonfinite='stop'). "
                "Lower the learning rate, clip gradients (TrainConfig.max_grad_norm), check "
                "the data of that step, or set on_nonfinite='skip' to drop such updates."
            )
        self.skipped_steps += 1
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn(
                f"{what} The update was skipped on every rank (TrainConfig.on_nonfinite="
                "'skip'); parameters and optimizer state are unchanged.",
                stacklevel=4,
            )

    def _anomalous_params(self) -> list[str]:
        missing = [
            name
            for name, p in unwrap(self.model).named_parameters()
            if p.requires_grad and p.grad is None
        ]
        if missing and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(
                f"Engine: {len(missing)} trainable parameter(s) received no gradient this "
                f"step: {missing[:20]}{' ...' if len(missing) > 20 else ''}. They are unused "
                "in forward or detached from the loss.",
                stacklevel=4,
            )
        return missing

    def val_step(self, batch: Any) -> Any:
        """Predict on `batch` without gradients, in eval mode."""
        return self._predict(batch)

    def test_step(self, batch: Any) -> Any:
        """Predict on `batch` without gradients, in eval mode."""
        return self._predict(batch)

    def _predict(self, batch: Any) -> Any:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.forward(batch, "predict")
        finally:
            self.model.train(was_training)


# --- helpers -------------------------------------------------------------------------------


def _already_parallel(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) or any(
        isinstance(m, FSDPModule) for m in model.modules()
    )


def _model_device(model: nn.Module) -> torch.device:
    info = wrap_info(model)
    if info is not None:
        return info.dist.device
    for p in model.parameters():
        return p.device if not isinstance(p, DTensor) else p.to_local().device
    return torch.device("cpu")


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
