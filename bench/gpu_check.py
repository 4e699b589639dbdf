"""One command that validates a GPU: everything a single GPU can check, in under ten minutes.

Runs, one after the other, each bounded in time and reported even when it fails:

- demo: `shardwise demo --short` with one process, in bf16;
- overhead: `bench/overhead.py --device cuda --world 1 --precision bf16` (shardwise against
  hand-written FSDP2, step time and memory);
- mfu: `bench/mfu.py` for 125m, 350m and 1.3b, eager, one variant resident at a time;
- offload: CPU offload with an eager and with a meta build (FSDP2 on a one-rank mesh);
- async_save: an asynchronous checkpoint from pinned memory, completed and verified;
- simulation: `simulate_step`'s peak against `torch.cuda.max_memory_allocated` and
  `max_memory_reserved` of the same real step;
- syncs: host syncs outside optimizer.step under `torch.cuda.set_sync_debug_mode`, with
  accumulation 4 and clipping (the target is at most one per update, none per micro-step);
- router, adapters, dims_syncs: the router loss in a recomputed block, LoRA and QLoRA
  (bf16 codes, with and without cpu_offload), and the host syncs of the expert dispatch,
  the pipeline's token count and the Runner's save timer (bench/gpu_dims.py says what each
  checks). These three also run on the CPU (`--device cpu`), as the suite runs them.

It prints one table and writes JSON (`--out`, default gpu_check.json). With no GPU visible it
says so, checks nothing and exits 0.

    make gpu-check                       # or: python bench/gpu_check.py
    python bench/gpu_check.py --only syncs,simulation
    python bench/gpu_check.py --device cpu --only router,adapters,dims_syncs
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import gpu_dims
import torch

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], timeout_s: float) -> dict[str, Any]:
    """A command's exit code, time and the JSON it printed last (if any)."""
    start = time.perf_counter()
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=common.child_env({})
    )
    result: dict[str, Any] = {"rc": out.returncode, "seconds": round(time.perf_counter() - start)}
    if "{" in out.stdout:
        try:
            result["report"] = json.loads(out.stdout[out.stdout.index("{") :])
        except json.JSONDecodeError:
            pass
    if out.returncode != 0:
        result["stderr"] = out.stderr[-2000:]
    return result


def check_demo() -> dict[str, Any]:
    cmd = [sys.executable, "-m", "shardwise.cli", "demo", "--short", "--nproc", "1"]
    got = _run([*cmd, "parallel.mixed_precision=bf16"], 300)
    return {"ok": got["rc"] == 0, **got}


def check_overhead() -> dict[str, Any]:
    script = str(ROOT / "bench" / "overhead.py")
    got = _run(
        [sys.executable, script, "--device", "cuda", "--world", "1", "--precision", "bf16"], 300
    )
    return {"ok": got["rc"] == 0, **got}


def check_mfu() -> dict[str, Any]:
    script = str(ROOT / "bench" / "mfu.py")
    cmd = [sys.executable, script, "--sizes", "125m,350m,1.3b", "--modes", "eager"]
    got = _run([*cmd, "--steps", "10", "--warmup", "3"], 420)
    return {"ok": got["rc"] == 0, **got}


def _gpt(d_model: int = 512, n_layers: int = 4) -> Any:
    from shardwise.testing.models import GPT, GPTConfig

    return GPT(
        GPTConfig(vocab_size=8192, seq_len=256, d_model=d_model, n_heads=8, n_layers=n_layers)
    )


def _batch(model: Any, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device="cuda")
    return tokens[:, :-1], tokens[:, 1:]


def check_offload() -> dict[str, Any]:
    import shardwise

    out: dict[str, Any] = {}
    for build in ("eager", "meta"):
        torch.manual_seed(0)
        if build == "meta":
            with shardwise.init_empty():
                model = _gpt()
        else:
            model = _gpt()
        config = shardwise.ParallelConfig(cpu_offload=True, force_wrap=True)
        engine = shardwise.Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), config)
        losses = [float(engine.train_step(_batch(model))["loss"]) for _ in range(3)]
        out[build] = {"losses": [round(v, 4) for v in losses]}
    out["ok"] = all(all(v == v for v in out[b]["losses"]) for b in ("eager", "meta"))
    return out


def check_async_save(tmp: Path) -> dict[str, Any]:
    import shardwise
    from shardwise.checkpoint import verify_checkpoint

    torch.manual_seed(0)
    model = _gpt()
    config = shardwise.ParallelConfig(force_wrap=True)
    engine = shardwise.Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), config)
    stalls = []
    for _ in range(3):
        engine.train_step(_batch(model))
        seconds, _ = common.timed(
            lambda: shardwise.save_checkpoint(tmp / "ckpt", engine, async_=True),
            device=torch.device("cuda"),
        )
        stalls.append(round(seconds, 3))
    path = shardwise.wait_for_checkpoint()
    problems = verify_checkpoint(path) if path is not None else ["no checkpoint"]
    return {"ok": not problems, "stall_s": stalls, "checkpoint": str(path), "problems": problems}


def _sim_model() -> Any:  # module level: the simulation may pickle it to a subprocess
    return _gpt(1024, 8)


