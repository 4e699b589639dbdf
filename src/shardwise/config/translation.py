"""What another tool's configuration means in shardwise, key by key.

Owns: `Row` (one key read: its value, what it became, and whether that is exact, differs
in a stated way, has no effect under FSDP2, or is refused) and `Translation` (the rows,
the shardwise sections they fill, and a learning-rate schedule where the tool had one),
shared by the readers of other tools' files (config/deepspeed.py).

Must not: read files or know any one tool's keys.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from shardwise.config.parallel import ParallelConfig
from shardwise.config.run_file import Config, ConfigError, OptimizerConfig
from shardwise.config.training import RunnerConfig, TrainConfig

__all__ = ["Row", "Tool", "Translation", "Verdict"]

Verdict = Literal["exact", "differs", "no effect", "refused"]
Tool = Literal["DeepSpeed", "Accelerate", "torchtitan"]
"""The tools whose configuration files shardwise reads."""


_SHOWN = 40
"""The most characters of a refused value that an error prints: the key and the reason
are the message, not a whole block of the file."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


@dataclass(frozen=True)
class Row:
    """One key read: what it became and how faithfully."""

    key: str
    value: object
    became: str
    verdict: Verdict
    note: str = ""


@dataclass
class Translation:
    """What another tool's config means in shardwise (see the module docstring)."""

    source: Tool
    """The tool whose config was read."""
    rows: list[Row] = field(default_factory=list)
    parallel: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    runner: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    schedule: Callable[[int, float], float] | None = None
    """lr at optimizer step s (from 0), given the optimizer's lr: DeepSpeed's schedule."""

    def __post_init__(self) -> None:
        if self.source not in get_args(Tool):
            raise ValueError(
                f"Translation.source={self.source!r} is not one of the tools shardwise "
                f"reads: {list(get_args(Tool))}."
            )

    @property
    def refused(self) -> list[Row]:
        return [r for r in self.rows if r.verdict == "refused"]

    @property
    def config(self) -> Config:
        """The shardwise Config; a ConfigError naming every refused key if any was."""
        if self.refused:
            lines = [f"  {r.key} = {_short(r.value)}: {r.note}" for r in self.refused]
            raise ConfigError(
                f"this {self.source} config cannot mean the same in shardwise; refused:\n"
                + "\n".join(lines)
            )
        return Config(
            parallel=ParallelConfig(**self.parallel),
            train=TrainConfig(**self.train),
            runner=RunnerConfig(**self.runner),
            optimizer=OptimizerConfig(**self.optimizer),
        )

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """A torch LambdaLR giving each optimizer step DeepSpeed's lr (None: no block)."""
        if self.schedule is None:
            return None
        schedule = self.schedule

        def factor(base: float) -> Callable[[int], float]:
            return lambda step: schedule(step, base) / base

        # each group against its own lr, as DeepSpeed's schedulers read them
        factors = [factor(group["lr"]) for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)

    def table(self) -> str:
        width = max([len(r.key) for r in self.rows] + [3])
        head = f"{'key':<{width}}  {'value':<14}  {'verdict':<9}  became"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            value = json.dumps(r.value) if not isinstance(r.value, str) else r.value
            note = f" ({r.note})" if r.note else ""
            lines.append(f"{r.key:<{width}}  {value[:14]:<14}  {r.verdict:<9}  {r.became}{note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
