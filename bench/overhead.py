"""Overhead of `shardwise.wrap` against the hand-written torch it replaces.

Measures, for each layout (ddp, full_shard; tp and pp on request), one GPT and one
parallel plan trained two ways in the same run:

- **shardwise**: `shardwise.wrap(model, ParallelConfig(strategy=..., auto_wrap_policy={Block}))`;
- **handwritten**: `DistributedDataParallel(model)`, or `fully_shard(block, mesh=...)` for each
  block then `fully_shard(model, reshard_after_forward=False)` — the plan shardwise makes.
- `tp` (tp 2 × dp world/2): shardwise with `tp=2` and a tp_plan over each block's MLP,
  against `parallelize_module` with the same ColwiseParallel/RowwiseParallel styles
  and then the same `fully_shard` calls over the data-parallel dimension.
- `pp` (pp 2 × dp world/2, 1F1B, 2 micro-batches, embeddings untied): shardwise's
  `pipeline_step`, against a stage module written by hand (this rank's blocks, the
  embeddings on the first stage, the norm and head on the last) under `fully_shard`,
  `PipelineStage` and `Schedule1F1B` with a cross-entropy `loss_fn`.

Step time: both variants are built in each rank and stepped alternately (the order within
each pair is drawn from a seeded RNG, the same on every rank), after a barrier, timed with
`time.perf_counter` (plus `torch.cuda.synchronize` on GPU). A step's time is the slowest
rank's; the figure is the median over steps, and the ratio is shardwise / handwritten.

Peak memory: on CUDA, `max_memory_allocated` minus `memory_allocated` before the variant is
built, for build + a few steps, one variant at a time. On CPU there is no allocator peak
counter and a process's peak RSS never goes down, so each variant is built and trained in
its own freshly spawned ranks. Each pins glibc's mmap threshold (so freed tensors leave
RSS at once), restarts the kernel's peak-RSS count just before building the model
(/proc/self/clear_refs), and reports peak RSS (VmHWM; `ru_maxrss` where /proc is missing)
minus the RSS at that point. The largest rank counts. Both the delta ratio (the meaningful
one) and the raw peak ratio are reported.

Run from the repository root:

    python bench/overhead.py                      # ddp + full_shard, world 2 (gloo on CPU)
    python bench/overhead.py --smoke              # tiny model, a few steps: seconds
    python bench/overhead.py --strategies full_shard --precision bf16 --out overhead.json
    python bench/overhead.py --device cuda --world 1   # one GPU: in-process, force_wrap
    python bench/overhead.py --strategies tp,pp   # tensor and pipeline parallel, world 2

Run it directly, not under torchrun: it spawns its own ranks (`shardwise.testing`).

Prints one JSON object on stdout (and writes it to --out), a summary line per strategy on
stderr. Ratios, not absolute times, are the figures to compare on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import common
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import shardwise
from shardwise.testing import run_distributed
from shardwise.testing.models import GPT, Block, GPTConfig

Kind = Literal["shardwise", "handwritten"]
KINDS: tuple[Kind, Kind] = ("shardwise", "handwritten")
STRATEGIES = ("ddp", "full_shard")
LAYOUTS = (*STRATEGIES, "tp", "pp")
"""What --strategies takes: the two default strategies, and tp 2 or pp 2 with full_shard."""
TP_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
"""The GPT's MLPs split over tp (its fused qkv projection splits q, k and v by width, which
a column split would cut across)."""
MICROBATCHES = 2
TARGETS = {"step_time_ratio": 1.01, "memory_ratio": 1.005}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything a rank needs; picklable, so it travels to spawned ranks."""

    strategies: tuple[str, ...]
    world: int
    device: str
    precision: str
    policy: str
    """shardwise's auto_wrap_policy: 'block' ({Block}) or 'auto' (found by the planner)."""
    steps: int
    """Timed steps per variant."""
    warmup: int
    """Untimed steps per variant before timing."""
    mem_steps: int
    """Steps per variant in the peak-memory measurement."""
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    """Sequences per rank per step."""
    vocab: int
    seed: int
    timeout_s: float

    @property
    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
        )

    def model_config(self, strategy: str) -> GPTConfig:
        # Under pp the tie would span the two stages, whose gradient sum hand-written torch
        # would have to write itself: both variants train the untied GPT.
        return dataclasses.replace(self.gpt, tie_embeddings=strategy != "pp")


