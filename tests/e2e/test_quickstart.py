"""End to end: the quickstart example launched the way a user launches it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def _run(cmd: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """Run in a new session so a timeout kills the launcher *and* its ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} timed out after {timeout_s}s\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("strategy", ["full_shard", "ddp"])
def test_torchrun_two_processes(strategy):
    # A private port per launch: concurrent jobs on one machine must not meet.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(EXAMPLE), "--strategy", strategy, "--steps", "3", "--batch", "4"]  # fmt: skip
    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"{strategy}:" in out and "world 2" in out
    # Only rank 0 prints: each line appears exactly once.
    assert len(re.findall(r"^step\s+0\s+loss", out, flags=re.M)) == 1
    assert "done: 3 steps" in out and "on 2 rank(s)" in out


def test_plain_python_is_world_one():
    result = _run([sys.executable, str(EXAMPLE), "--steps", "2", "--batch", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unwrapped at world size 1" in result.stdout
    assert "done: 2 steps" in result.stdout and "on 1 rank(s)" in result.stdout
