"""Pipeline schedules against no stages: step time at world 4 on one global batch (CPU/gloo).

Three layouts of the same GPT train through the Engine in one spawned group of 4, stepped
alternately (round r runs every layout once, in a rotating order), so a load that comes
and goes on the machine falls on all of them alike:

- `full_shard`: pp 1, the batch split over 4 data-parallel ranks;
- `1f1b`, `gpipe` and `interleaved_1f1b`: pp 2 x dp 2 (full_shard within each stage), the
  batch split over 2 data-parallel ranks and cut into `--microbatches` micro-batches per
  step; interleaved, each rank holds 2 stages of 2 layers (4 stages of the 8 layers).

Reported per layout: the median over rounds of the slowest rank's step time, and its ratio
to full_shard. What CPU timing can say: the cost of the schedule's extra work (micro-batch
overheads, send/recv of activations, the bubble where a stage waits for its neighbour) on
this machine. What it cannot: the bubble's cost on GPUs, where a stage's compute is fast
against its send, or the all-gathers pp saves across slow links between nodes (here every
rank shares one host's memory).

Then, per stage, the simulated peak (`simulate_step`, gloo) against the real one
(`shardwise.memory.stages.real_stage_step`, torch's memory tracker over real tensors) at
pp 2 x dp 2 under 1F1B and GPipe (interleaving is not simulated), for the same GPT and 8
sequences per data-parallel rank.

    python bench/pipeline.py            # GPT 256 wide, 8 layers, 16 sequences of 128
    python bench/pipeline.py --smoke    # a tiny GPT (seconds)
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import common
import torch

from shardwise import Engine, ParallelConfig, simulate_step, wrap_info
from shardwise.memory.stages import real_stage_step
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

WORLD = 4
LAYOUTS = ("full_shard", "1f1b", "gpipe", "interleaved_1f1b")


def _engine(layout: str, cfg: GPTConfig, microbatches: int) -> Engine:
    torch.manual_seed(0)
    if layout == "full_shard":
        config = ParallelConfig(strategy="full_shard")
    else:
        config = ParallelConfig(pp=2, pp_schedule=layout, pp_microbatches=microbatches)
    return Engine(GPT(cfg), functools.partial(torch.optim.AdamW, lr=1e-4), config)


def _rank(cfg: GPTConfig, batch: int, rounds: int, microbatches: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    engines = {name: _engine(name, cfg, microbatches) for name in LAYOUTS}
    data = random_lm_batches(cfg, 1, batch)[0]

    def step(name: str) -> Any:
        engine = engines[name]
        info = wrap_info(engine.model)
        assert info is not None
        per = batch // info.dp_size
        rows = slice(info.dp_rank * per, (info.dp_rank + 1) * per)
        return engine.train_step((data[0][rows], data[1][rows]))["loss"]

    n = len(LAYOUTS)
    orders = [LAYOUTS[r % n :] + LAYOUTS[: r % n] for r in range(rounds + 1)]
    steps = {name: functools.partial(step, name) for name in LAYOUTS}
    times, losses = common.timed_rounds(steps, orders, warmup=1, barrier=True)
    return {"times": times, "losses": losses}


def run(cfg: GPTConfig, batch: int, rounds: int, microbatches: int) -> dict[str, Any]:
    per_rank = run_distributed(
        _rank, WORLD, args=(cfg, batch, rounds, microbatches), timeout_s=1800
    )
    figures: dict[str, Any] = {}
    for name in LAYOUTS:
        slowest = [max(r["times"][name][i] for r in per_rank) for i in range(rounds)]
        figures[name] = {"median_s": statistics.median(slowest), "rounds_s": slowest}
    base = figures["full_shard"]["median_s"]
    for name in LAYOUTS:
        figures[name]["ratio_to_full_shard"] = common.ratio(figures[name]["median_s"], base)
    return figures


def memory(cfg: GPTConfig, batch: int, microbatches: int) -> list[dict[str, Any]]:
    """Each stage's simulated and real peak under each schedule."""
    rows = []
    for schedule in ("1f1b", "gpipe"):
        config = ParallelConfig(pp=2, pp_schedule=schedule, pp_microbatches=microbatches)
        factory = functools.partial(GPT, cfg)
        real = run_distributed(_real_memory, WORLD, args=(cfg, config, batch), timeout_s=1800)
        sim = simulate_step(
            factory, config, world=WORLD, batch=batch, seq_len=cfg.seq_len, backend="gloo"
        )
        for st in sim.stages:
            measured = real[2 * st["index"]]
            rows.append({
                "schedule": schedule, "stage": st["index"], "in_flight": st["in_flight"],
                "real_bytes": measured["peak"], "simulated_bytes": st["peak"],
                "sim_over_real": st["peak"] / measured["peak"],
            })  # fmt: skip
    return rows


def _real_memory(cfg: GPTConfig, config: ParallelConfig, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    return real_stage_step(functools.partial(GPT, cfg), config, batch=batch, seq_len=cfg.seq_len)


def memory_table(rows: list[dict[str, Any]]) -> str:
    head = ("schedule", "stage", "in flight", "real", "simulated", "sim/real")
    lines = ["{:<9} {:>5} {:>9} {:>11} {:>11} {:>9}".format(*head)]
    for r in rows:
        lines.append(
            f"{r['schedule']:<9} {r['stage']:>5} {r['in_flight']:>9} "
            f"{common.mib(r['real_bytes']):>7.1f} MiB {common.mib(r['simulated_bytes']):>7.1f} MiB "
            f"{r['sim_over_real']:>9.4f}"
        )
    return "\n".join(lines)


def table(figures: dict[str, Any], microbatches: int) -> str:
    lines = [f"{'layout':<28} {'step (median, slowest rank)':>28} {'vs full_shard':>14}"]
    for name in LAYOUTS:
        label = "full_shard (pp 1, dp 4)" if name == "full_shard" else f"{name} (pp 2 x dp 2)"
        if name == "interleaved_1f1b":
            label = "interleaved (2 stages/rank)"
        f = figures[name]
        lines.append(
            f"{label:<28} {f['median_s'] * 1000:>25.1f} ms {f['ratio_to_full_shard']:>13.2f}x"
        )
    lines.append(f"({microbatches} micro-batches per step under pp)")
    return "\n".join(lines)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT (seconds)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    if args.smoke:
        cfg, batch, rounds = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4), 8, 2
    else:
        cfg = GPTConfig(vocab_size=1024, seq_len=128, d_model=256, n_layers=8)
        batch, rounds = 16, args.rounds
    figures = run(cfg, batch, rounds, args.microbatches)
    print(table(figures, args.microbatches))
    mem = memory(cfg, batch // 2, args.microbatches)
    print(memory_table(mem))
    header = common.dated_header(
        "pipeline", common.command_line("python bench/pipeline.py"),
        common.device_description("cpu", WORLD),
    )  # fmt: skip
    common.emit_json(
        {
            **header,
            "global_batch": batch,
            "microbatches": args.microbatches,
            **figures,
            "memory": mem,
        }
    )


if __name__ == "__main__":
    main()