@dataclass
class _Variant:
    """One trainable copy of the model: wrapped one way, with its own optimizer."""

    kind: Kind
    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast_dtype: torch.dtype | None
    """Set where the step itself must enter autocast (hand-written DDP in bf16)."""
    forward_backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    """A step's forward and backward where it is not model(x, y).backward() (pipelines)."""


# --- building the two variants ------------------------------------------------------


def _build_model(cfg: BenchConfig, strategy: str = "full_shard") -> GPT:
    torch.manual_seed(cfg.seed)  # both variants start from the same weights
    return GPT(cfg.model_config(strategy))


def _wrap_shardwise(model: nn.Module, strategy: str, cfg: BenchConfig) -> nn.Module:
    layout: dict[str, Any] = {"strategy": strategy}
    if strategy == "tp":
        layout = {"strategy": "full_shard", "tp": 2, "tp_plan": TP_PLAN}
    elif strategy == "pp":
        layout = {"strategy": "full_shard", "pp": 2, "pp_microbatches": MICROBATCHES}
    config = shardwise.ParallelConfig(
        **layout,
        auto_wrap_policy={Block} if cfg.policy == "block" else cfg.policy,
        mixed_precision=cfg.precision,
        # At world 1 wrap() would hand the model back unwrapped; force the strategy.
        force_wrap=dist.get_world_size() == 1,
    )
    return shardwise.wrap(model, config)


def _mp_policy(precision: str) -> MixedPrecisionPolicy:
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _wrap_handwritten(
    model: GPT, strategy: str, cfg: BenchConfig, device: torch.device
) -> nn.Module:
    model.to(device)
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    if strategy == "tp":
        mesh2 = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
        for block in model.blocks:
            plan = {k.removeprefix("blocks.*."): styles[v] for k, v in TP_PLAN.items()}
            parallelize_module(block, mesh2["tp"], plan)
        mesh = mesh2["dp"]
    _shard(model, mesh, cfg)
    return model


def _shard(model: nn.Module, mesh: Any, cfg: BenchConfig) -> None:
    mp_policy = _mp_policy(cfg.precision)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    # The root's parameters are needed again at the start of backward: keep them gathered.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)


class _HandStage(nn.Module):
    """One pipeline stage of the GPT, written by hand: this rank's blocks, with the
    embeddings on the first stage and the final norm and head on the last."""

    def __init__(self, gpt: GPT, index: int, stages: int) -> None:
        super().__init__()
        per = len(gpt.blocks) // stages
        self.first, self.last = index == 0, index == stages - 1
        self.blocks = nn.ModuleList(gpt.blocks[index * per : (index + 1) * per])
        if self.first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def _handwritten_pipeline(model: GPT, cfg: BenchConfig, device: torch.device) -> _Variant:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
    index = mesh["pp"].get_local_rank()
    stage = _HandStage(model, index, 2).to(device)
    _shard(stage, mesh["dp"], cfg)

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    pipe = PipelineStage(stage, index, 2, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, MICROBATCHES, loss_fn=loss_fn)

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if index == 0:
            schedule.step(x)
            return torch.zeros(())
        schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean()

    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    return _Variant("handwritten", stage, optimizer, None, forward_backward)


def _make_variant(kind: Kind, strategy: str, cfg: BenchConfig, device: torch.device) -> _Variant:
    model = _build_model(cfg, strategy)
    if strategy == "pp" and kind == "handwritten":
        return _handwritten_pipeline(model, cfg, device)
    if strategy == "pp":
        wrapped = _wrap_shardwise(model, strategy, cfg)
        optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)

        def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return shardwise.pipeline_step(wrapped, (x, y))

        return _Variant(kind, wrapped, optimizer, None, forward_backward)
    if kind == "shardwise":
        wrapped, autocast = _wrap_shardwise(model, strategy, cfg), None
    else:
        wrapped = _wrap_handwritten(model, strategy, cfg, device)
        # shardwise puts DDP's forward under autocast; FSDP2 casts through mp_policy.
        use_autocast = strategy == "ddp" and cfg.precision == "bf16"
        autocast = torch.bfloat16 if use_autocast else None
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    return _Variant(kind, wrapped, optimizer, autocast)


def _local_numel(model: nn.Module) -> int:
    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )


# --- stepping -------------------------------------------------------------------------


