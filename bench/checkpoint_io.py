"""Checkpoint I/O: save and load throughput, and how much a save raises peak memory.

A GPT is sharded with full_shard over `--world` CPU ranks (gloo), trained one step so
AdamW has its state, then saved with `shardwise.save_checkpoint` and loaded back with
`shardwise.load_checkpoint` into a fresh engine. Reported per run:

- save and load throughput: checkpoint bytes / wall time of the slowest rank (MB/s). A
  save includes hashing every file (SHA-256, each rank hashing its share); load is timed
  twice, without and with that verification;
- peak memory during save, per rank: peak RSS during the save minus RSS just before it
  (glibc's mmap threshold pinned and the kernel's peak counter restarted, as in
  bench/overhead.py), compared with one shard unit: the largest unit's parameters plus
  AdamW state on one rank. Target (checkpoint issue): about one unit or less;
- asynchronous save (`save_checkpoint(..., async_=True)`): the training stall per save,
  i.e. the time until the call returns control (the CPU copy of the state) plus the time
  of `result()` once the background write has finished (gather of the hashes, manifest,
  rename), against the full time of the synchronous save above. Target (issue 13): stall
  <= 10% of a synchronous save. Two asynchronous saves run: the first also allocates the
  CPU copy that later ones reuse (`async_first_*`), the second is the steady state. Also
  reported: how long the background write took, and a training step's time alone and
  while that write runs (both on the same cores here).

    python bench/checkpoint_io.py                 # ~100 M-param GPT, world 2
    python bench/checkpoint_io.py --smoke
"""

from __future__ import annotations

import time
from typing import Any

import common
import torch
import torch.distributed as dist

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches


def _engine(cfg: GPTConfig, seed: int) -> shardwise.Engine:
    torch.manual_seed(seed)
    return shardwise.Engine(
        GPT(cfg),
        lambda p: torch.optim.AdamW(p, lr=1e-4),
        shardwise.ParallelConfig(strategy="full_shard"),
    )


def _rank_body(cfg: GPTConfig, root: str) -> dict[str, Any]:
    common.pin_malloc_thresholds()
    engine = _engine(cfg, 0)
    x, y = random_lm_batches(cfg, 1, 2, seed=dist.get_rank())[0]
    engine.train_step((x, y))
    plan = shardwise.wrap_info(engine.model).plan
    world = dist.get_world_size()
    unit_params = max(u.num_params for u in plan.units)
    unit_bytes = (
        unit_params * 4 * 3 // world
    )  # fp32 param + exp_avg + exp_avg_sq, this rank's share
    dist.barrier()
    before = common.proc_status_bytes("VmRSS") or 0
    common.reset_rss_peak()
    save_s, path = common.timed(lambda: shardwise.save_checkpoint(root, engine))
    save_peak = common.rss_peak_bytes() - before
    fresh = _engine(cfg, 1)
    load_s, _ = common.timed(
        lambda: shardwise.load_checkpoint(path, fresh, verify=False), barrier=True
    )
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(engine.model.parameters(), fresh.model.parameters(), strict=True)
    )
    load_verified_s, _ = common.timed(
        lambda: shardwise.load_checkpoint(path, fresh, verify=True), barrier=True
    )
    timings = _async_body(engine, x, y, root)
    return {
        **timings,
        "save_s": save_s,
        "load_s": load_s,
        "load_verified_s": load_verified_s,
        "save_peak_bytes": save_peak,
        "unit_bytes": unit_bytes,
        "largest_unit_params": unit_params,
        "restored_exactly": same,
        "path": str(path),
    }


def _async_body(
    engine: shardwise.Engine, x: torch.Tensor, y: torch.Tensor, root: str
) -> dict[str, Any]:
    """Stalls of two asynchronous saves (the first also allocates the CPU copy that later
    ones reuse); a training step alone and during the write."""
    step_s, _ = common.timed(lambda: engine.train_step((x, y)), barrier=True)
    out: dict[str, Any] = {"step_s": step_s}
    for i in range(2):
        dist.barrier()
        start = time.perf_counter()
        pending = shardwise.save_checkpoint(root, engine, async_=True)
        out[f"call_s_{i}"] = time.perf_counter() - start
        engine.train_step((x, y))  # overlaps the background write
        out[f"step_during_s_{i}"] = time.perf_counter() - start - out[f"call_s_{i}"]
        while not pending.done():
            time.sleep(0.01)
        out[f"written_s_{i}"] = time.perf_counter() - start
        # After a barrier, every rank's write is done: result() measures only its own work.
        out[f"result_s_{i}"], written = common.timed(pending.result, barrier=True)
        out["async_path"] = str(written)
    return out


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32_000)
    common.add_dir_arg(parser)
    parser.add_argument("--smoke", action="store_true", help="a tiny model: seconds")
    args = parser.parse_args()
    if args.smoke:
        args.d_model, args.n_layers, args.vocab = 64, 2, 256
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=128,
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 64),
        n_layers=args.n_layers,
    )
    with common.work_dir(args.dir, "shardwise-ckpt-bench-") as root:
        ranks = run_distributed(_rank_body, args.world, args=(cfg, str(root)), timeout_s=1200)
        manifest = shardwise.checkpoint.read_manifest(ranks[0]["path"])
        total = manifest["bytes"]
        save_s = max(r["save_s"] for r in ranks)
        load_s = max(r["load_s"] for r in ranks)
        verified_s = max(r["load_verified_s"] for r in ranks)
        result = {
            **common.report_header("checkpoint_io", common.command_line("bench/checkpoint_io.py")),
            "world": args.world,
            "params": GPT(cfg).num_params(),
            "checkpoint_bytes": total,
            "save_s": round(save_s, 3),
            "load_s": round(load_s, 3),
            "save_MB_per_s": round(total / save_s / 1e6, 1),
            "load_MB_per_s": round(total / load_s / 1e6, 1),
            "load_verified_s": round(verified_s, 3),
            "load_verified_MB_per_s": round(total / verified_s / 1e6, 1),
            "save_peak_MiB_per_rank": [common.mib(r["save_peak_bytes"]) for r in ranks],
            "one_unit_MiB_per_rank": common.mib(ranks[0]["unit_bytes"]),
            "peak_over_unit": round(
                max(r["save_peak_bytes"] for r in ranks) / ranks[0]["unit_bytes"], 2
            ),
            "restored_exactly": all(r["restored_exactly"] for r in ranks),
            "async_first_call_stall_s": round(max(r["call_s_0"] for r in ranks), 3),
            "async_call_stall_s": round(max(r["call_s_1"] for r in ranks), 3),
            "async_result_stall_s": round(max(r["result_s_1"] for r in ranks), 3),
            "async_stall_over_sync_save": round(
                max(r["call_s_1"] + r["result_s_1"] for r in ranks) / save_s, 3
            ),
            "async_first_stall_over_sync_save": round(
                max(r["call_s_0"] + r["result_s_0"] for r in ranks) / save_s, 3
            ),
            "async_background_write_s": round(max(r["written_s_1"] for r in ranks), 3),
            "train_step_s": round(max(r["step_s"] for r in ranks), 3),
            "train_step_during_write_s": round(max(r["step_during_s_1"] for r in ranks), 3),
            "async_checkpoint_verified": shardwise.checkpoint.verify_checkpoint(
                ranks[0]["async_path"]
            )
            == [],
        }
        common.emit_json(result)


if __name__ == "__main__":
    main()
