"""Context parallel (Ulysses) against the hand-written torch it replaces, with the same split.

One transformers Llama, trained with each rank of a cp group holding 1/cp of every
sequence, two ways in the same run:

- **shardwise**: `shardwise.wrap(model, ParallelConfig(cp=cp))`, called with whole rows
  (its hook cuts them);
- **handwritten**: a `(dp_shard, cp)` device mesh flattened into one dimension, `fully_shard`
  on each decoder layer and the root over it, the batch cut by hand (global positions,
  labels shifted before the cut, the valid-label count over cp as `num_items_in_batch`),
  and an attention function of this file's own registered with transformers: the same
  all-to-all of heads (torch's autograd `all_to_all_single`) around SDPA.

Step time: both variants built in each rank and stepped alternately (seeded order, the
same on every rank), after a barrier; a step's time is the slowest rank's, and the figure is
the median. Peak memory on CPU: each variant in its own freshly spawned ranks, peak RSS
minus RSS before the build, the largest rank (bench/overhead.py says how). The losses of
the two variants are reported: they must agree.

    python bench/context.py                        # world 2 (cp 2) and 4 (cp 2 x dp 2)
    python bench/context.py --smoke                # tiny: seconds
    python bench/context.py --scale                # Llama-3-8B at 128k tokens, simulated

--scale: the Llama-3-8B shape (transformers, built on meta, use_cache=False) at 131,072
tokens a row, one row per data-parallel rank, full_shard, bf16, AdamW, full activation
checkpointing, simulated (`simulate_step`, fake tensors and a fake process group; each in a
fresh subprocess) at 8 and 64 ranks with and without cp: each rank's peak and activations.

Prints one JSON object on stdout (and --out).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardwise
from shardwise.testing import run_distributed

KINDS = ("shardwise", "handwritten")
HAND = "bench_handwritten_ulysses"


@dataclass(frozen=True)
class BenchConfig:
    world: int
    cp: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    seq: int
    rows: int
    """Rows of the global batch: world // cp data-parallel ranks share them."""
    vocab: int
    steps: int
    warmup: int
    timeout_s: float


