"""Peak memory per rank when wrapping a model too big to copy around: eager vs meta build.

A GPT of about 2 GB of fp32 parameters is wrapped with full_shard at world size 4 on CPU
(gloo), twice, in fresh ranks each time:

- eager: every rank builds (and initialises) the whole model, then wrap() shards it;
- meta: every rank builds it under `shardwise.init_empty()`, then wrap() shards it and
  materialises and initialises only the rank's shards.

Reported per rank: peak RSS during build + wrap, minus RSS before the build (glibc's mmap
threshold pinned, the kernel's peak counter restarted, as in bench/overhead.py). Target
(meta-device issue): the meta build stays near a quarter of the model plus one unit.

    python bench/meta_memory.py                  # ~2.3 GB model, world 4 (about a minute)
    python bench/meta_memory.py --smoke
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (
    _git,
    _pin_malloc_thresholds,
    _proc_status_bytes,
    _reset_rss_peak,
    _rss_peak_bytes,
)

import shardwise
from shardwise.models import GPT, GPTConfig
from shardwise.testing import run_distributed


def _rank(cfg: GPTConfig, mode: str) -> dict[str, Any]:
    _pin_malloc_thresholds()
    before = _proc_status_bytes("VmRSS") or 0
    _reset_rss_peak()
    build = functools.partial(GPT, cfg)
    if mode == "meta":
        with shardwise.init_empty():
            model = build()
    else:
        torch.manual_seed(0)
        model = build()
    model = shardwise.wrap(model, shardwise.ParallelConfig(strategy="full_shard"))
    dist.barrier()
    peak = _rss_peak_bytes() - before
    plan = shardwise.wrap_info(model).plan
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    largest = max(sum(u.bytes_by_dtype.values()) for u in plan.units)
    return {"peak": peak, "local_param_bytes": local, "largest_unit_bytes": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.d_model, args.n_layers = 256, 2
    cfg = GPTConfig(
        vocab_size=32_000, seq_len=512, d_model=args.d_model, n_heads=16, n_layers=args.n_layers
    )
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    model_bytes = params * 4
    result: dict[str, Any] = {
        "benchmark": "meta_memory",
        "command": " ".join(["bench/meta_memory.py", *sys.argv[1:]]),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "torch": torch.__version__,
        "world": args.world,
        "params": params,
        "model_MiB": round(model_bytes / 2**20, 1),
    }
    for mode in ("eager", "meta"):
        ranks = run_distributed(_rank, args.world, args=(cfg, mode), timeout_s=1200)
        result[f"{mode}_peak_MiB_per_rank"] = [round(r["peak"] / 2**20, 1) for r in ranks]
        result["quarter_plus_unit_MiB"] = round(
            (model_bytes / args.world + ranks[0]["largest_unit_bytes"]) / 2**20, 1
        )
    meta_peak = max(result["meta_peak_MiB_per_rank"])
    result["meta_peak_over_quarter_plus_unit"] = round(
        meta_peak / result["quarter_plus_unit_MiB"], 2
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
