"""Everything two GPUs can check that one cannot, in a few minutes; with fewer, it says so.

On a machine with two or more NVIDIA GPUs (two ranks, one GPU each, NCCL beside gloo), each
against one process on the same machine, on the same global batch:

- p2p_all_to_all: NCCL's point-to-point send/recv and an uneven all_to_all_single, values
  checked;
- pp_1f1b, pp_interleaved: pipeline parallel over 2 stages (1F1B; interleaved 1F1B with two
  stages a rank), with accumulation over 2 steps, a stage's gradient norm and loss moved
  between the GPUs;
- ep2: expert parallel (TinyMoE, its 4 experts 2 a rank) over dp 2, in fp32 and in fp16
  (one expert shard rank: torch's fp16 path once divided twice);
- tp2: tensor parallel over the MLPs, the rest sharded over dp;
- hybrid_shard: 2 replicas of 2 shards (with 4 GPUs, or `--world 4`; skipped at 2);
- fabric: Lightning Fabric with `devices=[1, 0]` (rank 0 on cuda:1): the model and the
  batches on each rank's root device, losses and parameters equal to one process;
- elastic: `shardwise run --nproc 2 --max-restarts 1` with rank 1 killed after its third
  step: the workers restart from the checkpoint and end equal to an uninterrupted run.

Each is reported even when it fails; the whole prints a table and writes JSON (`--out`,
default gpu_check_multi.json). `--device cpu` runs the same checks on CPU processes with
gloo standing in for NCCL (Fabric with devices=2): that is how the suite exercises them.

    make gpu-check-multi            # or: python bench/gpu_check_multi.py
    python bench/gpu_check_multi.py --device cpu --only pp_1f1b,ep2
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import common
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "_multi_workers.py"
IN_GROUP = ("p2p_all_to_all", "pp_1f1b", "pp_interleaved", "ep2", "tp2", "hybrid_shard")
CHECKS = (*IN_GROUP, "fabric", "elastic")
RTOL = 1e-4  # fp32 on GPUs: another reduction order, no TF32
FP16_RTOL = 5e-2  # fp16 data parallelism's own rounding (tests/distributed/test_expert_parallel)
STEPS, BATCH, VOCAB, SEQ = 3, 8, 64, 16


def gpt() -> nn.Module:
    from shardwise.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_heads=4, n_layers=4))


def moe() -> nn.Module:
    from shardwise.testing.models import TinyMoE

    torch.manual_seed(0)
    return TinyMoE(vocab_size=VOCAB, d_model=16, layers=2, num_experts=4, width=32)


def data(kind: str) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS * 2):  # two batches an update where the check accumulates
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, torch.roll(ids, -1, 1)) if kind == "gpt" else (ids, ids))
    return out


def _loss(kind: str, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    out = model(*batch)
    return out["loss"] if isinstance(out, dict) else out


def one_process(
    kind: str, device: torch.device, accumulate: int = 1, half: bool = False
) -> dict[str, Any]:
    """The reference: plain torch, the whole batch, SGD; losses per update, final params."""
    model = (gpt() if kind == "gpt" else moe()).to(device)
    if half:
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, batches = [], data(kind)
    for step in range(STEPS):
        total = 0.0
        for b in batches[step * accumulate : (step + 1) * accumulate]:
            loss = _loss(kind, model, tuple(t.to(device) for t in b)) / accumulate
            loss.backward()
            total += float(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    named = model.named_parameters(remove_duplicate=False)  # a tie under both names
    return {"losses": losses, "params": {n: p.detach().float().cpu() for n, p in named}}


def sharded(kind: str, config: Any, accumulate: int = 1, half: bool = False) -> dict[str, Any]:
    """The same steps through the Engine under `config`; each rank its data-parallel rows."""
    from torch.distributed.tensor import DTensor

    import shardwise

    model = gpt() if kind == "gpt" else moe()
    if half:
        model = model.half()
    engine = shardwise.Engine(
        model,
        functools.partial(torch.optim.SGD, lr=0.5),
        config,
        train=shardwise.TrainConfig(accumulate_steps=accumulate),
    )
    info = shardwise.wrap_info(engine.model)
    rank, size = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
    per = BATCH // size
    losses = []
    for b in data(kind)[: STEPS * accumulate]:
        logs = engine.train_step(tuple(t[rank * per : (rank + 1) * per] for t in b))
        if "grad_norm" in logs:
            losses.append(logs["loss"])

    def whole(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()

    return {"losses": losses, "params": {n: whole(p) for n, p in engine.model.named_parameters()}}


def compare(got: dict[str, Any], ref: dict[str, Any], rtol: float) -> dict[str, Any]:
    """The worst relative difference of the losses and of this rank's final parameters."""
    worst, where = 0.0, ""
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        d = abs(a - b) / max(abs(b), 1e-12)
        if not math.isfinite(d) or d > worst:
            worst, where = d, f"loss {i}"
    for name, p in got["params"].items():
        r = ref["params"][name]
        d = float((p - r).norm() / r.norm().clamp_min(1e-12))
        if not math.isfinite(d) or d > worst:
            worst, where = d, name
    ok = math.isfinite(worst) and worst < rtol and bool(got["params"])
    return {"ok": ok, "worst_rel": worst, "where": where, "params_compared": len(got["params"])}


