"""Soak trials of the launcher: a job is hurt at a random step, and must still finish exactly.

    python bench/soak.py --kind restart --trials 20     # `make soak N=20`
    python bench/soak.py --kind restart --trials 1 --json

Kind `restart`: `shardwise run --nproc 2 --max-restarts 2` trains a small GPT with
`RunnerConfig(resume='latest', save_every=...)`; rank 1 is SIGKILLed at a random step; the
job must come back from its last complete checkpoint and end with weights bitwise equal to
an uninterrupted run of the same job (computed once per invocation).

Kind `preempt`: SIGTERM to the launcher at a random step (as a scheduler does); the Runner
finishes the step, saves and exits; a second launch resumes; the end must equal the
uninterrupted run bitwise.
Kind `stall`: rank 1 stops coming at a random step (a hung data read); with `--timeout 5`
the job must end within 60 s with a StallError naming rank 1 and the step.
Kind `kill_during_save`: async saves (`RunnerConfig(async_save=True)`) under
`--max-restarts 2`; rank 1 is SIGKILLed while a checkpoint is still being written; the torn
save must be ignored on resume and the end must equal the uninterrupted run bitwise.

The same file is the training job (`soak.py job --dir DIR`): the driver launches it with
`shardwise run`, so the trial exercises exactly what a user runs. Prints one JSON line per
trial and `K of N <kind>` at the end; exit status 1 when any trial failed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
SAVE_EVERY = 5
STEP_SLEEP_S = 0.05  # makes a step long enough for the driver to aim its kill


# --- the training job, run under `shardwise run` ------------------------------------------


_calls = 0


def _slow_collate(items: list[Any]) -> Any:
    from torch.utils.data import default_collate

    global _calls
    _calls += 1
    time.sleep(STEP_SLEEP_S)
    # The stall trial: rank 1 stops coming to its step's collectives (a hung data read).
    stall = os.environ.get("SOAK_STALL_AT")
    if stall and os.environ.get("RANK") == "1" and _calls == int(stall):
        time.sleep(3600)
    return default_collate(items)


def job(out: Path, steps: int) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import shardwise
    from shardwise.checkpoint import list_checkpoints
    from shardwise.testing.models import GPT, Block, GPTConfig

    info = shardwise.init_distributed()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    (out / f"pid.rank{info.rank}.restart{restart}").write_text(str(os.getpid()))
    cfg = GPTConfig()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (512, cfg.seq_len + 1), generator=g)
    data = DataLoader(
        TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4, collate_fn=_slow_collate
    )
    torch.manual_seed(0)
    config = shardwise.ParallelConfig(strategy="full_shard", auto_wrap_policy={Block})
    engine = shardwise.Engine(
        GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3), config
    )  # fmt: skip
    ckdir = out / "run" / "checkpoints"
    found = [c.step for c in list_checkpoints(ckdir) if c.complete] if ckdir.exists() else []
    runner = shardwise.Runner(
        engine,
        data,
        config=shardwise.RunnerConfig(
            max_epochs=None,
            max_steps=steps,
            save_every=SAVE_EVERY,
            resume="latest",
            run_dir=str(out / "run"),
            progress=False,
            tensorboard=False,
            async_save=os.environ.get("SOAK_ASYNC") == "1",
        ),
    )
    summary = runner.fit()
    shardwise.export_weights(engine.model, out / "final")
    if info.is_main:
        resumed_from = max(found, default=0)
        done = {"steps": summary["steps"], "restart": restart, "resumed_from": resumed_from}
        (out / "done.json").write_text(json.dumps(done))
    shardwise.shutdown()


# --- the driver ------------------------------------------------------------------------------


def launch(
    out: Path, steps: int, *extra: str, env: dict[str, str] | None = None, log: str = "launcher"
) -> subprocess.Popen[str]:
    """`shardwise run` of the job in its own session (so a timeout can kill all of it)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", *extra,
        str(Path(__file__).resolve()), "job", "--dir", str(out), "--steps", str(steps),
    ]  # fmt: skip
    with open(out / f"{log}.out", "w") as log_file:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, env=common.child_env(env), text=True, start_new_session=True,
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip


