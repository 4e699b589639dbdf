"""Ray Train adapter: shardwise's Runner inside `TorchTrainer`'s `train_loop_per_worker`.

Owns: reporting each checkpoint the Runner saves to Ray Train (`ray.train.report`, from
world rank 0, with the checkpoint's own directory), and resuming from Ray's latest
reported checkpoint (`ray.train.get_checkpoint()`), at whatever number of workers the
restarted trainer has: the Runner's resume keeps the global batch across a change.

Ray's `TorchTrainer` makes the process group before the loop starts; `init_distributed`
adopts it (it never makes a second one), so nothing here touches the group.

Must not: be imported by `shardwise` itself (it imports ray).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray.train

from shardwise.train.runner import Runner


@contextmanager
def latest_ray_checkpoint() -> Iterator[str | None]:
    """The directory of Ray's latest reported checkpoint while the block runs, or None when
    Ray has none (the first attempt of a new run)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as directory:
        yield str(directory)


class RayRunner(Runner):
    """A `Runner` that reports every checkpoint it saves to Ray Train and, when Ray holds a
    reported checkpoint (a restart after a failure, or a new trainer of the same run name),
    resumes from it instead of `RunnerConfig.resume`.

    Every rank must write into one directory (shardwise's checkpoints are sharded), so on
    more than one node `checkpoint_dir` is on storage every node mounts. Set
    `RunnerConfig(resume="latest")` so that a restart with no reported checkpoint yet
    starts again instead of refusing the run directory the first attempt wrote.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.async_save:
            raise ValueError(
                "RayRunner: RunnerConfig.async_save=True is not supported: Ray copies a "
                "checkpoint when it is reported, and an asynchronous one is complete only "
                "at the next save. Use async_save=False."
            )

    def fit(self) -> dict[str, Any]:
        with latest_ray_checkpoint() as reported:
            if reported is not None:
                self.config = dataclasses.replace(self.config, resume=reported)
            return super().fit()

    def save(self, position: dict[str, Any], *, async_: bool = False) -> Path:
        path = super().save(position)
        metrics: dict[str, Any] = {"step": self.engine.step}
        if self.history:  # the last logged row's numbers (loss, lr, ...)
            row = self.history[-1]
            metrics |= {
                k: v
                for k, v in row.items()
                if isinstance(v, (int, float)) and math.isfinite(v) and k != "step"
            }
        # One directory holds every rank's shards: rank 0 reports it, the others report
        # no checkpoint (every worker must call report, the same number of times). The
        # local copy stays: the Runner's `latest` and keep_last point into it.
        rank0 = ray.train.get_context().get_world_rank() == 0
        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if rank0 else None
        ray.train.report(metrics, checkpoint=checkpoint, delete_local_checkpoint_after_upload=False)
        return path
