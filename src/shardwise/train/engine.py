"""The training engine: train/val/test steps on a wrapped model.

Owns: the model contract (plain `forward(batch)` or OpenMMLab-style `data_preprocessor`
+ `forward(..., mode=)`), loss parsing, gradient accumulation that synchronises only on
the last micro-batch, clipping by the true global norm over every shard and replica,
fp16 loss scaling that agrees across ranks, the optimizer/scheduler built after
wrapping, and the run file's adapter section (`adapter=`), applied before wrapping.
Clipping and the step see only parameters that train: a frozen one holds no gradient here.

Must not: loop over data, log or print (runner.py does), or hand-write collectives:
norms come from torch's DTensor reductions, syncing from DDP/FSDP2's own switches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from shardwise.config.adapters import AdapterConfig, apply_adapter
from shardwise.config.parallel import ParallelConfig
from shardwise.config.training import TrainConfig
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.from_env import engine_values_from_env
from shardwise.parallelize.fsdp import frozen_units, keep_gathered
from shardwise.parallelize.pipeline import (
    pipeline_eval,
    pipeline_state,
    pipeline_step,
    stage_grad_norm_squared,
)
from shardwise.parallelize.tensor import check_tp_gradients
from shardwise.parallelize.wrapped import unwrap, wrap_info
from shardwise.train.losses import VIS_KEYS, model_parse_losses, parse_losses, split_outputs
from shardwise.train.nonfinite import (
    NonFiniteError,
    anomalous_params,
    nonfinite_report,
    stop_or_warn,
)
from shardwise.train.optim import (
    OptimizerFactory,
    OptimWrapperLike,
    SchedulerFactory,
    SchedulerLike,
    build_optimizer,
    build_scheduler,
    from_optim_wrapper,
    is_optim_wrapper,
)
from shardwise.train.reduce import nonfinite_keys, reduce_window

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


def total_grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients over every shard and replica: a 0-dim fp32 tensor on the
    gradients' device, computed without waiting for it on the host.

    Sharded gradients are DTensors, whose norm torch reduces across their mesh (both
    dimensions under HSDP). Gradients on different meshes (under tensor parallelism: norms
    on the data-parallel mesh, linears on the 2-D one) are summed per mesh, since torch's
    own norm stacks them and fails ("must have the same mesh"); unmanaged (ignored)
    gradients count with their local norm.
    """
    groups: dict[int, list[torch.Tensor]] = {}  # by mesh (the grads keep each mesh alive)
    for p in parameters:
        g = p.grad
        if g is not None:
            groups.setdefault(id(g.device_mesh) if isinstance(g, DTensor) else 0, []).append(g)
    squares = []
    with _quiet_redistribute():
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm(group, foreach=True)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    device = squares[0].device
    return torch.stack([s.to(device) for s in squares]).sum().sqrt()


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """On a 2-D mesh (FSDP x tp) DTensor logs, per rank and per step, that reducing a norm
    takes one all-reduce per mesh dimension: two scalars here, not worth the noise."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ rule on the device: min(1, max_norm / (norm + 1e-6)), and 1
    (clip nothing) for a non-finite norm (fp16 scaling skips that step anyway)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))


def scale_grads_(parameters: Iterable[nn.Parameter], coef: torch.Tensor) -> None:
    """Multiply every gradient by `coef` in place: one foreach kernel per device and dtype
    over the local shards (a DTensor `mul_` per parameter costs a dispatch each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, coef.to(device))


