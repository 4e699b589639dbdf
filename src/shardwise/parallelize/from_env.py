"""The configuration `shardwise run --from FILE` launched a script with.

Owns: `translation_from_env`, which reads the file the launcher named for its workers
(`SHARDWISE_FROM`, read in distributed/process_group.py) with the reader its suffix names
(config/foreign.py), at the job's world size; `wrap` given no config takes its layout from
it, and a script reads the training values it implies from it.

Must not: read the environment itself, or accept a file with a refused key (the launcher
refused it before starting anything; a worker refuses it the same way).
"""

from __future__ import annotations

from shardwise.config.foreign import read_foreign
from shardwise.config.translation import Translation
from shardwise.distributed.process_group import env_world_size, foreign_config_path

__all__ = ["translation_from_env"]


def translation_from_env() -> Translation | None:
    """What the file given to `shardwise run --from` (or `--deepspeed`,
    `--accelerate-config`) means at this job's world size; None when the script was not
    launched with one. `.config` is the shardwise Config (parallel, train, runner,
    optimizer) and `.build_scheduler(optimizer)` a DeepSpeed schedule."""
    path = foreign_config_path()
    if path is None:
        return None
    return read_foreign(path, world=env_world_size())
