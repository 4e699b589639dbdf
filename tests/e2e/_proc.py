"""Running commands the way a user does, for the end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_in_session(
    cmd: list[str], timeout_s: float = 240, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run in a new session so a timeout kills the launcher *and* its ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd} timed out after {timeout_s}s\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
