"""The worker of tests/e2e/test_elastic.py and test_slurm.py: a Runner that resumes from
its latest checkpoint, saves after every step, and logs the ids of the samples each step
trains on.

`python _resumable_worker.py RUN_DIR [STRATEGY]`: under `shardwise run` or `srun`, at
whatever world the launchers form; STRATEGY is ParallelConfig.strategy (full_shard).
Each rank appends `{"step", "ids", "world", "start"}` lines to
RUN_DIR/ids/rank<R>-<pid>.jsonl (`start`: when its process started).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import shardwise
from shardwise import Engine, ParallelConfig, Runner, RunnerConfig

N, STEPS, BATCH = 256, 24, 2
STEP_SECONDS = 0.25  # each forward sleeps: a kill lands mid-run
START = time.time()  # tells this process's records from an earlier generation's


class Recorder(torch.nn.Module):
    def __init__(self, log: Path) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.log, self.engine = log, None

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        record = {"step": self.engine.step + 1, "ids": ids.tolist(),
                  "world": shardwise.get_dist_info().world_size,
                  "start": START}  # fmt: skip
        with self.log.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return (self.net(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()


def main() -> None:
    run_dir, strategy = Path(sys.argv[1]), (sys.argv[2:] or ["full_shard"])[0]
    info = shardwise.init_distributed()
    (run_dir / "ids").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Recorder(run_dir / "ids" / f"rank{info.rank}-{os.getpid()}.jsonl")
    engine = Engine(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                    ParallelConfig(strategy=strategy))  # fmt: skip
    model.engine = engine
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.arange(N), torch.randn(N, 4, generator=g))
    config = RunnerConfig(
        run_dir=str(run_dir), batch_size=BATCH, max_steps=STEPS, max_epochs=None,
        save_every=1, keep_last=2, log_every=1, progress=False, resume="latest", seed=3,
    )  # fmt: skip
    Runner(engine, data, config=config).fit()
    shardwise.export_weights(engine.model, run_dir / "export")
    shardwise.shutdown()


if __name__ == "__main__":
    main()
