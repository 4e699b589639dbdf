"""Simulated vs real per-rank peak memory, and the simulation at Llama-3 8B / 70B scale.

1. Simulated vs real (CPU): a GPT at each of `--worlds` gloo world sizes, for each strategy x
   activation checkpointing (none/full) x precision (fp32/bf16). The real run wraps real
   tensors and measures one training step with torch's memory tracker; the simulation runs
   the same step under fake tensors and a fake process group
   (`shardwise.simulate.simulate_step`), measured by the same tracker. Reported: both peaks
   and their ratio. A strategy a world size cannot take (hybrid_shard at world 2) is listed
   as skipped, with the reason `resolve_mesh` gives.
   The same under tensor parallelism: a small Llama with its own plan at tp 2, full_shard
   and no_shard, sequence parallel on and off, AC none and full (fp32).
2. Scale: Llama-3-8B and Llama-3-70B shapes (`transformers.LlamaForCausalLM`, built on meta,
   `use_cache=False` as in training) simulated at `--scale-worlds`, full_shard, bf16, AC full,
   batch 1 x 8192, each in a fresh subprocess: per-rank peak, categories at the peak, wall
   time and peak RSS of that subprocess.
3. torchtitan: the Llama-3-8B shape at world 8, full_shard, bf16, seq 8192, batch 2 and 1,
   AC none and full, to set beside torchtitan's and torchao's published per-GPU peaks
   (selective per-op AC, which is not simulated, lies between AC none and AC full).
4. use_cache: the 70B shape at world 8, AC full, with `use_cache=True` against False (the
   Hugging Face cache keeps every layer's K/V and grows again during the recompute).
5. When tp pays: the 70B shape at world 64 and 512, FSDP alone against tp 8 with and
   without sequence parallel, AC full and none.

Prints text tables, then the JSON report (device, date, commit, command, figures).

    python bench/memory_sim.py                # GPT 4x128 at world 2 and 4; Llama scale
    python bench/memory_sim.py --no-scale     # only simulated vs real
    python bench/memory_sim.py --smoke        # world 2, full_shard, tiny GPT, no Llama
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
from typing import Any

import common
import torch

from shardwise import ParallelConfig
from shardwise.distributed import resolve_mesh
from shardwise.memory import format_bytes, real_step, simulate_step
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, GPTConfig

STRATEGIES = ("ddp", "no_shard", "shard_grad_op", "full_shard", "hybrid_shard")
CONFIGS = [(ac, precision) for ac in ("none", "full") for precision in ("fp32", "bf16")]
GIB = 2**30

# Published per-GPU peaks for Llama 3(.1) 8B on 8 GPUs, FSDP, bf16, seq 8192, per-op SAC.
TORCHTITAN = [
    {
        "source": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (9dec370), Table 1, "
        "row FSDP",
        "setup": "8 x H100 96GB, local batch 2, selective (op) AC, no compile",
        "batch": 2,
        "reserved_gib": 82.4,
    },
    {
        "source": "torchao docs/source/workflows/training.md, e2e training benchmarks, H100, "
        "Llama3-8b none (bfloat16)",
        "setup": "8 x H100, batch 1, torch.compile, per-op SAC",
        "batch": 1,
        "reserved_gib": 47.65,
    },
]


# --------------------------------------------------------------------------- sim vs real


def _real_all(cfg: GPTConfig, configs: list[tuple[str, str, str]], batch: int) -> list[Any]:
    """Every (strategy, ac, precision) in one process group, one after another: a fresh
    model, optimizer and tracker each time, so only the spawn is shared."""
    results: list[Any] = []
    for strategy, ac, precision in configs:
        torch.manual_seed(0)
        config = ParallelConfig(
            strategy=strategy, activation_checkpointing=ac, mixed_precision=precision
        )
        try:
            factory = functools.partial(GPT, cfg)
            results.append(real_step(factory, config, batch=batch, seq_len=cfg.seq_len))
        except Exception as exc:  # a combination torch cannot run on CPU
            results.append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return results


def _skip_reason(strategy: str, world: int) -> str | None:
    try:
        resolve_mesh(strategy, -1, world)
    except ValueError as exc:
        return str(exc).split(". ")[0]
    return None


def compare(cfg: GPTConfig, world: int, batch: int, strategies: tuple[str, ...]) -> list[dict]:
    rows: list[dict[str, Any]] = []
    runnable = []
    for strategy in strategies:
        reason = _skip_reason(strategy, world)
        for ac, precision in CONFIGS:
            row: dict[str, Any] = {
                "world": world,
                "strategy": strategy,
                "ac": ac,
                "precision": precision,
            }
            if reason is not None:
                row["skipped"] = reason
            else:
                runnable.append((strategy, ac, precision))
            rows.append(row)
    t0 = time.perf_counter()
    real_by_rank = run_distributed(_real_all, world, args=(cfg, runnable, batch), timeout_s=1200)
    real_s = time.perf_counter() - t0
    by_config = {c: [rank[i] for rank in real_by_rank] for i, c in enumerate(runnable)}
    for row in rows:
        key = (row["strategy"], row["ac"], row["precision"])
        if key not in by_config:
            continue
        real = by_config[key]
        if any("error" in r for r in real):
            row["error"] = next(r["error"] for r in real if "error" in r)
            continue
        t0 = time.perf_counter()
        try:
            sim = simulate_step(
                functools.partial(GPT, cfg),
                ParallelConfig(strategy=row["strategy"], mixed_precision=row["precision"]),
                world=world,
                batch=batch,
                seq_len=cfg.seq_len,
                activation_checkpointing=row["ac"],
                backend="gloo",  # the real runs reduce over gloo (its reduce-scatter copies)
            )
        except Exception as exc:
            row["error"] = f"simulation: {type(exc).__name__}: {str(exc)[:300]}"
            continue
        row.update(
            real_peak=real[0]["peak"],
            real_peaks_by_rank=[r["peak"] for r in real],
            sim_peak=sim.peak,
            ratio=round(sim.peak / real[0]["peak"], 4),
            sim_s=round(time.perf_counter() - t0, 2),
            sim_at_peak=sim.at_peak,
            real_at_peak=real[0]["at_peak"],
        )
    for row in rows:
        row["real_group_s"] = round(real_s, 1)  # all real configs of this world together
    return rows


# Tensor parallel: a small Llama (its own tp plan), simulated against a real gloo run.
TP_CASES = [
    (strategy, ac, sp)
    for strategy in ("full_shard", "no_shard")
    for ac in ("none", "full")
    for sp in (False, True)
]


def _tiny_llama() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )
    )  # fmt: skip


def _tp_config(strategy: str, ac: str, sp: bool) -> ParallelConfig:
    return ParallelConfig(
        strategy=strategy, tp=2, sequence_parallel=sp, activation_checkpointing=ac
    )


def _real_tp(cases: list[tuple[str, str, bool]], batch: int, seq_len: int) -> list[Any]:
    out: list[Any] = []
    for case in cases:
        torch.manual_seed(0)
        try:
            out.append(real_step(_tiny_llama, _tp_config(*case), batch=batch, seq_len=seq_len))
        except Exception as exc:
            out.append({"error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return out


def compare_tp(world: int, batch: int, seq_len: int = 64) -> list[dict]:
    """Each TP_CASES layout at `world` (tp 2 over world // 2 data-parallel ranks): the real
    peak (every rank) and the simulated one, in one spawned group."""
    cases = TP_CASES if world > 2 else [c for c in TP_CASES if c[0] == "full_shard"]
    t0 = time.perf_counter()
    real_by_rank = run_distributed(_real_tp, world, args=(cases, batch, seq_len), timeout_s=1200)
    real_s = round(time.perf_counter() - t0, 1)
    rows = []
    for i, (strategy, ac, sp) in enumerate(cases):
        row: dict[str, Any] = {"world": world, "tp": 2, "strategy": strategy, "ac": ac, "sp": sp}
        real = [r[i] for r in real_by_rank]
        if any("error" in r for r in real):
            row["error"] = next(r["error"] for r in real if "error" in r)
        else:
            sim = simulate_step(
                _tiny_llama,
                _tp_config(strategy, ac, sp),
                world=world,
                batch=batch,
                seq_len=seq_len,
                backend="gloo",
            )
            row.update(
                real_peak=real[0]["peak"], real_peaks_by_rank=[r["peak"] for r in real],
                sim_peak=sim.peak, ratio=round(sim.peak / real[0]["peak"], 4),
                sim_at_peak=sim.at_peak, real_at_peak=real[0]["at_peak"],
            )  # fmt: skip
        row["real_group_s"] = real_s
        rows.append(row)
    return rows


def compare_tp_table(rows: list[dict]) -> str:
    lines = [
        f"{'world':>5} {'layout':<22} {'AC':<5} {'real peak':>12} {'simulated':>12} {'sim/real':>8}"
    ]
    for r in rows:
        layout = f"{r['strategy']} x tp {r['tp']}{' +sp' if r['sp'] else ''}"
        head = f"{r['world']:>5} {layout:<22} {r['ac']:<5}"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:200]}")
            continue
        lines.append(
            f"{head} {format_bytes(r['real_peak']):>12} {format_bytes(r['sim_peak']):>12} "
            f"{r['ratio']:>8.3f}"
        )
    return "\n".join(lines)


def compare_table(rows: list[dict]) -> str:
    lines = [
        f"{'world':>5} {'strategy':<14} {'AC':<5} {'prec':<5} {'real peak':>12} "
        f"{'sim peak':>12} ratio  ranks equal"
    ]
    skipped_shown = set()
    for r in rows:
        head = f"{r['world']:>5} {r['strategy']:<14} {r['ac']:<5} {r['precision']:<5}"
        if "skipped" in r:
            if (r["world"], r["strategy"]) not in skipped_shown:  # one line for its 4 configs
                skipped_shown.add((r["world"], r["strategy"]))
                lines.append(f"{r['world']:>5} {r['strategy']:<14} skipped: {r['skipped']}")
        elif "error" in r:
            lines.append(f"{head} {r['error']}")
        else:
            equal = len(set(r["real_peaks_by_rank"])) == 1
            flag = "" if 0.95 <= r["ratio"] <= 1.05 else "  <-- outside [0.95, 1.05]"
            lines.append(
                f"{head} {format_bytes(r['real_peak']):>12} {format_bytes(r['sim_peak']):>12} "
                f"{r['ratio']:.4f} {'yes' if equal else 'no':>6}{flag}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- Llama scale

LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
    ),
    "llama3-405b": dict(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
    ),
}

# Runs in a fresh interpreter so its peak RSS is the simulation's alone. The spec comes in
# as JSON in argv[1]; the last stdout line is the JSON result.
_LLAMA_CHILD = """
import json, resource, sys, time
import transformers
from shardwise import ParallelConfig
from shardwise.memory import simulate_step

spec = json.loads(sys.argv[1])
cfg = transformers.LlamaConfig(
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    tie_word_embeddings=False, use_cache=spec["use_cache"], **spec["shape"],
)
def build():
    return transformers.LlamaForCausalLM(cfg)
t0 = time.perf_counter()
r = simulate_step(
    build, ParallelConfig(strategy=spec["strategy"], mixed_precision=spec["precision"],
                          tp=spec["tp"], sequence_parallel=spec["sp"], pp=spec["pp"],
                          pp_microbatches=spec["microbatches"]),
    world=spec["world"], batch=spec["batch"], seq_len=spec["seq_len"],
    activation_checkpointing=spec["ac"],
)
wall = time.perf_counter() - t0
print(json.dumps({"report": r.to_dict(), "wall_s": round(wall, 1),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def llama(
    model: str,
    world: int,
    *,
    batch: int = 1,
    seq_len: int = 8192,
    ac: str = "full",
    strategy: str = "full_shard",
    precision: str = "bf16",
    use_cache: bool = False,
    layers: int | None = None,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    microbatches: int | None = None,
) -> dict[str, Any]:
    """One simulation of a Llama-3 shape in a fresh subprocess."""
    shape = dict(LLAMA_SHAPES[model])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    spec = dict(
        shape=shape,
        world=world,
        batch=batch,
        seq_len=seq_len,
        ac=ac,
        strategy=strategy,
        precision=precision,
        use_cache=use_cache,
        tp=tp,
        sp=sp,
        pp=pp,
        microbatches=microbatches,
    )
    row: dict[str, Any] = {"model": model, **{k: v for k, v in spec.items() if k != "shape"}}
    row["layers"] = shape["num_hidden_layers"]
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _LLAMA_CHILD, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    row["process_s"] = round(time.perf_counter() - t0, 1)  # with interpreter start-up
    if out.returncode != 0:
        row["error"] = out.stderr[-2000:]
        return row
    row.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return row


def _main_categories(at_peak: dict[str, int], top: int = 5) -> str:
    big = sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{k} {v / GIB:.2f}" for k, v in big if v >= 0.01 * GIB)


def llama_table(rows: list[dict]) -> str:
    lines = [
        f"{'model':<11} {'layers':>6} {'world':>5} {'tp':>5} {'batch':>5} {'AC':<5} "
        f"{'cache':<5} {'per-rank peak':>13} {'wall s':>6} {'peak RSS':>10}  at peak (GiB)"
    ]
    for r in rows:
        tp = f"{r.get('tp', 1)}{'+sp' if r.get('sp') else ''}"
        head = (
            f"{r['model']:<11} {r['layers']:>6} {r['world']:>5} {tp:>5} {r['batch']:>5} "
            f"{r['ac']:<5} {r['use_cache']!s:<5}"
        )
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][-300:]}")
            continue
        rep = r["report"]
        over = r["wall_s"] >= 120 or r["peak_rss_bytes"] >= 4 * GIB
        lines.append(
            f"{head} {format_bytes(rep['peak']):>13} {r['wall_s']:>6} "
            f"{format_bytes(r['peak_rss_bytes']):>10}  {_main_categories(rep['at_peak'])}"
            + ("  <-- over 2 min or 4 GiB" if over else "")
        )
    return "\n".join(lines)


def scale(worlds: list[int]) -> dict[str, list[dict]]:
    """The scale table, the torchtitan comparison and the use_cache check."""
    done: dict[str, dict[str, Any]] = {}

    def run(model: str, world: int, **kw: Any) -> dict[str, Any]:
        # A spec asked for twice (with or without its defaults spelled out) runs once.
        kw = {"batch": 1, "ac": "full", "use_cache": False, "layers": None, "tp": 1, "sp": False,
              **kw}  # fmt: skip
        key = json.dumps([model, world, kw], sort_keys=True)
        if key not in done:
            done[key] = llama(model, world, **kw)
            print(llama_table([done[key]]).splitlines()[1], flush=True)
        return done[key]

    print(llama_table([]), flush=True)  # the header; rows follow as they finish
    table = [run(m, w) for m in ("llama3-8b", "llama3-70b") for w in worlds]
    titan = [run("llama3-8b", 8, batch=b, ac=ac) for b in (2, 1) for ac in ("none", "full")]
    cache = [
        run("llama3-70b", 8, layers=8, use_cache=True),
        run("llama3-70b", 8, layers=8, use_cache=False),
        run("llama3-70b", 8, use_cache=True),
        run("llama3-70b", 8, use_cache=False),
    ]
    return {"scale": table, "torchtitan": titan, "use_cache": cache, "tp": tp_scale(run)}


def tp_scale(run: Any) -> list[dict[str, Any]]:
    """When tp pays: the 70B shape at world 64 and 512, FSDP alone against tp 8 (with and
    without sequence parallel), AC full and none, batch 1 x 8192 per data-parallel rank."""
    return [
        run("llama3-70b", world, ac=ac, tp=tp, sp=sp)
        for world in (64, 512)
        for ac in ("full", "none")
        for tp, sp in ((1, False), (8, False), (8, True))
    ]


def pipeline_scale(worlds: tuple[int, ...] = (512, 2048)) -> list[dict[str, Any]]:
    """The Llama-3-405B shape as it was trained (tp 8 inside a node, pipeline stages across
    nodes, FSDP over the rest): world 512 and 2048, tp 8 x pp 8 and 16, 1F1B with pp
    micro-batches of one 8192-token row per data-parallel rank, AC full."""
    rows = []
    for world in worlds:
        for pp in (8, 16):
            row = llama("llama3-405b", world, tp=8, pp=pp, batch=pp, microbatches=pp)
            print(pipeline_table([row]).splitlines()[-1], flush=True)
            rows.append(row)
    return rows


def pipeline_table(rows: list[dict[str, Any]]) -> str:
    lines = ["world  layout              stage peaks (GiB, stage 0 first)  highest  wall s"]
    for r in rows:
        layout = f"pp {r['pp']} x tp 8 x dp {r['world'] // (8 * r['pp'])}"
        if "error" in r:
            lines.append(f"{r['world']:>5}  {layout:<18}  failed: {r['error'][-300:]}")
            continue
        rep = r["report"]
        peaks = " ".join(f"{st['peak'] / GIB:.1f}" for st in rep["stages"])
        lines.append(
            f"{r['world']:>5}  {layout:<18}  {peaks}  {format_bytes(rep['peak'])}  {r['wall_s']}"
        )
    return "\n".join(lines)


def torchtitan_lines(rows: list[dict]) -> list[str]:
    lines = []
    for ref in TORCHTITAN:
        ours = [r for r in rows if r["batch"] == ref["batch"] and "report" in r]
        sims = ", ".join(f"AC {r['ac']} {r['report']['peak'] / GIB:.2f} GiB" for r in ours)
        lines.append(
            f"{ref['reserved_gib']} GiB reserved ({ref['setup']}); simulated allocated at "
            f"batch {ref['batch']}: {sims}"
        )
    return lines


# --------------------------------------------------------------------------- main


# --------------------------------------------------------------------------- estimate

ESTIMATE_STRATEGIES = (*STRATEGIES, "hybrid_shard_zero2")


def _untied_llama(shape: dict[str, int], vocab: int) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
        use_cache=False, **shape,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


SMALL_LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
# name: (factory, world, batch, seq_len, precisions, AC levels)
ESTIMATE_MODELS: dict[str, tuple[Any, int, int, int, tuple[str, ...], tuple[str, ...]]] = {
    "gpt": (
        functools.partial(GPT, GPTConfig(vocab_size=8192, seq_len=256, d_model=256, n_heads=8,
                                         n_layers=6)),
        8, 2, 256, ("fp32", "bf16"), ("none", "full"),
    ),
    "llama-small": (
        functools.partial(_untied_llama, SMALL_LLAMA, 32000), 16, 1, 512, ("fp32", "bf16"),
        ("none", "full"),
    ),
    "llama3-8b": (
        functools.partial(_untied_llama, LLAMA_SHAPES["llama3-8b"], 128256), 16, 1, 2048,
        ("bf16",), ("none", "full"),
    ),
    "llama3-70b": (
        functools.partial(_untied_llama, LLAMA_SHAPES["llama3-70b"], 128256), 32, 1, 4096,
        ("bf16",), ("full",),
    ),
}  # fmt: skip


def estimate_rows(names: list[str]) -> list[dict[str, Any]]:
    """The instant estimate (`shardwise plan` without --simulate) against the simulation,
    for every strategy of each model."""
    from shardwise.memory import InstantPeak

    rows = []
    for name in names:
        factory, world, batch, seq_len, precisions, levels = ESTIMATE_MODELS[name]
        with torch.device("meta"):
            instant = InstantPeak(factory(), world, batch, seq_len)
        for precision in precisions:
            for ac in levels:
                for strategy in ESTIMATE_STRATEGIES:
                    cfg = ParallelConfig(strategy=strategy, activation_checkpointing=ac,
                                         mixed_precision=precision)  # fmt: skip
                    estimate = instant(cfg)
                    sim = simulate_step(factory, cfg, world=world, batch=batch, seq_len=seq_len)
                    rows.append({"model": name, "world": world, "seq_len": seq_len,
                                 "precision": precision, "ac": ac, "strategy": strategy,
                                 "estimate": estimate, "simulated": sim.peak,
                                 "ratio": round(estimate / sim.peak, 3)})  # fmt: skip
                    print(f"{name:<12} {world:>5} {precision:<5} {ac:<5} {strategy:<19} "
                          f"{format_bytes(estimate):>12} {format_bytes(sim.peak):>12} "
                          f"{estimate / sim.peak:6.3f}", flush=True)  # fmt: skip
    return rows


def _emit_rows(name: str, rows: list[dict[str, Any]], argv: list[str] | None, start: float) -> None:
    """The JSON report of a section run alone (--estimate, --pipeline-scale)."""
    common.emit_json(
        {
            "benchmark": name,
            "date": time.strftime("%Y-%m-%d"),
            "commit": common.git_commit() or "unknown",
            "command": common.command_line("python bench/memory_sim.py", argv or None),
            "rows": rows,
            "bench_wall_s": round(time.perf_counter() - start, 1),
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="world 2, full_shard, no Llama")
    parser.add_argument("--worlds", default="2,4", help="comma-separated gloo world sizes")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--scale",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the Llama-3 8B/70B runs (scale table, torchtitan comparison, use_cache check)",
    )
    parser.add_argument("--scale-worlds", default="8,64,512")
    parser.add_argument(
        "--pipeline-scale",
        action="store_true",
        help="only the Llama-3-405B rows at --pipeline-worlds with tp 8 x pp 8/16 (every "
        "stage is simulated: about 20 minutes per world on one core)",
    )
    parser.add_argument("--pipeline-worlds", default="512,2048")
    parser.add_argument(
        "--estimate",
        default=None,
        help="only the instant estimate against the simulation, for these comma-separated "
        f"models (of {', '.join(ESTIMATE_MODELS)}), every strategy",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    if args.estimate:
        print(f"{'model':<12} {'world':>5} {'prec':<5} {'AC':<5} {'strategy':<19} "
              f"{'estimate':>12} {'simulated':>12} {'ratio':>6}")  # fmt: skip
        rows = estimate_rows(args.estimate.split(","))
        _emit_rows("memory_sim/estimate", rows, argv, t_start)
        return 0
    if args.pipeline_scale:
        print("Llama-3-405B: tp 8 x pp 8/16, full_shard, bf16, AC full, seq 8192, 1F1B")
        print(pipeline_table([]), flush=True)
        rows = pipeline_scale(tuple(int(w) for w in args.pipeline_worlds.split(",")))
        _emit_rows("memory_sim/pipeline_scale", rows, argv, t_start)
        return 0

    strategies: tuple[str, ...]
    if args.smoke:
        cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
        worlds, strategies, batch, do_scale = [2], ("full_shard",), 2, False
    else:
        cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4)
        worlds = [int(w) for w in args.worlds.split(",")]
        strategies, batch, do_scale = STRATEGIES, args.batch, args.scale
    rows: list[dict] = []
    for world in worlds:
        rows += compare(cfg, world, batch, strategies)
    print(f"simulated vs real, GPT {cfg}, batch {batch} per rank")
    print(compare_table(rows), flush=True)
    tp_rows = [row for world in worlds for row in compare_tp(world, batch)]
    print(f"\nsimulated vs real under tensor parallelism, Llama 4x128, batch {batch} x seq 64")
    print(compare_tp_table(tp_rows), flush=True)
    report: dict[str, Any] = {
        "benchmark": "memory_sim",
        "device": f"{platform.processor() or platform.machine()} CPU, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "commit": common.git_commit() or "unknown",
        "command": common.command_line("python bench/memory_sim.py", argv or None),
        "gpt": str(cfg),
        "worlds": worlds,
        "batch": batch,
        "rows": rows,
        "tp_rows": tp_rows,
    }
    if do_scale:
        print("\nLlama-3 shapes: full_shard, bf16, seq 8192 (use_cache False unless said)")
        big = scale([int(w) for w in args.scale_worlds.split(",")])
        report.update(big)
        report["torchtitan_published"] = TORCHTITAN
        print("\ntorchtitan / torchao, Llama 3 8B, 8 GPUs, FSDP, bf16, seq 8192, per-op SAC:")
        print("\n".join(torchtitan_lines(big["torchtitan"])))
        print("\nWhen tp pays: Llama-3-70B, FSDP alone against tp 8 (batch 1 x 8192 per dp rank)")
        print(llama_table(big["tp"]))
    report["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    report["bench_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    common.emit_json(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
