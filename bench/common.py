"""Scaffolding shared by the benchmark scripts in bench/, so each keeps only what it measures.

- timing: `timed` (one call, optionally after a barrier and between CUDA syncs) and
  `timed_rounds` (several variants stepped alternately, warm-up rounds dropped);
- statistics: `median_slowest_rank`, `ratio`, `paired_ratios`, `mib`;
- process memory: `pin_malloc_thresholds`, `proc_status_bytes`, `reset_rss_peak`,
  `rss_peak_bytes` (peak RSS of a rank, restarted just before what is measured);
- the JSON report: `git`, `git_commit`, `command_line`, `device_description`,
  `report_header`, `dated_header`, `emit_json`;
- the memory benchmarks' model and report head: `memory_gpt_sizes`, `model_report`;
- the command line: `arg_parser`, `add_gpt_args`, `gpt_args`, `SMOKE_GPT`,
  `parse_with_smoke`, `add_dir_arg`, `work_dir`;
- child processes: `child_env`.

The scripts run as `python bench/<name>.py`, so this folder is sys.path[0] and they import
this file as the module `common` (as do the ranks they spawn, which inherit sys.path). It
imports no shardwise (the scripts hold those imports), and torch only inside the functions
that need it, so a driver that never touches torch (bench/soak.py) stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20

# --- timing -------------------------------------------------------------------------------


def timed(
    fn: Callable[[], T], *, barrier: bool = False, device: torch.device | None = None
) -> tuple[float, T]:
    """Seconds `fn()` takes (time.perf_counter), and what it returned.

    With `barrier`, every rank of the process group starts together (dist.barrier() first,
    outside the timed span). On a CUDA `device` the span runs from one
    torch.cuda.synchronize to another, so it covers the kernels `fn` queued.
    """
    if barrier:
        import torch.distributed as dist

        dist.barrier()
    cuda = device is not None and device.type == "cuda"
    if cuda:
        import torch

        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def timed_rounds(
    steps: Mapping[str, Callable[[], T]],
    orders: Iterable[Sequence[str]],
    *,
    warmup: int = 0,
    barrier: bool = False,
    device: torch.device | None = None,
) -> tuple[dict[str, list[float]], dict[str, T]]:
    """Variants stepped alternately: round r runs `steps[name]` for each name of `orders[r]`,
    in that order, each through `timed` (same `barrier` and `device`).

    Returns each variant's step times, the first `warmup` rounds left out, and what its last
    step returned (a loss, say).
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    last: dict[str, T] = {}
    for r, order in enumerate(orders):
        for name in order:
            seconds, last[name] = timed(steps[name], barrier=barrier, device=device)
            if r >= warmup:
                times[name].append(seconds)
    return times, last


# --- statistics ---------------------------------------------------------------------------


def median_slowest_rank(per_rank: Sequence[Sequence[float]]) -> tuple[float, list[float]]:
    """From each rank's step times, the slowest rank's time of every step and their median."""
    slowest = [max(step) for step in zip(*per_rank, strict=True)]
    return statistics.median(slowest), slowest


def ratio(a: float, b: float) -> float | None:
    """a / b, or None where b is zero."""
    return a / b if b else None


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """a[i] / b[i] for each i: two variants' times of the same step (or round)."""
    return [x / y for x, y in zip(a, b, strict=True)]


def mib(n_bytes: float, digits: int = 1) -> float:
    """Bytes in MiB, rounded for the report."""
    return round(n_bytes / MIB, digits)


# --- process memory (Linux; see bench/overhead.py's docstring for the method) --------------


