"""The configuration `shardwise run --from FILE` launched a script with.

Owns: `translation_from_env`, which reads the file the launcher named for its workers
(`SHARDWISE_FROM`, read in distributed/process_group.py) with the reader its suffix names
(config/foreign.py), at the job's world size; `wrap` given no config takes its layout from
it, `Engine` its training values, schedule and optimizer (`engine_values_from_env`),
and a script reads the training values it implies from it.

Must not: read the environment itself, or accept a file with a refused key (the launcher
refused it before starting anything; a worker refuses it the same way).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from shardwise.config.foreign import read_foreign
from shardwise.config.parallel import LAUNCHED, ParallelConfig
from shardwise.config.training import TrainConfig
from shardwise.config.translation import Translation
from shardwise.distributed.process_group import env_world_size, foreign_config_path

__all__ = ["engine_values_from_env", "translation_from_env"]


def translation_from_env() -> Translation | None:
    """What the file given to `shardwise run --from` (or `--deepspeed`,
    `--accelerate-config`) means at this job's world size; None when the script was not
    launched with one. `.config` is the shardwise Config (parallel, train, runner,
    optimizer) and `.build_scheduler(optimizer)` a DeepSpeed schedule."""
    path = foreign_config_path()
    if path is None:
        return None
    return read_foreign(path, world=env_world_size())


def _launched_parallel() -> ParallelConfig | None:
    launched = translation_from_env()
    return launched.config.parallel if launched is not None else None


LAUNCHED.append(_launched_parallel)  # ParallelConfig.from_env reads no environment itself


def engine_values_from_env(
    config: ParallelConfig | None, train: TrainConfig | None, scheduler: Any, optimizer: Any
) -> tuple[ParallelConfig | None, TrainConfig | None, Any, Any]:
    """For `Engine(...)`: what the file of `shardwise run --from FILE` says, where the
    caller gave nothing: its layout, its accumulation, clipping and loss scaling, its
    schedule, and (as DeepSpeed builds one when the script passes none) its optimizer."""
    launched = translation_from_env()
    if launched is None:
        if optimizer is None:
            raise TypeError(
                "Engine(model) needs an optimizer: pass one, or a factory such as "
                "lambda params: torch.optim.AdamW(params, lr=3e-4). (A script launched by "
                "`shardwise run --from FILE` whose file has an optimizer block may leave it out.)"
            )
        return config, train, scheduler, optimizer
    given = launched.config
    if optimizer is None and not launched.optimizer:
        raise TypeError(
            f"Engine(model) needs an optimizer: the {launched.source} file the script was "
            "launched with has no optimizer block to build one from. Pass one, or a factory "
            "such as lambda params: torch.optim.AdamW(params, lr=3e-4)."
        )
    if optimizer is not None and launched.optimizer and os.environ.get("RANK", "0") == "0":
        warnings.warn(  # DeepSpeed does the same with a client optimizer, and logs it
            f"Engine: the script's optimizer is used, not the optimizer block of the "
            f"{launched.source} file it was launched with (as DeepSpeed does when the script "
            "passes one). Leave Engine's optimizer out to build the file's.",
            UserWarning,
            stacklevel=3,
        )
    schedule = launched.build_scheduler if launched.schedule is not None else None
    return (
        config or given.parallel,
        train or given.train,
        scheduler or schedule,
        optimizer if optimizer is not None else given.optimizer.build,
    )
