"""Lightning Fabric adapter: `Fabric(strategy=ShardwiseFabricStrategy(strategy="full_shard"))`.

Owns: translating Fabric's strategy calls into shardwise's: `wrap` for `fabric.setup`
(an optimizer set up with the model is pointed at the sharded parameters, as Fabric's own
FSDP does with `use_orig_params`), the norm over every shard for `fabric.clip_gradients`,
DDP's `no_sync` or FSDP2's gradient-sync flag for `fabric.no_backward_sync`, shardwise's
checkpoints for `fabric.save`/`fabric.load`, and the data-parallel coordinates for the
sampler `fabric.setup_dataloaders` adds (the ranks of one tensor-parallel group read the
same rows).

One class deep on Fabric's `ModelParallelStrategy` (FSDP2-based), which brings the
launcher, the process group and the collectives. What differs is done here, or in the
free functions below it.

Must not: be imported by `shardwise` itself (it imports lightning).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import _Stateful
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.save import save_checkpoint
from shardwise.config.parallel import ParallelConfig
from shardwise.integrations.layouts import host_config
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.materialize import init_empty
from shardwise.parallelize.wrapped import stale_parameters, unwrap, wrap_info
from shardwise.train.engine import clip_grad_norm_, trainable_params

__all__ = ["ShardwiseFabricStrategy"]

_NAME = "ShardwiseFabricStrategy"


class ShardwiseFabricStrategy(ModelParallelStrategy):
    """Fabric strategy that parallelises the model with `shardwise.wrap`.

    Keywords are `ParallelConfig`'s (or its vocabulary), or pass `config=`;
    `process_group_backend` and `timeout` are Lightning's.

        fabric = lightning.Fabric(strategy=ShardwiseFabricStrategy(strategy="full_shard"),
                                  accelerator="cpu", devices=2)

    `fabric.setup(model, optimizer)` and `fabric.setup_module` then `setup_optimizers`
    both work. `fabric.init_module(empty_init=True)` builds on the meta device, and each
    rank allocates only its shards. `fabric.save(path, state)` writes a shardwise
    checkpoint under the directory `path` (one model, at most one optimizer and one
    scheduler; everything else in `state` must be JSON), which `fabric.load` reshards into
    any world size or layout.
    """

    def __init__(
        self,
        config: ParallelConfig | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **parallel: Any,
    ) -> None:
        self.config = host_config(config, parallel, _NAME, "Lightning Fabric")
        super().__init__(
            parallelize_fn=_not_called,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._backward_sync_control = _SyncControl()
        self._model: Module | None = None
        self._steps: dict[int, int] = {}  # optimizer steps, by id(optimizer)

    # --- processes and data ------------------------------------------------------------------

    def setup_environment(self) -> None:
        # Fabric's ModelParallelStrategy also builds a (data, tensor) mesh here; wrap
        # builds shardwise's own from the config, so only the process group is needed.
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self.config.tp_size == 1:  # every rank reads its own rows
            return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}
        info = wrap_info(self._model) if self._model is not None else None
        if info is None:
            raise RuntimeError(
                f"{_NAME}(tp={self.config.tp}): fabric.setup_dataloaders was called before "
                "fabric.setup(model). Under tensor parallelism the ranks of one tp group read "
                "the same rows, and which ranks those are comes from the mesh wrapping builds. "
                "Set up the model first, then the dataloaders."
            )
        return {"num_replicas": info.dp_size, "rank": info.dp_rank}

    # --- model and optimizers ----------------------------------------------------------------

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        stack = ExitStack()
        if empty_init:  # parameters on meta; wrap allocates and initialises only the shards
            stack.enter_context(init_empty())
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_module(self, module: Module) -> Module:
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise TypeError(
                f"{_NAME}: the model holds FSDP1 FullyShardedDataParallel modules. Leave the "
                "wrapping to the strategy: pass plain modules to fabric.setup."
            )
        if wrap_info(module) is None:
            module = wrap(module, self.config)
        self._model = module
        return module

    def module_to_device(self, module: Module) -> None:
        pass  # wrap places the model on this rank's device

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        """`fabric.setup(model, optimizer)`: sharding replaces each parameter, so the
        optimizers, built from the model before, are pointed at its sharded parameters
        (by name), as Fabric's FSDP keeps them with `use_orig_params`."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        rebind_optimizers(optimizers, names, unwrap(module))
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        stale, held = stale_parameters(optimizer)
        if stale:
            raise RuntimeError(
                f"{_NAME}: {type(optimizer).__name__} holds {stale} of {held} parameter(s) "
                "that sharding replaced: it was built from the model before fabric.setup_module "
                "wrapped it, so it would update tensors the model no longer uses. Build it from "
                "the model setup_module returned (optimizer = torch.optim.AdamW(model.parameters"
                "())), or set both up at once: model, optimizer = fabric.setup(model, optimizer)."
            )
        return optimizer

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, **kwargs)
        self._steps[id(optimizer)] = self._steps.get(id(optimizer), 0) + 1
        return out

    # --- gradients ---------------------------------------------------------------------------

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip by the 2-norm over every shard and replica of the optimizer's parameters
        that train (torch's own clip_grad_norm_ would see one rank's shards only)."""
        if float(norm_type) != 2.0:
            raise ValueError(
                f"fabric.clip_gradients(norm_type={norm_type!r}): {_NAME} clips by the 2-norm "
                "over every shard; other norms are not built. Use norm_type=2.0, or clip_val "
                "to clip each value."
            )
        self.precision.unscale_gradients(optimizer)
        norm = clip_grad_norm_(trainable_params(optimizer), float(max_norm))
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of the gradients is {float(norm)}, so they cannot be clipped "
                "(nothing was changed). Pass error_if_nonfinite=False to fabric.clip_gradients "
                "to go on anyway."
            )
        return norm

    def clip_gradients_value(
        self, module: Module, optimizer: Optimizer, clip_val: float | int
    ) -> None:
        """Clamp each gradient value: on each rank's shard, which is the same as clamping
        the whole gradient."""
        self.precision.unscale_gradients(optimizer)
        for p in trainable_params(optimizer):
            if p.grad is not None:
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                g.clamp_(-float(clip_val), float(clip_val))

    # --- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """`fabric.save(path, state)`: a shardwise checkpoint under the directory `path`
        (`path/step_<N>`, N the optimizer's steps, and `path/latest`); an earlier one there
        is replaced only once the new one is complete."""
        if storage_options is not None or filter is not None:
            given = "storage_options" if storage_options is not None else "filter"
            raise NotImplementedError(
                f"fabric.save(..., {given}=...) is not supported by {_NAME}: every rank writes "
                "its own shards of the whole state through torch.distributed.checkpoint. Save "
                f"without {given}."
            )
        parts = split_state(state)
        step = self._steps.get(id(parts.optimizer), 0) if parts.optimizer is not None else 0
        save_checkpoint(
            Path(self.broadcast(str(path))),
            parts.model,
            parts.optimizer,
            step=step,
            scheduler=parts.scheduler,
            extra=parts.extra,
            keep_last=1,
        )

    def load_checkpoint(
        self,
        path: Any,
        state: Any = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """`fabric.load(path, state)`: restore the model, optimizer and scheduler in `state`
        from a checkpoint `fabric.save` wrote (resharded into this run's layout), put the
        other keys' saved values into `state`, and return what was saved beyond them."""
        if isinstance(state, (Module, Optimizer)) or not state:
            return dict(super().load_checkpoint(path, state, strict, weights_only))
        parts = split_state(state, saving=False)
        manifest = load_checkpoint(
            Path(self.broadcast(str(path))),
            parts.model,
            parts.optimizer,
            scheduler=parts.scheduler,
            load_optimizer=parts.optimizer is not None,
        )
        if parts.optimizer is not None:
            self._steps[id(parts.optimizer)] = int(manifest["step"])
        saved = dict(manifest.get("extra") or {})
        missing = sorted(k for k in parts.extra if k not in saved)
        if strict and missing:
            raise KeyError(
                f"fabric.load: the checkpoint holds no {', '.join(map(repr, missing))} (it "
                f"holds {', '.join(map(repr, sorted(saved))) or 'nothing else'}). Pass "
                "strict=False to leave those entries as they are."
            )
        for key in parts.extra:
            if key in saved:
                obj, value = state[key], saved.pop(key)
                if isinstance(obj, _Stateful):
                    obj.load_state_dict(value)
                else:
                    state[key] = value
        return saved


def _not_called(module: Module, mesh: Any) -> Module:
    raise AssertionError("ShardwiseFabricStrategy wraps through shardwise.wrap")


def rebind_optimizers(optimizers: list[Optimizer], names: dict[int, str], model: Module) -> None:
    """Point each optimizer's parameters at the model's parameters of the same name
    (`names`: id of a parameter before wrapping → its name). Refused for an optimizer that
    has stepped: its state belongs to the replaced tensors."""
    after = dict(model.named_parameters(remove_duplicate=False))
    for i, optimizer in enumerate(optimizers):
        if optimizer.state:
            raise RuntimeError(
                f"{_NAME}: optimizer {i} ({type(optimizer).__name__}) has already stepped, so "
                "its state belongs to parameters sharding replaces. Set it up before its first "
                "step: model, optimizer = fabric.setup(model, optimizer)."
            )
        for group in optimizer.param_groups:
            group["params"] = [after.get(names.get(id(p), ""), p) for p in group["params"]]


@dataclass
class StateParts:
    """A `fabric.save`/`fabric.load` state dict, split the way a shardwise checkpoint
    holds it."""

    model: Module
    optimizer: Optimizer | None
    scheduler: LRScheduler | None
    extra: dict[str, Any]


def split_state(state: dict[str, Any], *, saving: bool = True) -> StateParts:
    """One model, at most one optimizer and scheduler, and JSON for everything else (a
    Stateful's `state_dict()` when saving), each refused by key otherwise."""
    what = "fabric.save" if saving else "fabric.load"
    found: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, obj in state.items():
        slot = next((s for s, t in _SLOTS.items() if isinstance(obj, t)), None)
        if slot is None:
            value = obj.state_dict() if saving and isinstance(obj, _Stateful) else obj
            extra[key] = _json_value(key, value) if saving else value
        elif slot in found:
            raise ValueError(
                f"{what}: state holds more than one {slot} ({key!r} is the second). A "
                f"{_NAME} checkpoint holds one model, with at most one optimizer and one "
                "scheduler: save each model under its own path."
            )
        else:
            found[slot] = obj
    if "model" not in found:
        raise ValueError(
            f"{what}: state holds no model. Pass the model fabric.setup returned, e.g. "
            "{'model': model, 'optimizer': optimizer, 'step': step}."
        )
    return StateParts(found["model"], found.get("optimizer"), found.get("scheduler"), extra)


_SLOTS: dict[str, type] = {"model": Module, "optimizer": Optimizer, "scheduler": LRScheduler}


def _json_value(key: str, value: Any) -> Any:
    """`value` if it comes back from JSON as it is (the checkpoint's manifest holds it)."""
    try:
        same = json.loads(json.dumps(value)) == value
    except (TypeError, ValueError):
        same = False
    if not same:
        raise TypeError(
            f"fabric.save: state[{key!r}] is {type(value).__name__} {_short(value)}, which "
            f"does not come back from JSON as it is. {_NAME} keeps what is not the model, "
            "optimizer or scheduler in the checkpoint's JSON manifest: numbers, strings, "
            "booleans, None, and lists and string-keyed dicts of them. Convert it (a tensor: "
            ".item() or .tolist()), or keep tensors in the model as buffers."
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


class _SyncControl(_BackwardSyncControl):
    """`fabric.no_backward_sync(model)`: DDP's no_sync, or FSDP2's gradient-sync flag
    (read at backward, so it stays off until the context closes)."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _no_sync(module, enabled)


@contextmanager
def _no_sync(module: Module, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
    elif isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
    elif isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:  # one process: nothing to synchronise
        yield
