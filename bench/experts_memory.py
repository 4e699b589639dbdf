"""Per-rank memory of a DeepSeek-V3-shaped mixture of experts at world 256 and 1024, with and
without expert parallel: simulated (fake tensors, a fake process group; nothing allocated).

The model is transformers' `DeepseekV3ForCausalLM` at its default configuration, which is
DeepSeek-V3's shape: 61 layers (the first 3 dense), hidden 7168, 256 routed experts of
width 2048 and one shared expert per MoE layer, 8 experts per token, multi-head latent
attention with 128 heads, vocabulary 129280 (671B parameters). Every row: full_shard over
all ranks, bf16 parameters with fp32 reduction, AdamW, activation checkpointing on every
block, one sequence of 4096 tokens per rank, nccl (no collective buffers of its own).

Each row is one `simulate_step` in a fresh subprocess. Under ep the routing is stated
(`expert_load`: the busiest rank receives that many times the balanced rows), and the
simulated rank is that busiest one. What is not modelled: attention runs as torch's CPU
kernel chooses under fake tensors (multi-head latent attention's query and value widths
differ, 192 and 128, so the CPU picks the math kernel, which holds the scores; a GPU
kernel need not), and nothing of DeepSeek's own kernels (FP8, DualPipe) is modelled.

    python bench/experts_memory.py            # the table (a few minutes per row on one core)
    python bench/experts_memory.py --smoke    # a tiny DeepSeek-V3 at world 4 (seconds)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import common

GIB = 2**30
TINY = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=128,
)  # fmt: skip
# world, ep, expert_load
ROWS = [
    (256, 1, 2.0),
    (256, 8, 2.0),
    (256, 64, 1.0),
    (256, 64, 2.0),
    (256, 64, "worst"),
    (1024, 1, 2.0),
    (1024, 64, 2.0),
    (1024, 256, 2.0),
]
SMOKE_ROWS = [(4, 1, 2.0), (4, 2, 2.0)]

_CHILD = r"""
import json, resource, sys, time
import torch, transformers
from shardwise import ParallelConfig
from shardwise.memory import simulate_step

spec = json.loads(sys.argv[1])
torch.set_num_threads(1)
config = transformers.DeepseekV3Config(use_cache=False, **spec["shape"])
def build():
    return transformers.DeepseekV3ForCausalLM(config)
t0 = time.perf_counter()
report = simulate_step(
    build, ParallelConfig(strategy="full_shard", mixed_precision="bf16", ep=spec["ep"]),
    world=spec["world"], batch=1, seq_len=spec["seq_len"], activation_checkpointing="full",
    expert_load=spec["load"],
)
print(json.dumps({"report": report.to_dict(), "wall_s": round(time.perf_counter() - t0, 1),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def simulate(world: int, ep: int, load: float | str, shape: dict[str, Any], seq_len: int) -> dict:
    spec = {"world": world, "ep": ep, "load": load, "shape": shape, "seq_len": seq_len}
    experts = shape.get("n_routed_experts", 256)
    row: dict[str, Any] = {"world": world, "ep": ep, "expert_load": load, "seq_len": seq_len}
    row["experts_per_rank"] = experts // ep
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        row["error"] = out.stderr[-2000:]
        return row
    row.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return row


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "GiB at the peak:\n"
        "world  ep  experts/rank  load   per-rank peak  gathered  all-gather  reduce-scatter"
        "  activations  temporaries  model states  wall s"
    ]
    for r in rows:
        head = f"{r['world']:>5} {r['ep']:>3}  {r['experts_per_rank']:>12}  {r['expert_load']!s:<5}"
        if "error" in r:
            lines.append(f"{head}  failed: {r['error'][-300:]}")
            continue
        rep = r["report"]
        at = rep["at_peak"]
        lines.append(
            f"{head}  {_gib(rep['peak']):>13}  {_gib(at.get('gathered_params', 0)):>8}  "
            f"{_gib(at.get('all_gather', 0)):>10}  {_gib(at.get('reduce_scatter', 0)):>14}  "
            f"{_gib(at.get('activations', 0)):>11}  {_gib(at.get('temporaries', 0)):>11}  "
            f"{_gib(rep['model_states']):>12}  {r['wall_s']:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny DeepSeek-V3 at world 4")
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    shape, rows_wanted, seq_len = ({}, ROWS, args.seq_len)
    if args.smoke:
        shape, rows_wanted, seq_len = (TINY, SMOKE_ROWS, 16)
    print(table([]), flush=True)
    rows = []
    for world, ep, load in rows_wanted:
        row = simulate(world, ep, load, shape, seq_len)
        print(table([row]).splitlines()[-1], flush=True)
        rows.append(row)
    report = common.dated_header(
        "experts_memory",
        common.command_line("python bench/experts_memory.py", argv or None),
        "simulated on this CPU (fake tensors: nothing allocated)",
    )
    report.update(
        model="DeepseekV3ForCausalLM" + (" (tiny)" if args.smoke else " (default config)"),
        rows=rows,
        bench_wall_s=round(time.perf_counter() - start, 1),
    )
    common.emit_json(report)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
