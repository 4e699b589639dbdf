"""Peak memory per rank when wrapping a model too big to copy around: eager vs meta build.

A GPT of about 2 GB of fp32 parameters is wrapped with full_shard at world size 4 on CPU
(gloo), twice, in fresh ranks each time:

- eager: every rank builds (and initialises) the whole model, then wrap() shards it;
- meta: every rank builds it under `shardwise.init_empty()`, then wrap() shards it and
  materialises and initialises only the rank's shards;
- meta_load: meta build, then `wrap(weights=...)`: every rank reads its own slices of a
  safetensors file;
- meta_load_rank0: the same with `broadcast_from_rank0=True`: rank 0 alone reads the file,
  one tensor at a time, and scatters the shards.

Reported per rank: peak RSS during build + wrap, minus RSS before the build (glibc's mmap
threshold pinned, the kernel's peak counter restarted, as in bench/overhead.py), and the
peak of anonymous RSS, sampled every 5 ms. The two differ when a rank maps the weights
file: file pages count in RSS but belong to the page cache, which the kernel can drop.
Target (meta-device issue): the meta build stays near a quarter of the model plus one unit.

    python bench/meta_memory.py                  # ~2.3 GB model, world 4 (a few minutes)
    python bench/meta_memory.py --modes eager,meta
    python bench/meta_memory.py --smoke
"""

from __future__ import annotations

import functools
import tempfile
import threading
from typing import Any

import common
import torch
import torch.distributed as dist

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig

MODES = ("eager", "meta", "meta_load", "meta_load_rank0")


class _AnonPeak:
    """Samples RssAnon (memory the process owns, file mappings excluded) in a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, common.proc_status_bytes("RssAnon") or 0)

    def __enter__(self) -> _AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _rank(cfg: GPTConfig, mode: str, weights: str | None) -> dict[str, Any]:
    common.pin_malloc_thresholds()
    before = common.proc_status_bytes("VmRSS") or 0
    anon_before = common.proc_status_bytes("RssAnon") or 0
    common.reset_rss_peak()
    build = functools.partial(GPT, cfg)
    with _AnonPeak() as anon:
        if mode == "eager":
            torch.manual_seed(0)
            model = build()
        else:
            with shardwise.init_empty():
                model = build()
        model = shardwise.wrap(
            model,
            shardwise.ParallelConfig(strategy="full_shard"),
            weights=weights if mode.startswith("meta_load") else None,
            broadcast_from_rank0=mode == "meta_load_rank0",
        )
        dist.barrier()
    peak = common.rss_peak_bytes() - before
    plan = shardwise.wrap_info(model).plan
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    largest = max(sum(u.bytes_by_dtype.values()) for u in plan.units)
    return {
        "peak": peak,
        "anon_peak": max(anon.peak - anon_before, 0),
        "local_param_bytes": local,
        "largest_unit_bytes": largest,
    }


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--n-layers", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES), help=f"some of {MODES}")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {MODES}")
    if args.smoke:
        args.d_model, args.n_layers = 256, 2
    cfg = GPTConfig(**common.memory_gpt_sizes(args))
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    model_bytes = params * 4
    result: dict[str, Any] = common.model_report("meta_memory", args.world, params)
    with tempfile.TemporaryDirectory(prefix="shardwise-meta-memory-") as tmp:
        weights = None
        if any(m.startswith("meta_load") for m in modes):
            torch.manual_seed(0)
            weights = str(shardwise.export_weights(GPT(cfg), tmp).parent)
        for mode in modes:
            ranks = run_distributed(_rank, args.world, args=(cfg, mode, weights), timeout_s=1200)
            result[f"{mode}_peak_MiB_per_rank"] = [common.mib(r["peak"]) for r in ranks]
            result[f"{mode}_anon_peak_MiB_per_rank"] = [common.mib(r["anon_peak"]) for r in ranks]
            result["quarter_plus_unit_MiB"] = common.mib(
                model_bytes / args.world + ranks[0]["largest_unit_bytes"]
            )
    for mode in modes:
        if mode != "eager":
            worst = max(result[f"{mode}_anon_peak_MiB_per_rank"])
            result[f"{mode}_anon_peak_over_quarter_plus_unit"] = round(
                worst / result["quarter_plus_unit_MiB"], 2
            )
    common.emit_json(result)


if __name__ == "__main__":
    main()