def _batch(
    cfg: BenchConfig, device: torch.device, strategy: str = "ddp"
) -> tuple[torch.Tensor, torch.Tensor]:
    # The ranks of one tp group, or of one pipeline, read the same rows.
    rank = dist.get_rank() // 2 if strategy in ("tp", "pp") else dist.get_rank()
    if strategy == "pp":
        rank = dist.get_rank() % (dist.get_world_size() // 2)
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + rank)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=gen)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _train_step(v: _Variant, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    v.optimizer.zero_grad(set_to_none=True)
    if v.forward_backward is not None:
        loss = v.forward_backward(x, y)
        v.optimizer.step()
        return loss.detach()
    ctx = (
        torch.autocast(x.device.type, dtype=v.autocast_dtype)
        if v.autocast_dtype is not None
        else contextlib.nullcontext()
    )
    with ctx:
        loss = v.model(x, y)
    loss.backward()
    v.optimizer.step()
    return loss.detach()


def _pair_orders(seed: int, pairs: int) -> list[tuple[Kind, ...]]:
    """Which variant goes first in each pair; seeded, so every rank agrees."""
    rng = random.Random(seed)
    return [KINDS if rng.random() < 0.5 else KINDS[::-1] for _ in range(pairs)]


def _time_strategy(strategy: str, cfg: BenchConfig, device: torch.device) -> dict[str, Any]:
    """Both variants stepped alternately; this rank's per-step times for each."""
    params = _build_model(cfg, strategy).num_params()
    variants = {kind: _make_variant(kind, strategy, cfg, device) for kind in KINDS}
    batch = _batch(cfg, device, strategy)
    # Each step after a barrier: every rank starts it together, whichever variant ran before.
    times, last_loss = common.timed_rounds(
        {kind: functools.partial(_train_step, v, batch) for kind, v in variants.items()},
        _pair_orders(cfg.seed, cfg.warmup + cfg.steps),
        warmup=cfg.warmup,
        barrier=True,
        device=device,
    )
    return {
        "params": params,
        "local_params": {kind: _local_numel(v.model) for kind, v in variants.items()},
        "final_loss": {kind: float(last_loss[kind]) for kind in KINDS},
        "step_times_s": times,
    }


# --- peak memory ------------------------------------------------------------------------


def _measure_peak(
    kind: Kind, strategy: str, cfg: BenchConfig, device: torch.device
) -> dict[str, int]:
    """Peak memory of building and training one variant, relative to just before it."""
    cuda = device.type == "cuda"
    extra: dict[str, int] = {}
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        extra["peak_reset_at_baseline"] = int(common.reset_rss_peak())
        baseline = common.proc_status_bytes("VmRSS") or common.rss_peak_bytes()
    variant = _make_variant(kind, strategy, cfg, device)
    batch = _batch(cfg, device, strategy)
    for _ in range(cfg.mem_steps):
        _train_step(variant, batch)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = common.rss_peak_bytes()
    del variant, batch
    gc.collect()
    return {"baseline_bytes": baseline, "peak_bytes": peak, "delta_bytes": peak - baseline, **extra}


# --- rank entry points (module level: spawned ranks unpickle them by name) --------------


def _in_process_group(cfg: BenchConfig, body: Callable[[torch.device], Any]) -> Any:
    """Run `body(device)` inside a process group, making one only if none exists."""
    owned = not dist.is_initialized()
    info = shardwise.init_distributed(device=cfg.device, timeout_s=cfg.timeout_s)
    try:
        return body(info.device)
    finally:
        if owned:
            shardwise.shutdown()


def _timing_rank(cfg: BenchConfig) -> dict[str, Any]:
    """Per strategy: step times of both variants, then (CUDA only) their peak memory."""

    def body(device: torch.device) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for strategy in cfg.strategies:
            out[strategy] = _time_strategy(strategy, cfg, device)
            gc.collect()  # the timed variants are gone before memory is measured
            if device.type == "cuda":
                out[strategy]["memory"] = {
                    kind: _measure_peak(kind, strategy, cfg, device) for kind in KINDS
                }
        return out

    return _in_process_group(cfg, body)


def _memory_rank(cfg: BenchConfig, strategy: str, kind: Kind) -> dict[str, int]:
    """CPU only, in fresh ranks: peak RSS of one variant (see `common.pin_malloc_thresholds`)."""
    pinned = common.pin_malloc_thresholds()
    result = _in_process_group(cfg, lambda device: _measure_peak(kind, strategy, cfg, device))
    return {**result, "malloc_thresholds_pinned": int(pinned)}


def _launch(fn: Callable[..., Any], cfg: BenchConfig, *args: Any, fresh: bool) -> list[Any]:
    """Results by rank: in this process when one rank will do, else in spawned ranks."""
    if cfg.world == 1 and not fresh:
        return [fn(cfg, *args)]
    return run_distributed(
        fn,
        cfg.world,
        args=(cfg, *args),
        timeout_s=cfg.timeout_s,
        # On CUDA the rank makes its own (nccl) group; the harness only makes gloo ones.
        init_process_group=cfg.device == "cpu",
    )


# --- report -----------------------------------------------------------------------------


def _strategy_report(
    strategy: str, ranks: list[dict[str, Any]], memory: dict[str, list[dict[str, int]]]
) -> dict[str, Any]:
    median: dict[str, float] = {}
    steps: dict[str, list[float]] = {}
    for kind in KINDS:
        median[kind], steps[kind] = common.median_slowest_rank(
            [r[strategy]["step_times_s"][kind] for r in ranks]
        )
    paired = common.paired_ratios(steps["shardwise"], steps["handwritten"])
    peak = {k: max(memory[k], key=lambda m: m["peak_bytes"]) for k in KINDS}
    delta = {k: max(m["delta_bytes"] for m in memory[k]) for k in KINDS}
    step_ratio = common.ratio(median["shardwise"], median["handwritten"])
    memory_ratio = common.ratio(delta["shardwise"], delta["handwritten"])
    rank0 = ranks[0][strategy]
    return {
        "params": rank0["params"],
        "local_params_rank0": rank0["local_params"],
        "median_step_s": median,
        "step_time_ratio": step_ratio,
        "paired_step_time_ratio_median": statistics.median(paired),
        "peak_memory": {
            "delta_bytes": delta,
            "peak_bytes": {k: peak[k]["peak_bytes"] for k in KINDS},
            "per_rank": memory,
        },
        "memory_ratio": memory_ratio,
        "raw_peak_ratio": common.ratio(
            peak["shardwise"]["peak_bytes"], peak["handwritten"]["peak_bytes"]
        ),
        "final_loss_rank0": rank0["final_loss"],
        "meets_target": {
            "step_time": step_ratio is not None and step_ratio <= TARGETS["step_time_ratio"],
            "memory": memory_ratio is not None and memory_ratio <= TARGETS["memory_ratio"],
        },
        "step_times_s": {k: [round(t, 6) for t in steps[k]] for k in KINDS},
    }


def _methods(cfg: BenchConfig) -> dict[str, str]:
    cuda = cfg.device == "cuda"
    return {
        "step_time": (
            "perf_counter around zero_grad+forward+backward+optimizer.step after a barrier"
            f"{' and cuda.synchronize' if cuda else ''}; variants alternate step by step in "
            "seeded random order; each step's time is the slowest rank's; median over steps"
        ),
        "memory": (
            "torch.cuda.max_memory_allocated minus memory_allocated before build, one variant "
            "at a time in the same process; largest rank"
            if cuda
            else "separate spawned ranks per variant, glibc mmap/trim thresholds pinned "
            "(mallopt) so RSS follows live memory; peak RSS (VmHWM, restarted via "
            "/proc/self/clear_refs just before the build; ru_maxrss without /proc) minus RSS "
            "at that point (delta), and raw peak RSS; largest rank"
        ),
    }


def _report(
    cfg: BenchConfig,
    ranks: list[dict[str, Any]],
    memory: dict[str, dict[str, list[dict[str, int]]]],
    wall_s: float,
) -> dict[str, Any]:
    src_status = common.git("status", "--porcelain", "--", "src")
    return {
        **common.dated_header(
            "overhead", common.command_line(), common.device_description(cfg.device, cfg.world)
        ),
        "shardwise_src_dirty": None if src_status is None else bool(src_status),
        "world_size": cfg.world,
        "backend": "nccl" if cfg.device == "cuda" else "gloo",
        "config": asdict(cfg),
        "method": _methods(cfg),
        "targets": TARGETS,
        "strategies": {s: _strategy_report(s, ranks, memory[s]) for s in cfg.strategies},
        "wall_s": round(wall_s, 1),
    }


def _summary_line(strategy: str, r: dict[str, Any]) -> str:
    ms = {k: 1e3 * v for k, v in r["median_step_s"].items()}
    mib = {k: v / 2**20 for k, v in r["peak_memory"]["delta_bytes"].items()}

    def ratio(key: str) -> str:
        value = r[key]
        return "n/a" if value is None else f"{value:.4f}"

    return (
        f"{strategy:<10} step {ms['shardwise']:.1f} ms vs {ms['handwritten']:.1f} ms "
        f"(ratio {ratio('step_time_ratio')}, target <= {TARGETS['step_time_ratio']}) | "
        f"peak +{mib['shardwise']:.1f} MiB vs +{mib['handwritten']:.1f} MiB "
        f"(ratio {ratio('memory_ratio')}, target <= {TARGETS['memory_ratio']})"
    )


# --- command line -----------------------------------------------------------------------

_SMOKE = {**common.SMOKE_GPT, "steps": 4, "warmup": 1, "mem_steps": 2}


def _parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, Path | None]:
    p = argparse.ArgumentParser(
        description="shardwise.wrap vs hand-written DDP/FSDP2: step-time and peak-memory ratios.",
    )
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    p.add_argument(
        "--world", type=int, default=None, help="ranks (default: 2 on CPU, min(2, GPUs) on CUDA)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="default: cuda if available, else cpu",
    )
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument(
        "--policy",
        choices=("block", "auto"),
        default="block",
        help="shardwise's wrap policy: {Block} or the planner's automatic detection",
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--mem-steps", type=int, default=3, help="steps per peak-memory run")
    common.add_gpt_args(p)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per spawned run")
    p.add_argument(
        "--smoke", action="store_true", help=f"tiny model and few steps, runs in seconds: {_SMOKE}"
    )
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = common.parse_with_smoke(p, argv, _SMOKE)
    return _to_config(p, a), a.out


def _to_config(p: argparse.ArgumentParser, a: argparse.Namespace) -> BenchConfig:
    strategies = tuple(s.strip() for s in a.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in LAYOUTS]
    if unknown or not strategies:
        p.error(f"--strategies={a.strategies!r}: choose from {', '.join(LAYOUTS)}.")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device. Use --device cpu.")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        p.error("run bench/overhead.py directly, not under a launcher: it spawns its own ranks.")
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    world = a.world if a.world is not None else (min(2, gpus) if device == "cuda" else 2)
    if device == "cuda" and world > gpus:
        p.error(f"--world={world} needs {world} GPUs; {gpus} visible.")
    cfg = BenchConfig(
        strategies=strategies,
        world=world,
        device=device,
        precision=a.precision,
        policy=a.policy,
        steps=a.steps,
        warmup=a.warmup,
        mem_steps=a.mem_steps,
        **common.gpt_args(a),
        timeout_s=a.timeout_s,
    )
    if {"tp", "pp"} & set(strategies) and world % 2:
        p.error(f"--world={world}: tp and pp take 2 ranks each; give an even world.")
    if "pp" in strategies and (cfg.n_layers % 2 or cfg.batch % MICROBATCHES):
        p.error(
            f"pp cuts {cfg.n_layers} layers into 2 stages and {cfg.batch} sequences into "
            f"{MICROBATCHES} micro-batches: give even --n-layers and --batch."
        )
    for name in ("steps", "mem_steps", "world"):
        if getattr(cfg, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(cfg, name)} must be >= 1.")
    if cfg.warmup < 0:
        p.error(f"--warmup={cfg.warmup} must be >= 0.")
    try:
        _ = cfg.gpt  # validates the model sizes before any process starts
    except ValueError as exc:
        p.error(str(exc))
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out = _parse_args(argv)
    start = time.perf_counter()
    ranks = _launch(_timing_rank, cfg, fresh=False)
    memory: dict[str, dict[str, list[dict]]] = {}
    for strategy in cfg.strategies:
        if cfg.device == "cuda":
            memory[strategy] = {k: [r[strategy]["memory"][k] for r in ranks] for k in KINDS}
        else:  # peak RSS only rises: each variant needs processes of its own
            memory[strategy] = {
                k: _launch(_memory_rank, cfg, strategy, k, fresh=True) for k in KINDS
            }
    report = _report(cfg, ranks, memory, time.perf_counter() - start)
    common.emit_json(report, out)
    for strategy, r in report["strategies"].items():
        print(_summary_line(strategy, r), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
