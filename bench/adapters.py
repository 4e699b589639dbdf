"""Adapters (peft's LoRA) against full fine-tuning: a ~320M Llama at world 2 (full_shard,
fp32, AdamW, CPU/gloo).

1. Per-rank peak memory of one training step, LoRA (r=16 on every linear of the decoder
   layers) and full fine-tuning: the real run (torch's memory tracker over real tensors,
   `shardwise.memory.real_step`) and the simulation (`shardwise.simulate_step`, fake
   tensors and a fake process group) of the same gloo job, with their ratio; and the
   simulation of an nccl (GPU) job, whose reduce-scatter holds no copy of its input.
2. LoRA under gradient accumulation (4 micro-batches per optimizer step, through the
   Engine), with and without `TrainConfig.keep_frozen_gathered`: all-gathers per optimizer
   step (counted at torch.distributed's Python entry points, which FSDP2 calls), the
   per-rank peak over the window (torch's FSDPMemTracker), and the window's wall time.

Prints text tables, then the JSON report (device, date, commit, command, figures).

    python bench/adapters.py            # ~320M Llama, batch 1 x 128 per rank
    python bench/adapters.py --smoke    # a tiny Llama
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import common
import torch

from shardwise import Engine, ParallelConfig, TrainConfig
from shardwise.memory import format_bytes, real_step, simulate_step
from shardwise.testing import count_collectives, run_distributed

WORLD, ACCUMULATE = 2, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES = {
    "full": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                 num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=16),
    "smoke": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4),
}  # fmt: skip


def build(size: str, lora: bool) -> torch.nn.Module:
    import peft
    import transformers

    config = transformers.LlamaConfig(**SIZES[size], use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    if not lora:
        return model
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))


def _config() -> ParallelConfig:
    return ParallelConfig(strategy="full_shard")


def _real(size: str, seq: int) -> dict[str, Any]:
    """Every rank: one tracked step of each model, then LoRA's accumulation windows."""
    out: dict[str, Any] = {}
    for kind in ("full", "lora"):
        torch.manual_seed(0)
        factory = functools.partial(build, size, kind == "lora")
        out[kind] = real_step(factory, _config(), batch=1, seq_len=seq)
        out[kind]["params"] = sum(p.numel() for p in factory().parameters())
    for keep in (False, True):
        out[f"keep={keep}"] = _window(size, seq, keep)
    return out


def _window(size: str, seq: int, keep: bool) -> dict[str, Any]:
    """One optimizer step of 4 micro-batches (the second window: the optimizer state
    exists), its all-gathers, the peak over it and its wall time."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    torch.manual_seed(0)
    train = TrainConfig(accumulate_steps=ACCUMULATE, keep_frozen_gathered=keep)
    engine = Engine(build(size, lora=True), _adamw, _config(), train=train)
    vocab = SIZES[size]["vocab_size"]
    micro = [torch.randint(0, vocab, (1, seq)) for _ in range(ACCUMULATE)]

    def window(tracker: Any = None) -> None:
        for ids in micro:
            engine.train_step({"input_ids": ids, "labels": ids})
            if tracker is not None:  # it follows one forward per module; its peak stays
                tracker.reset_mod_stats()

    window()  # the first window creates the optimizer state
    tracker = FSDPMemTracker(engine.model, engine.optimizer)
    tracker.track_inputs(tuple(micro))
    start = time.perf_counter()
    with tracker, count_collectives() as counted:
        window(tracker)
    seconds = time.perf_counter() - start
    peak = tracker.get_tracker_snapshot("peak")
    total = sum(int(dev.get("Total", 0)) for dev in peak.values())
    gathers = counted["all_gather_single"] + counted["all_gather_into_tensor"]
    return {"all_gathers": gathers, "peak": total, "seconds": round(seconds, 2)}


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4)


def run(size: str, seq: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    t0 = time.perf_counter()
    real = run_distributed(_real, WORLD, args=(size, seq), timeout_s=3600)
    real_s = round(time.perf_counter() - t0, 1)
    rows = []
    for kind in ("full", "lora"):
        factory = functools.partial(build, size, kind == "lora")
        # The real run reduces over gloo, whose reduce-scatter copies its input: simulated
        # the same way; nccl (a GPU job) is the simulation's default, listed beside it.
        sim = simulate_step(factory, _config(), world=WORLD, batch=1, seq_len=seq, backend="gloo")
        gpu = simulate_step(factory, _config(), world=WORLD, batch=1, seq_len=seq)
        mine = real[0][kind]
        rows.append(
            {
                "kind": kind,
                "params": mine["params"],
                "real_peak": mine["peak"],
                "real_peaks_by_rank": [r[kind]["peak"] for r in real],
                "sim_peak": sim.peak,
                "sim_over_real": round(sim.peak / mine["peak"], 4),
                "sim_peak_nccl": gpu.peak,
                "real_at_peak": mine["at_peak"],
                "sim_at_peak": sim.at_peak,
            }
        )
    windows = {f"keep_frozen_gathered={keep}": real[0][f"keep={keep}"] for keep in (False, True)}
    return {"steps": rows, "accumulation": windows, "real_group_s": real_s}


def table(result: dict[str, Any], seq: int) -> str:
    lines = [
        f"one step, world {WORLD}, full_shard, fp32, AdamW, batch 1 x {seq} per rank",
        f"{'':<6} {'params':>12} {'real (gloo)':>12} {'sim (gloo)':>12} {'sim/real':>9} "
        f"{'sim (nccl)':>12}",
    ]
    for r in result["steps"]:
        lines.append(
            f"{r['kind']:<6} {r['params']:>12,} {format_bytes(r['real_peak']):>12} "
            f"{format_bytes(r['sim_peak']):>12} {r['sim_over_real']:>9.4f} "
            f"{format_bytes(r['sim_peak_nccl']):>12}"
        )
    lines.append(f"\nLoRA, accumulation {ACCUMULATE} (one optimizer step, Engine)")
    lines.append(f"{'keep_frozen_gathered':<22} {'all-gathers':>11} {'peak':>12} {'seconds':>8}")
    for name, w in result["accumulation"].items():
        keep = name.split("=")[1]
        lines.append(
            f"{keep:<22} {w['all_gathers']:>11} {format_bytes(w['peak']):>12} {w['seconds']:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama (seconds)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per rank per micro-batch")
    args = parser.parse_args()
    size, seq = ("smoke", 16) if args.smoke else ("full", args.seq)
    result = run(size, seq)
    print(table(result, seq))
    header = common.dated_header(
        "adapters", common.command_line("python bench/adapters.py"),
        common.device_description("cpu", WORLD),
    )  # fmt: skip
    common.emit_json({**header, "size": size, "seq": seq, **result})


if __name__ == "__main__":
    main()
