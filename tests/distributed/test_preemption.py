"""Preemption, the way a cluster does it: SIGTERM to torchrun while 2 workers train.

torchrun's agent turns SIGTERM into SignalException, forwards SIGTERM to each worker and
gives them --shutdown-timeout (30 s) before SIGKILL. The workers finish the optimizer step,
agree on it, save a checkpoint there and exit 75; torchrun exits non-zero without
restarting. The next start with resume='latest' must end with the same parameters, bit
for bit, as a run never interrupted (CPU, fp32).

Run as a script (by torchrun), this file is the worker. `preemption_trial` is one trial,
for soak scripts that repeat it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

STEPS = 10
SIGNAL_AFTER_STEP = 2  # the launcher is signalled once step 2 is in metrics.csv
STEP_SECONDS = 0.1  # each forward sleeps: the signal lands mid-run, not after it


# --- the worker ---------------------------------------------------------------------------


class SlowMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(STEP_SECONDS)
        return torch.nn.functional.mse_loss(self.net(x), y)


def worker(run_dir: str, resume: str | None) -> None:
    import shardwise
    from shardwise import Engine, ParallelConfig, Runner, RunnerConfig, TrainConfig
    from shardwise.train import Preempted

    shardwise.init_distributed()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
    )
    engine = Engine(
        SlowMLP(),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        ParallelConfig(strategy="full_shard"),
        train=TrainConfig(accumulate_steps=2),
    )
    config = RunnerConfig(
        run_dir=run_dir, batch_size=2, max_steps=STEPS, max_epochs=None, log_every=1,
        progress=False, resume=resume,
    )  # fmt: skip
    try:
        Runner(engine, data, config=config).fit()
    except Preempted:
        shardwise.shutdown()
        raise
    shardwise.export_weights(engine.model, Path(run_dir) / "export")
    shardwise.shutdown()


# --- the trial ----------------------------------------------------------------------------


def _launch(
    run_dir: Path, resume: str | None = None, launcher: str = "torchrun"
) -> subprocess.Popen[str]:
    from shardwise.testing import free_port

    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port())]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2"]
    cmd += [__file__, str(run_dir), *([resume] if resume else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Its own session: a timeout kills the launcher and its workers together.
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout_s: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout_s}s:\n{err[-3000:]}") from None
    return proc.returncode, err


def _logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    except FileNotFoundError:
        return 0
    return max((int(line.split(",")[0]) for line in lines if ",train," in line), default=0)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "export" / "model.safetensors"))


def preemption_trial(tmp: Path, baseline: dict[str, torch.Tensor] | None = None) -> dict:
    """One trial: an uninterrupted run (unless `baseline` weights are given), a run whose
    launcher gets SIGTERM after step 2, and its restart with resume='latest'."""
    if baseline is None:
        code, err = _finish(_launch(tmp / "full"))
        assert code == 0, err[-3000:]
        baseline = _weights(tmp / "full")
    run = tmp / "cut"
    proc = _launch(run)
    deadline = time.monotonic() + 120
    while _logged_step(run) < SIGNAL_AFTER_STEP and proc.poll() is None:
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # to torchrun only, as a scheduler reclaiming the node
    code, err = _finish(proc)
    said = re.findall(r"stopped after optimizer step (\d+) and saved (\S+);", err)
    stopped = int(said[0][0]) if said else None
    latest = (run / "checkpoints" / "latest").read_text().strip() if said else None
    code_again, err_again = _finish(_launch(run, "latest"))
    assert code_again == 0, err_again[-3000:]
    resumed = _weights(run)
    return {
        "launcher_code": code,
        "stderr": err,
        "said": said,
        "stopped": stopped,
        "latest": latest,
        "equal": sorted(resumed) == sorted(baseline)
        and all(torch.equal(resumed[k], baseline[k]) for k in baseline),
        "baseline": baseline,
    }


def test_sigterm_to_torchrun_saves_at_the_step_and_the_next_start_resumes_exactly(tmp_path):
    got = preemption_trial(tmp_path)
    err = got["stderr"]
    # torchrun's agent got the signal: SignalException, no restart, exit 1 (the exception
    # leaves torchrun's main); the workers' own exit code (75) is not what torchrun reports.
    assert got["launcher_code"] == 1 and "SignalException" in err, err[-3000:]
    assert len(got["said"]) == 1, err[-3000:]  # rank 0 alone says it, once
    s = got["stopped"]
    assert SIGNAL_AFTER_STEP <= s < STEPS, err[-3000:]
    assert got["said"][0][1].endswith(f"step_{s:08d}") and got["latest"] == f"step_{s:08d}"
    assert "exiting with code 75. Start the job again with RunnerConfig.resume='latest'" in err
    assert got["equal"]  # final parameters bitwise equal to the uninterrupted run


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_sigterm_to_shardwise_run_ends_with_75_and_no_traceback(tmp_path, sig):
    # Before: the workers exited 75, but the launcher exited 1 with torchrun's
    # SignalException traceback, though the README promised 75. SIGUSR1 (SLURM's warning
    # before a time limit) ended the launcher at once, and its workers unsaved.
    run = tmp_path / "cut"
    proc = _launch(run, launcher="shardwise")
    deadline = time.monotonic() + 120
    while _logged_step(run) < SIGNAL_AFTER_STEP and proc.poll() is None:
        assert time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.05)
    proc.send_signal(sig)
    code, err = _finish(proc)
    assert code == 75, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert f"shardwise run: {sig.name}: the workers were stopped" in err
    assert re.search(r"stopped after optimizer step \d+ and saved \S+;", err), err[-3000:]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("resume", nargs="?")
    args = parser.parse_args()
    worker(args.run_dir, args.resume)
