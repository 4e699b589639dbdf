"""End to end: the quickstart example launched the way a user launches it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from _proc import run_in_session

from shardwise.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


_run = run_in_session


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


MIXIN = ROOT / "examples" / "mixin_trainer.py"


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        ([], "ddp: 2 replica group(s) x 1 shard rank(s)"),  # use_fsdp=False: DDP, as the mixin
        (
            ["--use-fsdp", "--sharding-strategy", "ShardingStrategy.FULL_SHARD"],
            "full_shard: 1 replica group(s) x 2 shard rank(s)",
        ),
    ],
)
def test_trainer_mixin_example(flags, shown):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(MIXIN), "--steps", "2", *flags]  # fmt: skip
    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert shown in result.stdout and "done: 2 steps on 2 rank(s)" in result.stdout


def test_the_readmes_runner_takes_its_max_steps_at_two_processes(tmp_path):
    """The README's Runner snippet (max_steps=8) under `shardwise run --nproc 2`. Before: it
    stopped after 4 steps, because an epoch has half the steps at 2 ranks and the default
    max_epochs=1 came first, and nothing said so."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Training with `Engine` and `Runner`") :]
    start = section.index("```python\n") + len("```python\n")
    (tmp_path / "readme_runner.py").write_text(section[start : section.index("```", start)])
    cmd = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", "readme_runner.py"]
    result = run_in_session(cmd, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("shardwise: ")]
    assert lines == ["shardwise: finished after optimizer step 8: max_steps=8 reached"]