# --- the checks that run inside one spawned group ------------------------------------------


def p2p_all_to_all(device: torch.device) -> dict[str, Any]:
    """Each rank sends to the next one round a ring; then an all_to_all_single in which
    rank r sends (r + j) % 2 + 1 rows to rank j (uneven splits), values checked."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    sent = torch.arange(6, dtype=torch.float32, device=device) + 10 * rank
    got = torch.empty(6, device=device)
    ops = [dist.P2POp(dist.isend, sent, (rank + 1) % world),
           dist.P2POp(dist.irecv, got, (rank - 1) % world)]  # fmt: skip
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    p2p = torch.equal(got.cpu(), torch.arange(6.0) + 10 * ((rank - 1) % world))
    splits = [(rank + j) % 2 + 1 for j in range(world)]
    rows = torch.full((sum(splits), 2), float(rank), device=device)
    recv_splits = [(i + rank) % 2 + 1 for i in range(world)]
    out = torch.empty(sum(recv_splits), 2, device=device)
    dist.all_to_all_single(out, rows, recv_splits, splits)
    want = torch.cat([torch.full((n, 2), float(r)) for r, n in enumerate(recv_splits)])
    return {"ok": p2p and torch.equal(out.cpu(), want), "p2p": p2p}


def _case(name: str, device: torch.device) -> dict[str, Any]:
    import shardwise

    if name == "p2p_all_to_all":
        return p2p_all_to_all(device)
    if name.startswith("pp"):
        schedule = "1f1b" if name == "pp_1f1b" else "interleaved_1f1b"
        config = shardwise.ParallelConfig(pp=2, pp_schedule=schedule)  # 4 blocks: 4 stages
        got = sharded("gpt", config, accumulate=2)
        return compare(got, one_process("gpt", device, accumulate=2), RTOL)
    if name == "ep2":
        fp32 = compare(
            sharded("moe", shardwise.ParallelConfig(strategy="full_shard", ep=2)),
            one_process("moe", device),
            RTOL,
        )
        fp16 = compare(
            sharded("moe", shardwise.ParallelConfig(strategy="full_shard", ep=2), half=True),
            one_process("moe", device, half=True),
            FP16_RTOL,
        )
        return {"ok": fp32["ok"] and fp16["ok"], "fp32": fp32, "fp16": fp16}
    if name == "tp2":
        plan = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
        config = shardwise.ParallelConfig(strategy="full_shard", tp=2, tp_plan=plan)
        return compare(sharded("gpt", config), one_process("gpt", device), RTOL)
    if name == "hybrid_shard":
        if shardwise.get_dist_info().world_size < 4:  # 2 replicas of at least 2 shards
            return {"ok": True, "skipped": "hybrid_shard needs 4 ranks (--world 4)"}
        config = shardwise.ParallelConfig(strategy="hybrid_shard")
        return compare(sharded("gpt", config), one_process("gpt", device), RTOL)
    raise ValueError(name)


def in_group(names: list[str], device_type: str) -> dict[str, Any]:
    """On every rank: the in-group checks, each reported even when it raises."""
    import shardwise

    info = shardwise.init_distributed(device=None if device_type == "cuda" else "cpu")
    out: dict[str, Any] = {"device": str(info.device), "backend": info.backend}
    for name in names:
        start = time.perf_counter()
        try:
            out[name] = _case(name, info.device)
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
        out[name]["seconds"] = round(time.perf_counter() - start)
    return out


# --- the checks that launch processes of their own ---------------------------------------


def _worker(args: list[str], timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(WORKERS), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env,
    )  # fmt: skip
    result: dict[str, Any] = {"rc": out.returncode}
    if out.returncode != 0:
        result["stderr"] = out.stderr[-3000:]
    return result


def check_fabric(device_type: str, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    out = tmp / "fabric.pt"
    run = _worker(["fabric", device_type, str(out)], 600, env)
    if run["rc"] != 0 or not out.exists():
        return {"ok": False, **run}
    got = torch.load(out)
    ref = one_process("gpt", torch.device("cpu"))
    result = compare(got, ref, RTOL)
    placed = got["placed"]  # per rank: (root device, parameter device, batch device)
    result["placed"] = placed
    result["ok"] = result["ok"] and all(len(set(p)) == 1 for p in placed)
    return result


def check_elastic(tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """An uninterrupted run and one whose rank 1 dies after its third step, each under
    `shardwise run --nproc 2`; the restarted one resumes from its checkpoint."""
    finals = {}
    for kind in ("uninterrupted", "killed"):
        run_dir = tmp / f"elastic-{kind}"
        cmd = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2",
               "--max-restarts", "1", str(WORKERS), "elastic", str(run_dir), kind]  # fmt: skip
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        final = run_dir / "final.pt"
        if out.returncode != 0 or not final.exists():
            return {"ok": False, "run": kind, "rc": out.returncode, "stderr": out.stderr[-3000:]}
        finals[kind] = torch.load(final)
    restarts = finals["killed"]["restarts"]
    ref = {"losses": [], "params": finals["uninterrupted"]["params"]}
    result = compare({"losses": [], "params": finals["killed"]["params"]}, ref, 1e-6)
    return {**result, "ok": result["ok"] and restarts == 1, "restarts": restarts}


def main() -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--only", default="", help=f"comma-separated, of {','.join(CHECKS)}")
    parser.add_argument("--out", default="gpu_check_multi.json")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--world", type=int, default=0,
        help="ranks of the in-group checks (default: 4 where 4 GPUs are visible, else 2)",
    )  # fmt: skip
    args = parser.parse_args()
    header = common.report_header(
        "gpu_check_multi", common.command_line("bench/gpu_check_multi.py")
    )
    chosen = [c for c in args.only.split(",") if c] or list(CHECKS)
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose from {','.join(CHECKS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and gpus < 2:
        print(f"gpu-check-multi: needs ≥ 2 GPUs; this machine has {gpus}; nothing was checked.")
        common.emit_json({**header, "gpus": gpus, "checks": {}}, Path(args.out))
        return 0
    from shardwise.testing import run_distributed

    world = args.world or (4 if gpus >= 4 else 2)
    if args.device == "cuda" and world > gpus:
        parser.error(f"--world {world}: this machine has {gpus} GPUs")

    env = common.child_env({} if args.device == "cuda" else {"CUDA_VISIBLE_DEVICES": ""})
    results: dict[str, Any] = {}
    group = [c for c in chosen if c in IN_GROUP]
    if group:
        ranks = run_distributed(
            in_group, world, args=(group, args.device), timeout_s=900,
            init_process_group=False, env=env if args.device == "cpu" else None,
        )  # fmt: skip
        for name in group:
            per_rank = [r[name] for r in ranks]
            results[name] = {"ok": all(r.get("ok") for r in per_rank), "ranks": per_rank}
        results["group"] = {"ok": True, "world": world, "devices": [r["device"] for r in ranks],
                            "backend": ranks[0]["backend"]}  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="shardwise-gpu-check-multi-"))
    for name, run in (("fabric", lambda: check_fabric(args.device, tmp, env)),
                      ("elastic", lambda: check_elastic(tmp, env))):  # fmt: skip
        if name in chosen:
            start = time.perf_counter()
            try:
                results[name] = run()
            except Exception as exc:
                results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            results[name]["seconds"] = round(time.perf_counter() - start)
    for name, r in results.items():
        print(f"{name:<16} {'ok' if r.get('ok') else 'FAILED'}", flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    report = {**header, "gpu": gpu, "gpus": gpus, "device": args.device, "checks": results}
    common.emit_json(json.loads(json.dumps(report, default=str)), Path(args.out))
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
