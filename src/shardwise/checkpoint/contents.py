"""What a checkpoint holds besides tensors: the manifest's fields and each rank's RNG states.

Owns: the manifest (counters, configs, optimizer hyperparameters, scheduler and
grad-scaler state, runner position, versions), its JSON form, and capturing and restoring
each rank's RNG states (safetensors files).

Must not: write files or issue collectives.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from shardwise.checkpoint.layout import FORMAT, FORMAT_VERSION
from shardwise.checkpoint.trust import (
    CheckpointError,
)
from shardwise.config.parallel import ParallelConfig
from shardwise.config.training import TrainConfig
from shardwise.parallelize.wrapped import wrap_info


class EngineState(Protocol):
    """What a checkpoint saves from and restores into a shardwise `Engine`. Typed by its
    shape: checkpoint/ sits below train/ and never imports it (any object with these
    attributes is saved the same way)."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def scheduler(self) -> Stateful | None: ...
    @property
    def scaler(self) -> Stateful | None: ...
    @property
    def config(self) -> ParallelConfig: ...
    @property
    def train_config(self) -> TrainConfig: ...

    step: int
    """Optimizer steps done (set on load)."""
    skipped_steps: int
    micro_step: int


def _jsonable(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, default=_json_default))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} cannot be stored as JSON: {exc}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)


def _config_dict(config: object) -> dict[str, Any]:
    if config is None or not dataclasses.is_dataclass(config) or isinstance(config, type):
        return {}
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return dict(_jsonable(fields, f"{type(config).__name__}"))


def _rng_tensors() -> dict[str, torch.Tensor]:
    version, state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "python_state": torch.tensor(state, dtype=torch.int64),
        "python_meta": torch.tensor([version, gauss is not None, 0], dtype=torch.float64),
        "python_gauss": torch.tensor([gauss or 0.0], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_meta": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _restore_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    meta = t["python_meta"].tolist()
    gauss = float(t["python_gauss"][0]) if meta[1] else None
    random.setstate((int(meta[0]), tuple(int(x) for x in t["python_state"].tolist()), gauss))
    pos, has_gauss, cached = t["numpy_meta"].tolist()
    np.random.set_state(
        ("MT19937", t["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached)
    )
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])


@dataclass
class TrainState:
    """What a checkpoint holds, taken from an Engine or from a plain loop's own objects."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    step: int = 0
    skipped_steps: int = 0
    micro_step: int = 0
    config: ParallelConfig | None = None
    train_config: TrainConfig | None = None
    engine: EngineState | None = None
    """The Engine it came from (its counters are restored on load), or None."""


def train_state(
    target: nn.Module | EngineState,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    scheduler: Stateful | None,
    scaler: Stateful | None,
    what: str,
) -> TrainState:
    """A TrainState from what `save_checkpoint`/`load_checkpoint` were given: an Engine,
    or the model `shardwise.wrap` returned with the loop's own optimizer, step, scheduler
    and grad scaler."""
    if isinstance(target, nn.Module):
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(
                f"{what}(step={step!r}) must be the optimizer steps done, an int >= 0."
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{what}(optimizer=...) got {type(optimizer).__name__}; pass the torch "
                "optimizer the loop steps, or None to leave the optimizer out."
            )
        info = wrap_info(target)
        return TrainState(
            target,
            optimizer,
            scheduler,
            scaler,
            step=step or 0,
            config=info.config if info is not None else None,
        )
    if hasattr(target, "model") and hasattr(target, "optimizer") and hasattr(target, "step"):
        given = [n for n, v in (("optimizer", optimizer), ("step", step), ("scheduler",
                 scheduler), ("scaler", scaler)) if v is not None]  # fmt: skip
        if given:
            raise TypeError(
                f"{what}(directory, engine, {'=..., '.join(given)}=...): an Engine carries its "
                "own optimizer, step, scheduler and scaler. Pass the engine alone, or the "
                "model with the loop's own objects."
            )
        return TrainState(
            target.model,
            target.optimizer,
            target.scheduler,
            target.scaler,
            target.step,
            target.skipped_steps,
            target.micro_step,
            getattr(target, "config", None),
            getattr(target, "train_config", None),
            engine=target,
        )
    raise TypeError(
        f"{what}(directory, ...) got {type(target).__name__}; pass the model shardwise.wrap "
        "returned (with optimizer=..., step=...), or a shardwise Engine."
    )


def _manifest(
    engine: TrainState,
    optim_sd: dict[str, Any],
    world: int,
    extra: object,
    runner_state: Mapping[str, object] | None,
) -> dict[str, Any]:
    info = engine.config
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": engine.step,
        "skipped_steps": engine.skipped_steps,
        "world_size": world,
        "strategy": getattr(info, "strategy", None),
        "parallel_config": _config_dict(info),
        "train_config": _config_dict(engine.train_config),
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_groups": _jsonable(optim_sd["param_groups"], "optimizer param_groups"),
        }
        if engine.optimizer is not None
        else None,
        "scheduler": _jsonable(engine.scheduler.state_dict(), "scheduler state")
        if engine.scheduler is not None
        else None,
        "grad_scaler": _jsonable(engine.scaler.state_dict(), "grad scaler state")
        if engine.scaler is not None
        else None,
        "runner": _jsonable(runner_state, "runner state") if runner_state is not None else None,
        "extra": extra,
        "versions": {
            "shardwise": _shardwise_version(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _shardwise_version() -> str:
    try:
        return importlib.metadata.version("shardwise")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"