def build(cfg: BenchConfig) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=4 * cfg.hidden,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def batch(cfg: BenchConfig, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, cfg.vocab, (cfg.rows, cfg.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


# --- the hand-written variant -------------------------------------------------------------

_GROUP: list[Any] = [None]


def _a2a(x: torch.Tensor) -> torch.Tensor:
    out = all_to_all_single_autograd(x.contiguous().flatten(), None, None, _GROUP[0])
    return out.view(x.shape)


def _handwritten_attention(module, q, k, v, mask, dropout=0.0, scaling=None, **_):  # type: ignore[no-untyped-def]
    cp = dist.get_world_size(_GROUP[0])
    b, _, s, d = q.shape
    if k.shape[1] % cp:
        times = cp // math.gcd(k.shape[1], cp)
        k, v = k.repeat_interleave(times, 1), v.repeat_interleave(times, 1)

    def gather(t: torch.Tensor) -> torch.Tensor:  # heads out, sequence in
        heads = t.shape[1]
        got = _a2a(t.reshape(b, cp, heads // cp, s, d).transpose(0, 1))
        return got.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * s, d)

    qg, kg, vg = gather(q), gather(k), gather(v)
    out = F.scaled_dot_product_attention(
        qg, kg, vg, is_causal=True, scale=scaling, enable_gqa=kg.shape[1] != qg.shape[1]
    )
    hl = out.shape[1]
    back = _a2a(out.reshape(b, hl, cp, s, d).permute(2, 0, 1, 3, 4))
    return back.transpose(0, 1).reshape(b, cp * hl, s, d).transpose(1, 2).contiguous(), None


def handwritten(cfg: BenchConfig) -> tuple[nn.Module, Any]:
    import transformers

    dp = cfg.world // cfg.cp
    mesh = init_device_mesh("cpu", (dp, cfg.cp), mesh_dim_names=("dp_shard", "cp"))
    _GROUP[0] = mesh["cp"].get_group()
    shard = mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
    model = build(cfg)
    transformers.AttentionInterface.register(HAND, _handwritten_attention)
    model.set_attn_implementation(HAND)
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard)
    fully_shard(model, mesh=shard)
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    dp_rank, cp_rank = coordinate
    per, chunk = cfg.rows // dp, cfg.seq // cfg.cp

    def rows(whole: dict[str, torch.Tensor]) -> dict[str, Any]:
        ids = whole["input_ids"][dp_rank * per : (dp_rank + 1) * per]
        labels = whole["labels"][dp_rank * per : (dp_rank + 1) * per]
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        count = (shifted != -100).sum()
        cut = slice(cp_rank * chunk, (cp_rank + 1) * chunk)
        positions = torch.arange(cfg.seq).expand(per, cfg.seq)
        mine = shifted[:, cut].contiguous()
        return {
            "input_ids": ids[:, cut].contiguous(),
            "position_ids": positions[:, cut].contiguous(),
            "labels": mine,
            "shift_labels": mine,
            "num_items_in_batch": count / cfg.cp,
        }

    return model, rows


def with_shardwise(cfg: BenchConfig) -> tuple[nn.Module, Any]:
    model = shardwise.wrap(build(cfg), shardwise.ParallelConfig(cp=cfg.cp))
    info = shardwise.wrap_info(model)
    assert info is not None
    per = cfg.rows // info.dp_size

    def rows(whole: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {k: v[info.dp_rank * per : (info.dp_rank + 1) * per] for k, v in whole.items()}

    return model, rows


def _stepper(model: nn.Module, rows: Any, cfg: BenchConfig) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = [0]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(**rows(batch(cfg, counter[0]))).loss
        loss.backward()
        opt.step()
        counter[0] += 1
        return shardwise.mean_across_ranks(loss.detach())

    return step


def _timing_rank(cfg: BenchConfig) -> dict[str, Any]:
    variants = {"shardwise": with_shardwise(cfg), "handwritten": handwritten(cfg)}
    steps = {k: _stepper(*v, cfg) for k, v in variants.items()}
    rng = random.Random(0)
    orders = [rng.sample(KINDS, 2) for _ in range(cfg.warmup + cfg.steps)]
    times, last = common.timed_rounds(steps, orders, warmup=cfg.warmup, barrier=True)
    return {"times": times, "loss": last}


def _memory_rank(cfg: BenchConfig, kind: str) -> dict[str, int]:
    common.pin_malloc_thresholds()
    gc.collect()
    common.reset_rss_peak()
    before = common.rss_peak_bytes()
    model, rows = with_shardwise(cfg) if kind == "shardwise" else handwritten(cfg)
    step = _stepper(model, rows, cfg)
    for _ in range(2):
        step()
    peak = common.rss_peak_bytes()
    return {"peak_bytes": peak, "delta_bytes": peak - before}


def run(cfg: BenchConfig) -> dict[str, Any]:
    ranks = run_distributed(_timing_rank, cfg.world, args=(cfg,), timeout_s=cfg.timeout_s)
    median, slowest = {}, {}
    for kind in KINDS:
        median[kind], slowest[kind] = common.median_slowest_rank([r["times"][kind] for r in ranks])
    memory = {
        kind: run_distributed(_memory_rank, cfg.world, args=(cfg, kind), timeout_s=cfg.timeout_s)
        for kind in KINDS
    }
    delta = {k: max(m["delta_bytes"] for m in memory[k]) for k in KINDS}
    return {
        "layout": f"cp {cfg.cp} x dp {cfg.world // cfg.cp} (full_shard over dp x cp)",
        "median_step_s": median,
        "step_time_ratio": common.ratio(median["shardwise"], median["handwritten"]),
        "paired_step_time_ratio_median": sorted(
            common.paired_ratios(slowest["shardwise"], slowest["handwritten"])
        )[len(slowest["shardwise"]) // 2],
        "peak_rss_delta_MiB": {k: common.mib(v) for k, v in delta.items()},
        "memory_ratio": common.ratio(delta["shardwise"], delta["handwritten"]),
        "final_loss": ranks[0]["loss"],
    }


_SCALE_CHILD = """
import json, sys, time
import transformers
from shardwise import ParallelConfig
from shardwise.memory import simulate_step

spec = json.loads(sys.argv[1])
cfg = transformers.LlamaConfig(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=spec["seq"],
    rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
)
def build():
    return transformers.LlamaForCausalLM(cfg)
t0 = time.perf_counter()
r = simulate_step(
    build, ParallelConfig(mixed_precision="bf16", cp=spec["cp"]), world=spec["world"],
    batch=1, seq_len=spec["seq"], activation_checkpointing="full",
)
wall = round(time.perf_counter() - t0, 1)
print(json.dumps({"peak": r.peak, "at_peak": r.at_peak, "wall_s": wall}))
"""
SCALE = ((8, 1), (8, 2), (8, 4), (8, 8), (64, 1), (64, 8))
GIB = 2**30


def scale(seq: int, timeout_s: float) -> list[dict[str, Any]]:
    import json
    import subprocess
    import sys

    rows = []
    for world, cp in SCALE:
        spec = {"world": world, "cp": cp, "seq": seq}
        out = subprocess.run(
            [sys.executable, "-c", _SCALE_CHILD, json.dumps(spec)], capture_output=True,
            text=True, timeout=timeout_s, env=common.child_env({}),
        )  # fmt: skip
        if out.returncode != 0:
            rows.append({**spec, "error": out.stderr[-1500:]})
            continue
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({
            **spec, "peak_GiB": round(got["peak"] / GIB, 2),
            "activations_GiB": round(got["at_peak"].get("activations", 0) / GIB, 2),
            "temporaries_GiB": round(got["at_peak"].get("temporaries", 0) / GIB, 2),
            "wall_s": got["wall_s"],
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--worlds", default="2,4", help="world sizes, cp 2 each")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 steps")
    parser.add_argument("--scale", action="store_true", help="Llama-3-8B at 128k, simulated")
    parser.add_argument("--scale-seq", type=int, default=131072)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    base = BenchConfig(
        world=2, cp=args.cp, hidden=args.hidden, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, seq=args.seq, rows=2, vocab=args.vocab, steps=args.steps,
        warmup=args.warmup, timeout_s=args.timeout_s,
    )  # fmt: skip
    if args.smoke:
        base = dataclasses.replace(
            base, hidden=32, layers=1, heads=4, seq=32, vocab=64, steps=2, warmup=1
        )
    header = common.report_header("context", common.command_line("bench/context.py"))
    if args.scale:
        common.emit_json({**header, "scale": scale(args.scale_seq, args.timeout_s)},
                         None if args.out is None else Path(args.out))  # fmt: skip
        return
    results = {}
    for world in (int(w) for w in args.worlds.split(",")):
        cfg = dataclasses.replace(base, world=world, rows=2 * (world // base.cp))
        results[f"world{world}"] = run(cfg)
    config = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("world", "rows")}
    common.emit_json(
        {**header, "config": config, "results": results},
        None if args.out is None else Path(args.out),
    )


if __name__ == "__main__":
    main()
