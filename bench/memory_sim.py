"""Simulated vs real per-rank peak memory, and the simulation at Llama-3-8B scale.

1. Simulated vs real (CPU): a GPT at `--world` gloo ranks, for each strategy x activation
   checkpointing (none/full) x precision (fp32/bf16). The real run wraps real tensors and
   measures one training step with torch's memory tracker; the simulation runs the same
   step under fake tensors and a fake process group (`shardwise.simulate.simulate_step`),
   measured by the same tracker. Reported: both peaks and their ratio.
2. Scale: a Llama-3-8B-shaped `transformers.LlamaForCausalLM` (built on meta) simulated at
   world 8, full_shard, bf16, in a fresh subprocess: its wall time and peak RSS.

Prints a text table, then the JSON report (device, date, commit, command, figures).

    python bench/memory_sim.py            # GPT 4x128, world 2; Llama-3-8B at world 8
    python bench/memory_sim.py --smoke    # one strategy, no Llama
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shardwise import ParallelConfig
from shardwise.memory import format_bytes
from shardwise.models import GPT, GPTConfig
from shardwise.simulate import real_step, simulate_step
from shardwise.testing import run_distributed

STRATEGIES = ("ddp", "no_shard", "shard_grad_op", "full_shard")


def _git() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _real(cfg: GPTConfig, strategy: str, ac: str, precision: str, batch: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = ParallelConfig(
        strategy=strategy, activation_checkpointing=ac, mixed_precision=precision
    )
    return real_step(functools.partial(GPT, cfg), config, batch=batch, seq_len=cfg.seq_len)


def compare(cfg: GPTConfig, world: int, batch: int, strategies: tuple[str, ...]) -> list[dict]:
    rows = []
    for strategy in strategies:
        for ac in ("none", "full"):
            for precision in ("fp32", "bf16"):
                row: dict[str, Any] = {"strategy": strategy, "ac": ac, "precision": precision}
                try:
                    real = run_distributed(
                        _real, world, args=(cfg, strategy, ac, precision, batch), timeout_s=300
                    )
                    t0 = time.perf_counter()
                    sim = simulate_step(
                        functools.partial(GPT, cfg),
                        ParallelConfig(strategy=strategy, mixed_precision=precision),
                        world=world,
                        batch=batch,
                        seq_len=cfg.seq_len,
                        activation_checkpointing=ac,
                    )
                    row.update(
                        real_peak=real[0]["peak"],
                        real_peaks_by_rank=[r["peak"] for r in real],
                        sim_peak=sim.peak,
                        ratio=round(sim.peak / real[0]["peak"], 4),
                        sim_s=round(time.perf_counter() - t0, 2),
                        sim_at_peak=sim.at_peak,
                        real_at_peak=real[0]["at_peak"],
                    )
                except Exception as exc:  # a combination torch cannot run on CPU
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                rows.append(row)
    return rows


_LLAMA_CHILD = """
import functools, json, resource, time
import transformers
from shardwise import ParallelConfig
from shardwise.simulate import simulate_step

cfg = transformers.LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    rope_theta=500000.0, tie_word_embeddings=False,
)
def build():
    return transformers.LlamaForCausalLM(cfg)
t0 = time.perf_counter()
r = simulate_step(build, ParallelConfig(strategy={strategy!r}, mixed_precision="bf16"),
                  world={world}, batch={batch}, seq_len={seq_len}, activation_checkpointing={ac!r})
wall = time.perf_counter() - t0
print(json.dumps({{"report": r.to_dict(), "wall_s": round(wall, 1),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def llama(world: int, batch: int, seq_len: int, strategy: str, ac: str) -> dict[str, Any]:
    code = _LLAMA_CHILD.format(world=world, batch=batch, seq_len=seq_len, strategy=strategy, ac=ac)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def table(rows: list[dict]) -> str:
    lines = [f"{'strategy':<14} {'AC':<5} {'prec':<5} {'real peak':>12} {'sim peak':>12} ratio"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['strategy']:<14} {r['ac']:<5} {r['precision']:<5} {r['error']}")
            continue
        lines.append(
            f"{r['strategy']:<14} {r['ac']:<5} {r['precision']:<5} "
            f"{format_bytes(r['real_peak']):>12} {format_bytes(r['sim_peak']):>12} "
            f"{r['ratio']:.4f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny, one strategy, no Llama")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--llama-world", type=int, default=8)
    parser.add_argument("--llama-seq", type=int, default=8192)
    parser.add_argument("--llama-ac", default="full")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    if args.smoke:
        cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
        rows = compare(cfg, args.world, 2, ("full_shard",))
    else:
        cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4)
        rows = compare(cfg, args.world, args.batch, STRATEGIES)
    print(f"simulated vs real, world {args.world}, GPT {cfg}")
    print(table(rows))
    report: dict[str, Any] = {
        "benchmark": "memory_sim",
        "device": f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "commit": _git(),
        "command": " ".join(["python", "bench/memory_sim.py", *(argv or sys.argv[1:])]),
        "gpt": str(cfg),
        "world": args.world,
        "rows": rows,
    }
    if not args.smoke:
        big = llama(args.llama_world, 1, args.llama_seq, "full_shard", args.llama_ac)
        report["llama3_8b"] = big
        if "report" in big:
            r = big["report"]
            print(
                f"\nLlama-3-8B shape, world {args.llama_world}, full_shard, bf16, AC "
                f"{args.llama_ac}, batch 1 x {args.llama_seq}: per-rank peak "
                f"{format_bytes(r['peak'])} in {big['wall_s']} s, peak RSS "
                f"{format_bytes(big['peak_rss_bytes'])}"
            )
        else:
            print("\nLlama-3-8B simulation failed: " + big["error"][-500:])
    report["bench_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
