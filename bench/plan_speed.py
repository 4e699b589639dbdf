"""How long planning takes: a GPT with many blocks, built on the meta device.

The plan is computed before any GPU hour is spent, so it must be quick even for very
deep models. Target (auto-wrap issue): a 1,000-block model plans in under 1 s.

    python bench/plan_speed.py                     # 1,000 blocks, auto policy
    python bench/plan_speed.py --blocks 200 --policy size

Prints one JSON object: model size, build time on meta, and planning time (median of
--repeats runs) for the chosen policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import shardwise
from shardwise.models import GPT, GPTConfig


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--policy", default="auto", help="auto, size, transformer_blocks, ...")
    parser.add_argument("--min-num-params", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    cfg = GPTConfig(
        vocab_size=32_000, seq_len=4096, d_model=args.d_model, n_heads=32, n_layers=args.blocks
    )
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(cfg)
    build_s = time.perf_counter() - start
    config = shardwise.ParallelConfig(
        auto_wrap_policy=args.policy, min_num_params=args.min_num_params, mixed_precision="bf16"
    )
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardwise.PlanNotice)
        for _ in range(args.repeats):
            start = time.perf_counter()
            plan = shardwise.plan_wrap(model, config)
            times.append(time.perf_counter() - start)
    result = {
        "benchmark": "plan_speed",
        "command": " ".join(["bench/plan_speed.py", *sys.argv[1:]]),
        "commit": _commit(),
        "torch": torch.__version__,
        "blocks": args.blocks,
        "params": plan.total_params,
        "units": len(plan),
        "policy": plan.policy,
        "build_on_meta_s": round(build_s, 3),
        "plan_s_median": round(statistics.median(times), 3),
        "plan_s_all": [round(t, 3) for t in times],
        "target_s": 1.0,
        "meets_target": statistics.median(times) < 1.0,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
