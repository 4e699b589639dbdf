"""How long a memory plan with `--simulate` takes, fast path against full, and how far apart
their figures are (issue 54).

Each row runs in a fresh process and is timed whole, interpreter start-up and imports
included, with the process's CPU time and peak RSS (from the kernel, `os.wait4`):

- llama3-8b: `shardwise plan bench/plan_models.py:llama3_8b --world 8 --simulate`, every
  strategy (the plan command itself, `--json`), bf16, AC full, one 8192-token row;
- llama3-70b-tp8: the 70B shape at world 512 with tp 8, every FSDP strategy under tp, in
  one process (`simulate_steps` over the strategies, as the plan does);
- llama3-405b-pp8 / -pp16 (world 512 and 2048): tp 8 x pp 8 or 16, 1F1B, pp micro-batches,
  every stage simulated;
- deepseek-v3-ep64: transformers' DeepSeek-V3 at world 256, ep 64, load 2.0, seq 4096.

    python bench/plan_memory.py                       # every row, fast path only
    python bench/plan_memory.py --rows llama3-8b --full   # and the full simulation
    python bench/plan_memory.py --smoke               # a tiny Llama at world 2, both paths

Prints one line per row and one JSON object at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import common

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30
LLAMA_STRATEGIES = ("ddp", "no_shard", "shard_grad_op", "full_shard", "hybrid_shard",
                    "hybrid_shard_zero2")  # fmt: skip
TP_STRATEGIES = ("no_shard", "shard_grad_op", "full_shard", "hybrid_shard", "hybrid_shard_zero2")


def _cli(factory: str, world: int, seq_len: int) -> dict[str, Any]:
    return {
        "kind": "cli",
        "argv": ["plan", f"{HERE}/plan_models.py:{factory}", "--world", str(world),
                 "--seq-len", str(seq_len), "--batch", "1", "--json",
                 "parallel.mixed_precision=bf16", "parallel.activation_checkpointing=full"],
    }  # fmt: skip


def _child(factory: str, world: int, strategies: tuple[str, ...], **kw: Any) -> dict[str, Any]:
    return {"kind": "child", "factory": factory, "world": world, "strategies": strategies, **kw}


ROWS: dict[str, dict[str, Any]] = {
    "llama3-8b": _cli("llama3_8b", 8, 8192),
    "llama3-70b-tp8": _child("llama3_70b", 512, TP_STRATEGIES, tp=8, seq_len=8192, batch=1),
    **{
        f"llama3-405b-pp{pp}-w{world}": _child(
            "llama3_405b", world, ("full_shard",), tp=8, pp=pp, seq_len=8192, batch=pp
        )
        for world in (512, 2048)
        for pp in (8, 16)
    },
    "deepseek-v3-ep64": _child(
        "deepseek_v3", 256, ("full_shard",), ep=64, seq_len=4096, batch=1, expert_load=2.0
    ),
}
SMOKE_ROWS: dict[str, dict[str, Any]] = {
    "tiny-llama": _child("tiny_llama", 2, ("full_shard",), seq_len=32, batch=1),
}

# A fresh interpreter: the spec comes in argv[1]; the last stdout line is the JSON result.
_CHILD = """
import json, sys
import torch
sys.path.insert(0, {here!r})
import plan_models
from shardwise import ParallelConfig
from shardwise.memory import simulate_steps

torch.set_num_threads(1)
spec = json.loads(sys.argv[1])
factory = getattr(plan_models, spec["factory"])
configs = [
    ParallelConfig(strategy=strategy, mixed_precision="bf16",
                   tp=spec.get("tp", 1), pp=spec.get("pp", 1), ep=spec.get("ep", 1),
                   pp_microbatches=spec.get("pp") if spec.get("pp", 1) > 1 else None)
    for strategy in spec["strategies"]
]
# every strategy together, as `shardwise plan` simulates its rows
reports = simulate_steps(factory, configs, world=spec["world"], batch=spec["batch"],
                         seq_len=spec["seq_len"], activation_checkpointing="full",
                         expert_load=spec.get("expert_load", 2.0), path=spec["path"])
out = [
    {{"strategy": c.strategy, "peak": r.peak, "path": r.path, "notes": r.notes[:1],
     "stages": [s["peak"] for s in r.stages]}}
    for c, r in zip(configs, reports)
]
print(json.dumps(out))
"""


def _run(argv: list[str]) -> tuple[dict[str, Any], str]:
    """Run `argv` to the end: wall, CPU and peak RSS of that process (its own rusage, from
    os.wait4), and its stdout."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv[:4])}... failed: {stderr[-2000:]}")
    timing = {
        "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
    }
    return timing, stdout


def measure(name: str, row: dict[str, Any], path: str) -> dict[str, Any]:
    env_python = sys.executable
    if row["kind"] == "cli":
        argv = [env_python, "-m", "shardwise.cli.main", *row["argv"]]
        argv.insert(argv.index("--json"), f"--simulate={path}")
        timing, out = _run(argv)
        sims = json.loads(out[out.index("{") :])["simulated"]
        results = [{"strategy": s["strategy"], "peak": s["peak"], "path": s["path"]} for s in sims]
    else:
        spec = {k: v for k, v in row.items() if k != "kind"}
        spec["path"] = path
        code = _CHILD.format(here=HERE)
        timing, out = _run([env_python, "-c", code, json.dumps(spec)])
        results = json.loads(out.strip().splitlines()[-1])
    return {"row": name, "path": path, **timing, "results": results}


def _gap(fast: dict[str, Any], full: dict[str, Any]) -> float | None:
    pairs = [
        (a["peak"], b["peak"])
        for a, b in zip(fast["results"], full["results"], strict=True)
        if "peak" in a and "peak" in b
    ]
    if not pairs:
        return None
    return max(abs(a - b) / b for a, b in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama, both paths")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--full", action="store_true", help="also the full simulation")
    args = parser.parse_args(argv)
    rows = SMOKE_ROWS if args.smoke else {name: ROWS[name] for name in args.rows.split(",")}
    paths = ("fast", "full") if args.full or args.smoke else ("fast",)
    start = time.perf_counter()
    report_rows = []
    for name, row in rows.items():
        measured = {path: measure(name, row, path) for path in paths}
        entry: dict[str, Any] = {"row": name, **{p: m for p, m in measured.items()}}
        if "full" in measured:
            entry["gap"] = _gap(measured["fast"], measured["full"])
        report_rows.append(entry)
        peaks = ", ".join(
            f"{r['strategy']} {r['peak'] / GIB:.2f} GiB ({r['path']})"
            for r in measured["fast"]["results"]
            if "peak" in r
        )
        times = "; ".join(
            f"{p}: {m['wall_s']} s wall, {m.get('cpu_s')} s CPU, {m.get('peak_rss_mib')} MiB"
            for p, m in measured.items()
        )
        gap = f"; gap {entry['gap']:.4%}" if entry.get("gap") is not None else ""
        print(f"{name}: {times}{gap}\n  {peaks}", flush=True)
    report = {
        **common.report_header("plan_memory", common.command_line("bench/plan_memory.py", argv)),
        "rows": report_rows,
        "bench_wall_s": round(time.perf_counter() - start, 1),
    }
    common.emit_json(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
