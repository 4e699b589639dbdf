"""End to end: the bf16 vision example launched the way a user launches it."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from _proc import run_in_session

from shardwise.testing import free_port
from shardwise.train import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vision_bf16.py"
VAL = r"val loss (\S+)\s+val acc (\S+)"


_run = run_in_session


def _val(line_start: str, out: str) -> tuple[float, float]:
    """(val loss, val acc) from the one stdout line starting with `line_start`."""
    lines = [line for line in out.splitlines() if line.startswith(line_start)]
    assert len(lines) == 1, f"expected one {line_start!r} line (rank 0 only):\n{out}"
    match = re.search(VAL, lines[0])
    assert match, lines[0]
    return float(match.group(1)), float(match.group(2))


def _check_metrics(run_dir: Path, steps: int) -> None:
    rows = read_metrics(run_dir)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [int(r["step"]) for r in train] == list(range(1, steps + 1))
    assert val and int(val[0]["step"]) == 0 and int(val[-1]["step"]) == steps
    for row in train + val:
        for key in ("loss", "acc"):
            assert row.get(key) is not None and math.isfinite(row[key]), row
        assert 0.0 <= row["acc"] <= 1.0, row


def test_plain_python_is_world_one_and_learns(tmp_path):
    # Long enough to learn (chance is 0.1), short enough to run in a few seconds.
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(EXAMPLE), "--steps", "40", "--batch", "64", "--run-dir", str(run_dir)]  # fmt: skip
    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # One process: no sharding, bf16 through autocast, which keeps BatchNorm in fp32 itself.
    assert "unwrapped at world size 1 (param=bfloat16" in out
    loss0, acc0 = _val("before training:", out)
    loss, acc = _val("done: 40 steps on 1 rank(s)", out)
    assert f"run dir {run_dir}" in out
    assert all(math.isfinite(v) for v in (loss0, acc0, loss, acc))
    assert acc > 0.3 and acc > acc0 + 0.15, out
    assert loss < loss0 - 0.3, out
    _check_metrics(run_dir, 40)


def test_torchrun_two_processes(tmp_path):
    strategy = "full_shard"  # the example's default, stated so the assertions can name it
    run_dir = tmp_path / "run"
    # A private port per launch: concurrent jobs on one machine must not meet.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(EXAMPLE), "--strategy", strategy, "--steps", "4", "--batch", "16",
           "--run-dir", str(run_dir)]  # fmt: skip
    result = _run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert f"{strategy}:" in out and "world 2" in out
    # The plan gives every BatchNorm a float32 unit of its own; the conv blocks stay bf16.
    fp32_units = re.findall(r"^blocks\.\d\.norm\s+BatchNorm2d\s.*float32.*keep_fp32$", out, re.M)
    assert len(fp32_units) == 3, out
    assert re.search(r"^blocks\.0\s+ConvBlock\s.*bfloat16", out, re.M), out
    # Only rank 0 prints: each line appears exactly once.
    assert out.count("WrapPlan:") == 1
    _val("before training:", out)
    loss, acc = _val("done: 4 steps on 2 rank(s)", out)
    assert math.isfinite(loss) and 0.0 <= acc <= 1.0
    assert f"run dir {run_dir}" in out
    _check_metrics(run_dir, 4)