def wait_launcher(proc: subprocess.Popen[str], timeout_s: float) -> int | None:
    """The launcher's exit code, or None after killing its whole session at the deadline."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def metrics_rows(out: Path) -> int:
    path = out / "run" / "metrics.csv"
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0


def final_weights(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """None when every tensor is bitwise equal, else what differs."""
    if sorted(a) != sorted(b):
        return f"different tensor names: {sorted(set(a) ^ set(b))[:5]}"
    import torch

    diff = [k for k in a if not torch.equal(a[k], b[k])]
    return f"{len(diff)} tensor(s) differ, e.g. {diff[:3]}" if diff else None


def reference(root: Path, steps: int, timeout_s: float) -> dict[str, Any]:
    out = root / "reference"
    rc = wait_launcher(launch(out, steps), timeout_s)
    if rc != 0:
        log = (out / "launcher.out").read_text()[-3000:]
        raise RuntimeError(f"the uninterrupted reference run failed (exit {rc}):\n{log}")
    return final_weights(out)


def _verdict(result: dict[str, Any], problem: str | None, out: Path) -> dict[str, Any]:
    """A trial's JSON line: ok, or the problem and the tail of the launcher's log."""
    result["ok"] = problem is None
    if problem:
        result["problem"] = problem
        result["log_tail"] = (out / "launcher.out").read_text()[-2000:]
    return result


def trial_restart(
    out: Path, want: dict[str, Any], rng: random.Random, steps: int, timeout_s: float
) -> dict[str, Any]:
    """SIGKILL rank 1 at a random step under --max-restarts 2; the job must resume exactly."""
    kill_at = rng.randint(SAVE_EVERY // 2 + 1, steps - 2)
    start = time.monotonic()
    proc = launch(out, steps, "--max-restarts", "2")
    pid_file = out / "pid.rank1.restart0"
    killed_at = None
    while time.monotonic() - start < timeout_s and proc.poll() is None:
        rows = metrics_rows(out)
        if rows >= kill_at and pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            killed_at = rows
            break
        time.sleep(0.01)
    rc = wait_launcher(proc, max(1.0, timeout_s - (time.monotonic() - start)))
    result: dict[str, Any] = {
        "kind": "restart",
        "kill_at_step": killed_at,
        "exit": rc,
        "seconds": round(time.monotonic() - start, 1),
    }
    done = json.loads((out / "done.json").read_text()) if (out / "done.json").exists() else {}
    result.update(done)
    if killed_at is None:
        problem = "the job ended before the kill" if rc is not None else "never reached the step"
    elif rc is None:
        problem = f"hung: killed at the {timeout_s:.0f}s deadline"
    elif rc != 0:
        problem = f"launcher exited {rc}"
    elif done.get("restart", 0) < 1:
        problem = "finished without a restart"
    else:
        problem = same_bits(final_weights(out), want) or _restart_told(out)
    return _verdict(result, problem, out)


def _restart_told(out: Path) -> str | None:
    """None when the launcher's log names the dead rank, the restart and the resumed step."""
    log = (out / "launcher.out").read_text()
    wanted = ["rank 1: was killed by signal 9 (SIGKILL)", "rank 0: stopped because rank 1 ended",
              "restart 1 of 2", "restart 1: resumed from step"]  # fmt: skip
    missing = [w for w in wanted if w not in log]
    if missing:
        return f"the log does not say {missing}"
    if "StallError" in log:
        return "the dead peer was reported as a stall"
    return None


