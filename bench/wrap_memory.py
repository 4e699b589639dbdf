"""Peak memory per rank while `shardwise.wrap` shards an eagerly built model.

Every rank builds the whole model (eager), then shards it with full_shard at world 2 on CPU
(gloo). Reported per rank: the peak RSS from before the build to the end of the wrap (the
built model included), over the model's bytes. The same ranks are measured doing it by
hand, as torch's FSDP2 examples do: `fully_shard` on each block, then on the root, keeping
no reference to the original parameters. Target (issue 26): wrap at most 1.1x the model.

Method: glibc's mmap threshold pinned and the kernel's peak counter restarted before the
build, as in bench/overhead.py, so the peak follows live memory.

    python bench/wrap_memory.py                  # ~336M parameters (1.25 GiB fp32), world 2
    python bench/wrap_memory.py --smoke
"""

from __future__ import annotations

from typing import Any

import common
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig

MODES = ("wrap", "by_hand")


def _rank(cfg: GPTConfig, mode: str) -> dict[str, Any]:
    common.pin_malloc_thresholds()
    before = common.proc_status_bytes("VmRSS") or 0
    common.reset_rss_peak()
    torch.manual_seed(0)
    model = GPT(cfg)
    built = (common.proc_status_bytes("VmRSS") or 0) - before
    if mode == "wrap":
        model = shardwise.wrap(model, shardwise.ParallelConfig(strategy="full_shard"))
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    dist.barrier()
    peak = common.rss_peak_bytes() - before
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"peak": peak, "built": built, "local_param_bytes": local}


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--n-layers", type=int, default=24)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.d_model, args.n_layers = 256, 2
    cfg = GPTConfig(**common.memory_gpt_sizes(args))
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    model_bytes = params * 4
    result: dict[str, Any] = common.model_report("wrap_memory", args.world, params)
    for mode in MODES:
        ranks = run_distributed(_rank, args.world, args=(cfg, mode), timeout_s=1200)
        result[f"{mode}_peak_MiB_per_rank"] = [common.mib(r["peak"]) for r in ranks]
        result[f"{mode}_peak_over_model"] = round(max(r["peak"] for r in ranks) / model_bytes, 3)
        result[f"{mode}_built_MiB"] = common.mib(max(r["built"] for r in ranks))
    result["target_over_model"] = 1.1
    result["meets_target"] = result["wrap_peak_over_model"] <= 1.1
    common.emit_json(result)


if __name__ == "__main__":
    main()
