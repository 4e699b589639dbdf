"""Train an mmengine config, as mmengine's tools/train.py does.

    torchrun --nproc_per_node 2 examples/mmengine/train.py examples/mmengine/toy_config.py
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 torchrun ... --resume   # from work_dir's latest

mmengine 0.10 resumes through torch.load's default, which torch >= 2.6 made weights-only,
and its checkpoints hold a HistoryBuffer that weights-only loading refuses: hence the
variable on the resume (load only checkpoints you trust).

On CPU the process group is made here (gloo) before the Runner: mmengine's own init_dist
calls torch.cuda.set_device, which a CPU-only machine refuses. The Runner then finds the
group and uses it. On GPUs this line picks nccl and the rank's device.
"""

from __future__ import annotations

import argparse
import os
import sys

from mmengine.config import Config
from mmengine.runner import Runner

import shardwise

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for toy_modules


def main() -> None:
    parser = argparse.ArgumentParser(description="Train an mmengine config")
    parser.add_argument("config")
    parser.add_argument("--work-dir")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    cfg = Config.fromfile(args.config)
    if args.work_dir:
        cfg.work_dir = args.work_dir
    cfg.resume = args.resume
    if "WORLD_SIZE" in os.environ:  # started by torchrun
        shardwise.init_distributed()
        cfg.launcher = "pytorch"
    else:
        cfg.launcher = "none"
    runner = Runner.from_cfg(cfg)
    runner.train()
    shardwise.shutdown()


if __name__ == "__main__":
    main()
