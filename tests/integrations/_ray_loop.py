"""The train_loop_per_worker of tests/integrations/test_ray.py: the recipe of docs/hosts.md,
plus what the tests read back. A module of its own, so that Ray's workers import it by name
(the test puts this directory on their PYTHONPATH) instead of pickling it by value."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


def _die() -> None:
    """A worker lost mid-step. Ray's controller takes in a report at its next poll of the
    workers (every 2 s): a worker lost sooner resumes from the report before."""
    import time

    time.sleep(5)
    os._exit(1)


def train_loop(cfg: dict[str, Any]) -> None:
    """train_loop_per_worker: the recipe of docs/hosts.md, plus what the tests read."""
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import TensorDataset

    import shardwise
    from shardwise import Engine, ParallelConfig, RunnerConfig
    from shardwise.integrations.ray import RayRunner

    ray_group = dist.group.WORLD  # Ray's TorchTrainer made it before the loop started
    info = shardwise.init_distributed()
    out = Path(cfg["out"])
    if info.rank == 0:  # adopted, not a second group
        (out / "groups.json").write_text(
            json.dumps([dist.group.WORLD is ray_group, info.world_size, str(info.backend)])
        )

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.calls = 0

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            kill = cfg.get("kill_at")
            marker = out / "killed"
            if kill and self.calls == kill and dist.get_rank() == 1 and not marker.exists():
                marker.write_text("1")
                _die()
            return nn.functional.mse_loss(self.body(x), y)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    model = Net()
    engine = Engine(
        model, lambda p: torch.optim.SGD(p, lr=0.1), ParallelConfig(strategy=cfg["strategy"])
    )
    config = RunnerConfig(
        run_dir=str(out / "run"), batch_size=8 // info.world_size, max_steps=cfg["max_steps"],
        max_epochs=None, shuffle=False, save_every=2, progress=False, resume="latest",
        tensorboard=False,
    )  # fmt: skip
    runner = RayRunner(engine, data, config=config)
    runner.fit()
    shardwise.export_weights(engine.model, out / "weights")
    if info.rank == 0:  # what this attempt resumed from: Ray's checkpoint, or 'latest'
        with open(out / "resumed_from", "a") as f:
            f.write(f"{runner.config.resume}\n")