def _wait_for_step(out: Path, proc: subprocess.Popen[str], step: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while metrics_rows(out) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def trial_preempt(
    out: Path, want: dict[str, Any], rng: random.Random, steps: int, timeout_s: float
) -> dict[str, Any]:
    """SIGTERM to the launcher at a random step (a scheduler reclaiming the node): the Runner
    finishes the step, saves and exits; the next start resumes; the end must equal the
    uninterrupted run bitwise."""
    at = rng.randint(2, steps - 2)
    start = time.monotonic()
    proc = launch(out, steps)
    reached = _wait_for_step(out, proc, at, timeout_s)
    if reached:
        proc.send_signal(signal.SIGTERM)
    rc = wait_launcher(proc, timeout_s)
    log = (out / "launcher.out").read_text()
    said = re.findall(r"stopped after optimizer step (\d+) and saved", log)
    result: dict[str, Any] = {
        "kind": "preempt",
        "signal_at_step": metrics_rows(out) if reached else None,
        "exit": rc,
        "saved_at_step": int(said[0]) if said else None,
    }
    rc2 = wait_launcher(launch(out, steps, log="relaunch"), timeout_s) if said else None
    result["relaunch_exit"] = rc2
    result["seconds"] = round(time.monotonic() - start, 1)
    if not reached:
        problem: str | None = "the job ended before the signal"
    elif rc is None:
        problem = "hung after SIGTERM"
    elif not said:
        problem = f"no checkpoint saved on SIGTERM (launcher exit {rc})"
    elif rc2 != 0:
        problem = f"the relaunch exited {rc2}"
    else:
        problem = same_bits(final_weights(out), want)
    return _verdict(result, problem, out)


STALL_TIMEOUT_S = 5


def trial_stall(
    out: Path, want: dict[str, Any], rng: random.Random, steps: int, timeout_s: float
) -> dict[str, Any]:
    """Rank 1 stops coming at a random step; with `--timeout 5` the job must end within 60 s
    with a StallError naming rank 1 and the step."""
    at = rng.randint(2, steps - 2)
    start = time.monotonic()
    proc = launch(out, steps, "--timeout", str(STALL_TIMEOUT_S), env={"SOAK_STALL_AT": str(at)})
    rc = wait_launcher(proc, 120)
    seconds = time.monotonic() - start
    log = (out / "launcher.out").read_text()
    named = re.findall(r"train step (\d+) stalled: rank\(s\) 1 did not arrive", log)
    result: dict[str, Any] = {
        "kind": "stall",
        "stall_at_batch": at,
        "exit": rc,
        "named_step": int(named[0]) if named else None,
        "seconds": round(seconds, 1),
    }
    if rc is None:
        problem: str | None = "hung: killed at 120 s"
    elif rc == 0:
        problem = "the job finished despite the stall"
    elif not named:
        problem = "no StallError naming rank 1"
    elif seconds > 60:
        problem = f"the job took {seconds:.0f} s to end (bound: 60 s)"
    else:
        problem = None
    return _verdict(result, problem, out)


def trial_kill_during_save(
    out: Path, want: dict[str, Any], rng: random.Random, steps: int, timeout_s: float
) -> dict[str, Any]:
    """Async saves under --max-restarts 2: SIGKILL rank 1 while a checkpoint is still being
    written (its `.tmp-step_*` directory exists, not yet renamed); the job must resume from
    an earlier complete checkpoint and end bitwise equal to the uninterrupted run."""
    after = rng.randint(SAVE_EVERY + 1, steps - SAVE_EVERY - 1)
    start = time.monotonic()
    proc = launch(out, steps, "--max-restarts", "2", env={"SOAK_ASYNC": "1"})
    ckdir, pid_file = out / "run" / "checkpoints", out / "pid.rank1.restart0"
    torn = None
    while time.monotonic() - start < timeout_s and proc.poll() is None:
        if metrics_rows(out) >= after and pid_file.exists():
            writing = sorted(ckdir.glob(".tmp-step_*")) if ckdir.exists() else []
            if writing:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                torn = int(writing[-1].name.rsplit("_", 1)[1])
                break
        time.sleep(0.002)
    rc = wait_launcher(proc, max(1.0, timeout_s - (time.monotonic() - start)))
    done = json.loads((out / "done.json").read_text()) if (out / "done.json").exists() else {}
    result: dict[str, Any] = {
        "kind": "kill_during_save",
        "torn_step": torn,
        "exit": rc,
        "seconds": round(time.monotonic() - start, 1),
        **done,
    }
    if torn is None:
        problem: str | None = "never saw a save in progress"
    elif rc != 0:
        problem = "hung" if rc is None else f"launcher exited {rc}"
    elif done.get("restart", 0) < 1:
        problem = "finished without a restart"
    elif done.get("resumed_from", 0) >= torn:
        problem = f"resumed from step {done.get('resumed_from')}, not before the torn {torn}"
    else:
        problem = same_bits(final_weights(out), want)
    return _verdict(result, problem, out)


Trial = Callable[[Path, dict[str, Any], random.Random, int, float], dict[str, Any]]

KINDS: dict[str, Trial] = {
    "restart": trial_restart,
    "preempt": trial_preempt,
    "stall": trial_stall,
    "kill_during_save": trial_kill_during_save,
}
NOT_WIRED: dict[str, str] = {}  # kinds named but not built yet (raise NotImplementedError)


def drive(kinds: list[str], trials: int, seed: int, timeout_s: float, as_json: bool) -> int:
    for kind in kinds:
        if kind in NOT_WIRED:
            raise NotImplementedError(f"soak kind {kind!r} is not wired in yet: {NOT_WIRED[kind]}")
    rng = random.Random(seed)
    failed = 0
    with tempfile.TemporaryDirectory(prefix="shardwise-soak-") as tmp:
        root = Path(tmp)
        want = reference(root, STEPS, timeout_s)
        for kind in kinds:
            ok = 0
            times = []
            for n in range(trials):
                result = KINDS[kind](root / f"{kind}{n}", want, rng, STEPS, timeout_s)
                ok += result["ok"]
                times.append(result["seconds"])
                shown = result if as_json or not result["ok"] else {
                    k: v for k, v in result.items() if k != "log_tail"
                }  # fmt: skip
                print(json.dumps(shown), flush=True)
            mean = sum(times) / len(times)
            print(f"{ok} of {trials} {kind} (mean {mean:.1f} s per trial)", flush=True)
            failed += trials - ok
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = common.arg_parser(__doc__)
    sub = parser.add_subparsers(dest="command")
    j = sub.add_parser("job", help="the training job (run by the driver via shardwise run)")
    j.add_argument("--dir", required=True, type=Path)
    j.add_argument("--steps", type=int, default=STEPS)
    kinds = sorted([*KINDS, *NOT_WIRED])
    parser.add_argument("--kind", action="append", choices=kinds, default=None)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    parser.add_argument("--json", action="store_true", help="include the log tail of every trial")
    args = parser.parse_args(argv)
    if args.command == "job":
        job(args.dir, args.steps)
        return 0
    if args.trials < 1:
        parser.error(f"--trials={args.trials}: use a positive integer")
    return drive(args.kind or ["restart"], args.trials, args.seed, args.timeout, args.json)


if __name__ == "__main__":
    sys.exit(main())
