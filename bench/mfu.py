"""Model FLOPs utilisation of a GPT trained with shardwise vs hand-written torch, one device.

For each size and mode (eager, compiled), the same GPT is trained at world size 1 in bf16
two ways in the same run, one after the other (only one resident at a time: at 1.3B with
AdamW and batch 8 x 2048, two would not fit an 80 GB GPU together):

- shardwise: `shardwise.wrap(model, ParallelConfig(mixed_precision="bf16", compile=...))`,
  which at world size 1 returns the model with its forward under bf16 autocast (and, with
  compile, each block compiled in place);
- hand-written: the same model with `torch.autocast("cuda", torch.bfloat16)` around forward
  (and each block compiled with `block.compile()`).

Reported per variant: tokens/s, MFU = tokens/s x (6 N + 12 L d T) / peak bf16 dense FLOP/s
(N parameters, embeddings included; L layers, d width, T sequence length;
the second term is attention), and peak memory. Peak FLOP/s is looked up from the device
name (H100/H200: 989 TFLOP/s dense bf16) or given with --peak-tflops.

    python bench/mfu.py --sizes 125m,350m,1.3b            # on a GPU
    python bench/mfu.py --smoke                            # CPU: tiny model, a few steps
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
from typing import Any

import common
import torch
from torch import nn

import shardwise
from shardwise.testing.models import GPT, GPTConfig

SIZES = {
    "125m": dict(d_model=768, n_layers=12, n_heads=12),
    "350m": dict(d_model=1024, n_layers=24, n_heads=16),
    "760m": dict(d_model=1536, n_layers=24, n_heads=16),
    "1.3b": dict(d_model=2048, n_layers=24, n_heads=32),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4),
}
MODES = ("eager", "compiled")
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def flops_per_token(cfg: GPTConfig, params: int) -> float:
    return 6.0 * params + 12.0 * cfg.n_layers * cfg.d_model * cfg.seq_len


def build(
    cfg: GPTConfig, kind: str, compile_backend: str | None, device: torch.device
) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = GPT(cfg)
    if kind == "shardwise":
        config = shardwise.ParallelConfig(mixed_precision="bf16", compile=compile_backend or False)
        model = shardwise.wrap(model, config)
        autocast = None  # shardwise applied it
    else:
        model.to(device)
        if compile_backend:
            for block in model.blocks:
                block.compile(backend=compile_backend)
        autocast = torch.bfloat16
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    return model, (opt, autocast)


def step(model: nn.Module, state: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    opt, autocast = state
    if autocast is not None:
        with torch.autocast(x.device.type, dtype=autocast):
            loss = model(x, y)
    else:
        loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(
    args: argparse.Namespace, size: str, compile_backend: str | None, device: torch.device
) -> dict[str, Any]:
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, **SIZES[size])
    params = GPT(cfg).num_params() if size == "tiny" else _meta_params(cfg)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {}
    peaks: dict[str, float] = {}
    for kind in ("handwritten", "shardwise"):
        model, state = build(cfg, kind, compile_backend, device)
        times[kind] = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.steps):
            seconds, _ = common.timed(functools.partial(step, model, state, x, y), device=device)
            if i >= args.warmup:
                times[kind].append(seconds)
        if device.type == "cuda":
            peaks[kind] = torch.cuda.max_memory_allocated(device) / 2**30
        del model, state  # free this variant before the next is built
        if compile_backend:  # dynamo's caches hold the compiled blocks, parameters and all
            torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    peak = peak_tflops(device, args.peak_tflops)
    out: dict[str, Any] = {"size": size, "params": params, "compile": compile_backend or "eager"}
    for kind, ts in times.items():
        tok_s = args.batch * cfg.seq_len / statistics.median(ts)
        out[kind] = {
            "tokens_per_s": round(tok_s, 1),
            "mfu": round(tok_s * flops_per_token(cfg, params) / (peak * 1e12), 4) if peak else None,
            "peak_mem_GiB": round(peaks[kind], 2) if kind in peaks else None,
        }
    out["shardwise_over_handwritten"] = round(
        out["shardwise"]["tokens_per_s"] / out["handwritten"]["tokens_per_s"], 4
    )
    return out


def _meta_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return GPT(cfg).num_params()


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--sizes", default="125m,1.3b")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, aot_eager compile")
    args = parser.parse_args()
    for name, given, known in (("--sizes", args.sizes, SIZES), ("--modes", args.modes, MODES)):
        unknown = [v for v in given.split(",") if v not in known]
        if unknown:  # an unknown mode ran eager before, reported as eager
            parser.error(f"{name} {','.join(unknown)}: choose from {','.join(known)}")
    if args.smoke:
        args.sizes, args.batch, args.seq_len, args.vocab = "tiny", 2, 32, 256
        args.steps, args.warmup, args.compile_backend = 3, 1, "aot_eager"
    shardwise.init_distributed()
    device = shardwise.get_dist_info().device
    results = []
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            backend = args.compile_backend if mode == "compiled" else None
            results.append(measure(args, size, backend, device))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = common.report_header("mfu", common.command_line("bench/mfu.py"))
    common.emit_json({**header, "device": name, "results": results})
    shardwise.shutdown()


if __name__ == "__main__":
    main()
