"""How long planning takes: a GPT with many blocks, built on the meta device.

The plan is computed before any GPU hour is spent, so it must be quick even for very
deep models. Target (auto-wrap issue): a 1,000-block model plans in under 1 s.

    python bench/plan_speed.py                     # 1,000 blocks, auto policy
    python bench/plan_speed.py --blocks 200 --policy size

Prints one JSON object: model size, build time on meta, and planning time (median of
--repeats runs) for the chosen policy.
"""

from __future__ import annotations

import functools
import statistics
import warnings

import common
import torch

import shardwise
from shardwise.testing.models import GPT, GPTConfig


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--policy", default="auto", help="auto, size, transformer_blocks, ...")
    parser.add_argument(
        "--min-num-params", type=int, default=None, help="with --policy size (default 1e8)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    cfg = GPTConfig(
        vocab_size=32_000, seq_len=4096, d_model=args.d_model, n_heads=32, n_layers=args.blocks
    )
    with torch.device("meta"):
        build_s, model = common.timed(functools.partial(GPT, cfg))
    size = {"min_num_params": args.min_num_params or 100_000_000} if args.policy == "size" else {}
    if args.min_num_params is not None and args.policy != "size":
        parser.error(f"--min-num-params applies to --policy size only, not {args.policy!r}")
    config = shardwise.ParallelConfig(auto_wrap_policy=args.policy, mixed_precision="bf16", **size)
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", shardwise.PlanNotice)
        for _ in range(args.repeats):
            seconds, plan = common.timed(functools.partial(shardwise.plan_wrap, model, config))
            times.append(seconds)
    result = {
        **common.report_header("plan_speed", common.command_line("bench/plan_speed.py")),
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
    common.emit_json(result)


if __name__ == "__main__":
    main()