def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Scale gradients so their global norm (`total_grad_norm`) is at most `max_norm`, by
    torch's `clip_grad_norm_` rule; returns the norm before clipping (a device tensor). A
    non-finite norm clips nothing. `max_norm=None` only measures. No host sync.

    Unlike `torch.nn.utils.clip_grad_norm_`, gradients may be sharded over different meshes
    (FSDP, HSDP, tensor parallel and plain tensors in one model), and a pipeline stage's
    parameters are measured with every other stage's: the norm is one process's over the
    whole model."""
    parameters = list(parameters)
    norm = grad_norm(parameters)
    if max_norm is not None:
        scale_grads_(parameters, clip_coefficient(norm, max_norm))
    return norm


def grad_norm(parameters: Iterable[nn.Parameter], stage: Any = None) -> torch.Tensor:
    """`total_grad_norm` of the whole model: for a pipeline stage's parameters, over every
    stage (each holds only its own gradients), a tied parameter counted once. `stage` (the
    model's PipelineState) names the pipeline also when this stage has no parameter to
    measure: it trains nothing, and the other stages wait for its zero."""
    parameters = list(parameters)
    squared = stage_grad_norm_squared(parameters, total_grad_norm, stage)
    return total_grad_norm(parameters) if squared is None else squared.sqrt()


@contextlib.contextmanager
def step_context(model: nn.Module, sync: bool) -> Iterator[None]:
    """Around one micro-batch's forward and backward: gradient sync on or off (DDP's
    no_sync, FSDP2's set_requires_gradient_sync), and torch's loss_parallel when the model
    was wrapped with `loss_parallel=True` (its logits stay split over tp)."""
    info = wrap_info(model)
    parallel_loss = info is not None and info.config.loss_parallel and info.config.tp_size > 1
    with loss_parallel() if parallel_loss else contextlib.nullcontext():
        if isinstance(model, DistributedDataParallel):
            with contextlib.nullcontext() if sync else model.no_sync():
                yield
        elif isinstance(model, FSDPModule):
            # Without sync FSDP2 keeps unsharded gradients locally until the last micro-batch.
            model.set_requires_gradient_sync(sync)
            yield
        else:
            yield


def whole_loss(outputs: Any) -> Any:
    """A prediction's loss as a plain tensor (a replicated DTensor under loss_parallel);
    logits split over the vocabulary stay a DTensor."""
    if isinstance(outputs, DTensor):
        return outputs.full_tensor()
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, DTensor):
        outputs.loss = loss.full_tensor()
    return outputs


def local_values(logs: dict[str, Any]) -> dict[str, Any]:
    """Logged values as plain tensors: under loss_parallel the loss is a replicated DTensor."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in logs.items()}


class Engine:
    """One object that steps a wrapped model: `train_step`, `val_step`, `test_step`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | OptimWrapperLike | None = None,
        config: ParallelConfig | None = None,
        scheduler: SchedulerLike | SchedulerFactory | None = None,
        *,
        train: TrainConfig | None = None,
        adapter: AdapterConfig | None = None,
    ) -> None:
        config, train, scheduler, optimizer = engine_values_from_env(
            config, train, scheduler, optimizer
        )
        self.train_config = train or TrainConfig()
        model = _with_adapter(model, adapter)  # before wrapping: peft adds layers to wrap
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
        else:
            self.config = config or ParallelConfig()
            self.model = model if _already_parallel(model) else wrap(model, self.config)
        self.device = _model_device(self.model)
        self._pipeline = pipeline_state(unwrap(self.model)) is not None
        wrapper_scaler = None
        if is_optim_wrapper(optimizer):
            optimizer, self.train_config, wrapper_scaler = from_optim_wrapper(
                optimizer, self.train_config, self.config, self.device.type
            )
        self.optimizer = build_optimizer(optimizer, self.model)
        self.scheduler = build_scheduler(scheduler, self.optimizer)
        self.scaler = wrapper_scaler if wrapper_scaler is not None else self._build_scaler()
        if self._pipeline:
            _check_pipelined(self.model, self.config, self.scaler)
        _check_loss_over(self.train_config, self.config)
        self.micro_step = 0
        self.step = 0
        self.skipped_steps = 0
        self._stop_requested = False
        self._save_requested = False
        self.save_requested = False
        """True after an update in which any rank called `request_save`."""
        self._tp_checked = False
        self._nonfinite_ranks = 0
        self._window: list[dict[str, torch.Tensor]] = []
        self._held = self._units_to_hold()

    def _units_to_hold(self) -> list[tuple[FSDPModule, bool]]:
        """The units `keep_frozen_gathered` keeps gathered over an accumulation window."""
        tc, info = self.train_config, wrap_info(self.model)
        if not tc.keep_frozen_gathered or tc.accumulate_steps == 1 or info is None:
            return []
        if info.plan is None or info.mesh_spec is None or info.mesh_spec.engine == "ddp":
            return []  # nothing is resharded: nothing to keep
        return frozen_units(unwrap(self.model), info.plan)

    # --- set-up ---------------------------------------------------------------------

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
        return call_model(self.model, _to_device(batch, self.device), mode)

    # --- steps ------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask every rank to stop after the current optimizer step (safe in a signal handler).

        The request rides on the all-reduce each update already makes, so ranks asked at
        different moments still agree: the update that first sees any rank's request
        returns `stop=1.0` on every rank."""
        self._stop_requested = True

    def request_save(self) -> None:
        """Ask every rank to save after the next optimizer step (the Runner's
        save_every_minutes timer: each rank's clock is its own). The request rides on the
        update's all-reduce, as `request_stop`'s does, so it costs no collective or host
        sync of its own: after the update that first sees any rank's request,
        `save_requested` is True on every rank."""
        self._save_requested = True

    def train_step(
        self, batch: Any, *, force_update: bool = False, loss_weight: float | None = None
    ) -> dict[str, Any]:
        """Forward + backward one micro-batch; update on the last of the window.

        Returns the micro-batch's loss values as 0-dim device tensors (reading them waits
        for the device; the Engine itself does not). On the micro-batch that updates (or
        with `force_update`, e.g. at the end of an epoch), returns instead the window's mean
        values averaged across ranks as floats, plus `grad_norm`, `lr`, `loss_scale`, `skipped`
        (1.0 when the update was dropped: fp16 scaling found inf/nan gradients, or
        `on_nonfinite='skip'` found a non-finite loss or norm) and `stop` (1.0 when any
        rank called `request_stop`). A non-finite loss or norm with `on_nonfinite='stop'`
        raises `NonFiniteError` on every rank.
        A model returning `(losses, preds[, masks])` gets them back, untouched, under
        `vis_preds`/`vis_masks`. A model with its own `parse_losses` has it called.
        `loss_weight` multiplies the loss and logs (the Runner's `loss_over='tokens'`)."""
        tc = self.train_config
        update = force_update or self.micro_step + 1 >= tc.accumulate_steps
        if not self.model.training:  # train() walks every module: not on each micro-step
            self.model.train()
        if self._held and self.micro_step == 0:  # gathered at this forward, kept to the last
            keep_gathered(self._held, True)
        passed: dict[str, Any] = {}
        if self._pipeline:  # the schedule runs forward and backward over micro-batches
            loss = pipeline_step(
                self.model,
                _to_device(batch, self.device),
                scale=1.0 / tc.accumulate_steps,
                sync=update or tc.sync_each_microbatch,
            )
            logs = {"loss": loss}
        else:
            with step_context(self.model, update or tc.sync_each_microbatch):
                outputs = self.forward(batch, "loss")
                losses, passed = split_outputs(outputs)
                loss, logs = _weighted(*model_parse_losses(unwrap(self.model), losses), loss_weight)
                scaled = loss / tc.accumulate_steps
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
        if self._held and update:
            keep_gathered(self._held, False)
        logs = local_values(logs)
        self._window.append(logs)
        self.micro_step += 1
        result: dict[str, Any]
        if not update:
            result = dict(logs)  # device tensors: a float() here would wait for the GPU
        else:
            result = self._update()
        result.update(passed)  # predictions for visualisation: as returned, never averaged
        return result

    def _update(self) -> dict[str, Any]:
        tc = self.train_config
        params = trainable_params(self.optimizer)  # never a frozen one's stale gradient
        if self.scaler is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*scalar.*")
                self.scaler.unscale_(self.optimizer)
        anomalous = anomalous_params(self.model) if tc.detect_anomalous_params else []
        if not self._tp_checked:  # once: a parameter left whole between split layers
            self._tp_checked = True
            check_tp_gradients(self.model)
        norm = grad_norm(params, pipeline_state(unwrap(self.model)))
        asked, save = self._stop_requested, self._save_requested
        reduced = reduce_window(self._window, norm, self.device, self.scaler is None, asked, save)
        self._window = []
        # Sent: a request that arrives from here on rides on the next update.
        if asked:
            self._stop_requested = False
        if save:
            self._save_requested = False
        self.save_requested = reduced.save
        result: dict[str, Any] = dict(reduced.means)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the lr this update uses
        self.micro_step = 0
        self._nonfinite_ranks = reduced.nonfinite_ranks
        if reduced.nonfinite_ranks:  # rare: the report may sync again
            bad = nonfinite_keys(reduced, self.scaler is None)
            self._drop_update(nonfinite_report(bad, reduced.keys, self.device))
            result.update(grad_norm=reduced.norm, lr=lr, skipped=1.0, stop=float(reduced.stop))
            return result
        if tc.max_grad_norm is not None:
            scale_grads_(params, clip_coefficient(norm, tc.max_grad_norm))
        skipped = False
        if self.scaler is not None:  # the scaler's own inf check and new scale sync twice
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
        result.update(
            grad_norm=reduced.norm, lr=lr, skipped=float(skipped), stop=float(reduced.stop)
        )
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
        stop_or_warn(step, self._nonfinite_ranks, where, self.train_config.on_nonfinite)
        self.skipped_steps += 1

    def val_step(self, batch: Any) -> Any:
        """Predict on `batch` without gradients, in eval mode."""
        return self._predict(batch)

    def test_step(self, batch: Any) -> Any:
        """Predict on `batch` without gradients, in eval mode."""
        return self._predict(batch)

    def _predict(self, batch: Any) -> Any:
        was_training = self.model.training
        self.model.eval()
        if self._pipeline:  # the last stage's loss, on every rank (forward-only schedule)
            try:
                return {"loss": pipeline_eval(self.model, _to_device(batch, self.device))}
            finally:
                self.model.train(was_training)
        try:
            with torch.no_grad(), step_context(self.model, sync=True):
                return whole_loss(self.forward(batch, "predict"))
        finally:
            self.model.train(was_training)


# --- helpers -------------------------------------------------------------------------------


def call_model(model: nn.Module, batch: Any, mode: str) -> Any:
    """`model` on `batch` under the model contract: OpenMMLab's `data_preprocessor` then
    `forward(..., mode=)`, or a plain forward of the batch (keywords, positional
    arguments, or one argument)."""
    preprocessor = getattr(unwrap(model), "data_preprocessor", None)
    if callable(preprocessor):  # OpenMMLab-style contract
        data = preprocessor(batch, mode == "loss")
        if isinstance(data, Mapping):
            return model(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return model(*data, mode=mode)
        return model(data, mode=mode)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(*batch)
    return model(batch)


def _weighted(
    loss: torch.Tensor, logs: dict[str, torch.Tensor], weight: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and its logged values times `weight` (None: as they are)."""
    if weight is None:
        return loss, logs
    return loss * weight, {k: v * weight for k, v in logs.items()}


def _check_loss_over(train: TrainConfig, config: ParallelConfig) -> None:
    """loss_over='tokens' where it is not built, refused at construction."""
    if train.loss_over != "tokens":
        return
    for name, degree in (("pp", config.pp), ("cp", config.cp)):
        if degree > 1:
            raise NotImplementedError(
                f"TrainConfig.loss_over='tokens' with ParallelConfig.{name}={degree} is not "
                "built yet: the schedule's micro-batches (pp) and the sequence's parts (cp) "
                "each compute their own loss, which shardwise does not weight by tokens yet. "
                "Use loss_over='batches' (each micro-batch's mean, averaged)."
            )


def _check_pipelined(model: nn.Module, config: ParallelConfig, scaler: Any) -> None:
    """What the Engine cannot do with a pipelined model yet, refused at construction."""
    if scaler is not None:
        raise NotImplementedError(
            f"Engine: fp16 loss scaling with ParallelConfig.pp={config.pp} is not built yet: "
            "the schedule runs the backward, so the loss cannot be scaled before it. Use "
            "mixed_precision='bf16' (no scaling needed) or pp=1."
        )
    if callable(getattr(unwrap(model), "data_preprocessor", None)):
        raise NotImplementedError(
            f"Engine: ParallelConfig.pp={config.pp} with an OpenMMLab-style model "
            "(data_preprocessor + forward(mode=)) is not built yet: the schedule calls "
            "forward with the batch's tensors as keywords. Use pp=1 for this model."
        )


def _with_adapter(model: nn.Module, adapter: AdapterConfig | None) -> nn.Module:
    """`model` with the run file's adapter section applied (peft), before any wrapping."""
    if adapter is None:
        return model
    if wrap_info(model) is not None or _already_parallel(model):
        raise ValueError(
            "Engine(adapter=...): the model is already wrapped, and peft must add its "
            "adapter layers before wrapping (wrap plans and shards the layers it finds). Pass "
            "the unwrapped model and let the Engine wrap it, or add the adapters yourself "
            "(peft.get_peft_model) before shardwise.wrap and leave adapter=None."
        )
    return apply_adapter(model, adapter)


def trainable_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters that train. Any other (frozen since the optimizer was
    built) loses a gradient left on it, so neither clipping nor the step can use it."""
    params = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                params.append(p)
            else:
                p.grad = None
    return params


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


def set_accumulation(engine: Engine, steps: int) -> None:
    """Make each optimizer step of `engine` take `steps` micro-batches from now on (between
    steps only: a resume at another data-parallel world keeps its global batch this way)."""
    if engine.micro_step != 0:
        raise RuntimeError(
            f"set_accumulation: the engine is {engine.micro_step} micro-batch(es) into an "
            "accumulation window; change it between optimizer steps."
        )
    engine.train_config = dataclasses.replace(engine.train_config, accumulate_steps=steps)
    engine._held = engine._units_to_hold()  # which units stay gathered depends on it