def pin_malloc_thresholds() -> bool:
    """Make RSS follow live memory: fixed glibc mmap/trim thresholds (False if not glibc).

    glibc raises its mmap threshold as large blocks are freed, after which freed tensor
    memory stays in the heap and peak RSS depends on allocation history (a few percent,
    run to run). With a fixed threshold every large tensor is mmapped and returned on free.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 64 * 1024)) and bool(
        libc.mallopt(m_trim_threshold, 128 * 1024)
    )


def proc_status_bytes(field: str) -> int | None:
    """A `VmRSS`/`VmHWM`-style line of /proc/self/status in bytes (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def reset_rss_peak() -> bool:
    """Restart this process's peak-RSS count from its current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_peak_bytes() -> int:
    """This process's peak RSS in bytes: VmHWM, or ru_maxrss where /proc is missing."""
    # VmHWM covers this process image only; ru_maxrss may also carry the RSS the spawning
    # parent had when it forked us, which can exceed everything this rank does.
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux


# --- the JSON report ----------------------------------------------------------------------


def git(*args: str) -> str | None:
    """`git ARGS` in this repository: its stripped stdout, or None where git fails."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit() -> str | None:
    """The short hash of HEAD (None outside a git checkout)."""
    return git("rev-parse", "--short", "HEAD")


def command_line(script: str | None = None, argv: Sequence[str] | None = None) -> str:
    """How the benchmark was run, for the report: `script` (default: sys.argv[0] as given)
    followed by `argv` (default: sys.argv[1:])."""
    head = Path(sys.argv[0]).as_posix() if script is None else script
    return " ".join([head, *(sys.argv[1:] if argv is None else argv)])


def device_description(device: str, world: int) -> str:
    """`world x <GPU name>` for device 'cuda'; else the CPU model, its cores and the OS."""
    if device == "cuda":
        import torch

        return f"{world} x {torch.cuda.get_device_name(0)}"
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"CPU: {model}, {os.cpu_count()} logical cores, {platform.system()}"


def report_header(benchmark: str, command: str) -> dict[str, Any]:
    """The first keys of a report: benchmark, command, commit (short hash), torch version."""
    import torch

    return {
        "benchmark": benchmark,
        "command": command,
        "commit": git_commit(),
        "torch": torch.__version__,
    }


def dated_header(benchmark: str, command: str, device: str) -> dict[str, Any]:
    """The first keys of a report that also names its date and device: benchmark, date (UTC,
    ISO 8601 to the second), command, device, torch version, shardwise_commit."""
    import torch

    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "device": device,
        "torch": torch.__version__,
        "shardwise_commit": git_commit(),
    }


def emit_json(report: Mapping[str, Any], out: Path | None = None) -> None:
    """Print `report` on stdout as indented JSON; also write it to `out` when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")


# --- the command line ---------------------------------------------------------------------

GPT_ARGS = ("d_model", "n_layers", "n_heads", "seq_len", "batch", "vocab", "seed")
SMOKE_GPT = {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16, "batch": 2, "vocab": 64}
"""`add_gpt_args`' sizes for --smoke (see `parse_with_smoke`): a GPT that steps in milliseconds."""


def arg_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser described by the first line of a script's docstring."""
    lines = (doc or "").strip().splitlines()
    return argparse.ArgumentParser(description=lines[0] if lines else None)


def add_gpt_args(parser: argparse.ArgumentParser) -> None:
    """The GPT's sizes, batch and seed (`GPT_ARGS`), at the step-time benchmarks' defaults."""
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)


def gpt_args(args: argparse.Namespace) -> dict[str, int]:
    """The values of `add_gpt_args`' flags, by field name."""
    return {name: getattr(args, name) for name in GPT_ARGS}


def memory_gpt_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The memory benchmarks' GPT (GPTConfig fields): a 32k vocabulary, 512 tokens and 16
    heads, sized by --d-model and --n-layers."""
    return {
        "vocab_size": 32_000,
        "seq_len": 512,
        "d_model": args.d_model,
        "n_heads": 16,
        "n_layers": args.n_layers,
    }


def model_report(benchmark: str, world: int, params: int) -> dict[str, Any]:
    """A memory benchmark's report head: the header, the world and the fp32 model's size."""
    return {
        **report_header(benchmark, command_line(f"bench/{benchmark}.py")),
        "world": world,
        "params": params,
        "model_MiB": mib(params * 4),
    }


def parse_with_smoke(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, smoke: Mapping[str, Any]
) -> argparse.Namespace:
    """Parse `argv`; with --smoke, the `smoke` values replace the defaults (flags given
    explicitly still win)."""
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args


def add_dir_arg(parser: argparse.ArgumentParser) -> None:
    """--dir: where a benchmark writes its files (see `work_dir`)."""
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temp dir on /tmp's disk)"
    )


@contextlib.contextmanager
def work_dir(given: str | None, prefix: str) -> Iterator[Path]:
    """The folder `given` (--dir), kept afterwards; without one, a fresh temporary folder
    named `prefix...`, removed afterwards."""
    root = Path(given or tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        if given is None:
            shutil.rmtree(root, ignore_errors=True)


# --- child processes ----------------------------------------------------------------------


def child_env(
    extra: Mapping[str, str] | None = None, *, drop: Iterable[str] = ()
) -> dict[str, str]:
    """The environment for a child process that starts ranks of its own: this one's, less the
    variables in `drop`, with OMP_NUM_THREADS=1 (the ranks share the cores), then `extra`."""
    dropped = set(drop)
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env