def check_simulation() -> dict[str, Any]:
    import shardwise
    from shardwise.memory import simulate_step

    build = _sim_model
    config = shardwise.ParallelConfig(mixed_precision="bf16", force_wrap=True)
    sim = simulate_step(build, config, world=1, batch=4, seq_len=256)
    torch.manual_seed(0)
    model = shardwise.wrap(build(), config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = _batch(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step holds optimizer state, as the simulation does
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {
        "ok": abs(sim.peak / allocated - 1) <= 0.1,
        "simulated_MiB": common.mib(sim.peak),
        "allocated_MiB": common.mib(allocated),
        "reserved_MiB": common.mib(reserved),
        "simulated_over_allocated": round(sim.peak / allocated, 3),
        "reserved_over_allocated": round(reserved / allocated, 3),
    }


def check_syncs() -> dict[str, Any]:
    import shardwise

    k = 4
    torch.manual_seed(0)
    model = _gpt()
    config = shardwise.ParallelConfig(force_wrap=True)
    train = shardwise.TrainConfig(accumulate_steps=k, max_grad_norm=1.0)
    engine = shardwise.Engine(model, lambda p: torch.optim.AdamW(p, lr=1e-3), config, train=train)
    engine.optimizer.register_step_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode(0))
    engine.optimizer.register_step_post_hook(lambda *_: torch.cuda.set_sync_debug_mode(1))
    batches = [_batch(model, 1) for _ in range(3 * k)]
    engine.train_step(batches[0])  # warm-up: lazy initialisation may sync once
    counts = []
    try:
        torch.cuda.set_sync_debug_mode(1)  # warn on every synchronising call
        for batch in batches[1:]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logs = engine.train_step(batch)
            syncs = [w for w in caught if "synchronizing" in str(w.message).lower()]
            counts.append(("grad_norm" in logs, len(syncs)))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    micro = [n for updated, n in counts if not updated]
    updates = [n for updated, n in counts if updated]
    return {
        "ok": all(n == 0 for n in micro) and all(n <= 1 for n in updates),
        "per_micro_step": micro,
        "per_update": updates,
    }


def main() -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--only", default="", help="comma-separated check names")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"],
        help=f"cpu: run the checks that run on a CPU ({', '.join(ON_CPU)}), as the suite does",
    )  # fmt: skip
    args = parser.parse_args()
    header = common.report_header("gpu_check", common.command_line("bench/gpu_check.py"))
    if args.device == "cpu":
        return _run_on_cpu(args, header)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU is visible on this machine; nothing was checked.")
        common.emit_json({**header, "gpu": None, "checks": {}}, Path(args.out))
        return 0
    import tempfile

    import shardwise

    shardwise.init_distributed()
    tmp = Path(tempfile.mkdtemp(prefix="shardwise-gpu-check-"))
    cuda = torch.device("cuda", torch.cuda.current_device())
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "router": lambda: gpu_dims.check_router(cuda),
        "adapters": lambda: gpu_dims.check_adapters(cuda, tmp),
        "dims_syncs": lambda: gpu_dims.check_dims_syncs(cuda),
        "syncs": check_syncs,
        "simulation": check_simulation,
        "offload": check_offload,
        "async_save": lambda: check_async_save(tmp),
        "demo": check_demo,
        "overhead": check_overhead,
        "mfu": check_mfu,
    }
    results = _run_checks(checks, args.only)
    gpu = torch.cuda.get_device_name()
    shardwise.shutdown()
    common.emit_json({**header, "gpu": gpu, "checks": results}, Path(args.out))
    return 0 if all(r.get("ok") for r in results.values()) else 1


ON_CPU = ("router", "adapters", "dims_syncs")


def _run_checks(checks: dict[str, Callable[[], dict[str, Any]]], only: str) -> dict[str, Any]:
    """Each chosen check, timed, reported even when it raises, one line each."""
    chosen = [c for c in only.split(",") if c] or list(checks)
    unknown = sorted(set(chosen) - set(checks))
    if unknown:
        raise SystemExit(f"gpu_check: --only {','.join(unknown)}: choose from {sorted(checks)}")
    results: dict[str, Any] = {}
    for name in chosen:
        start = time.perf_counter()
        try:
            results[name] = checks[name]()
        except Exception as exc:
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            results[name]["traceback"] = traceback.format_exc()[-3000:]
        results[name]["seconds"] = round(time.perf_counter() - start)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        verdict = "ok" if results[name].get("ok") else "FAILED"
        print(f"{name:<12} {verdict:<7} {results[name]['seconds']:>4} s", flush=True)
    return results


def _run_on_cpu(args: Any, header: dict[str, Any]) -> int:
    """The checks that run on a CPU, on the CPU (a one-rank gloo group)."""
    import tempfile

    import shardwise

    shardwise.init_distributed(device="cpu")
    tmp = Path(tempfile.mkdtemp(prefix="shardwise-gpu-check-"))
    cpu = torch.device("cpu")
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "router": lambda: gpu_dims.check_router(cpu),
        "adapters": lambda: gpu_dims.check_adapters(cpu, tmp),
        "dims_syncs": lambda: gpu_dims.check_dims_syncs(cpu),
    }
    results = _run_checks(checks, args.only)
    shardwise.shutdown()
    common.emit_json({**header, "gpu": None, "device": "cpu", "checks": results}, Path(args.out))
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
