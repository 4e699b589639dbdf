"""End to end: examples/train_lm.py trained, exported, and started again from its export
on a meta-built model, launched the way a user launches it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from _proc import run_in_session

from shardwise.testing import free_port
from shardwise.train import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_lm.py"


def _launch(*args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(EXAMPLE), *args]  # fmt: skip
    result = run_in_session(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_train_export_then_start_from_the_export_on_meta(tmp_path):
    first = _launch("runner.max_steps=6", "runner.val_every=6", f"runner.run_dir={tmp_path / 'a'}")
    done = re.search(r"done: step 6 \(max_steps=6 reached\), val loss (\S+),", first)
    assert done, first
    export = tmp_path / "a" / "export"
    assert (export / "model.safetensors").is_file()
    # Rank 0 alone reads the export: the meta-built model starts where the first run ended.
    second = _launch("--init-from", str(export), "--rank0-reads", "runner.max_steps=2",
                     f"runner.run_dir={tmp_path / 'b'}")  # fmt: skip
    start = re.search(r"val loss of the weights in \S+: (\S+)", second)
    assert start, second
    assert float(start.group(1)) == float(done.group(1)), (first, second)
    assert second.count("val loss of the weights") == 1  # printed by rank 0 only


def test_the_done_line_shows_no_figure_for_a_validation_that_never_ran(tmp_path):
    """Before: `done: step 2, val loss nan, files in ...` (val_every=25 in the example's
    file, above max_steps)."""
    run_dir = tmp_path / "base"
    cmd = [sys.executable, str(EXAMPLE), "runner.max_steps=2", "runner.save_every=null",
           "runner.progress=false", f"runner.run_dir={run_dir}"]  # fmt: skip
    result = run_in_session(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == (
        f"done: step 2 (max_steps=2 reached), no validation ran, files in {run_dir}"
    )
    assert result.stderr.splitlines()[-1] == (
        "shardwise: finished after optimizer step 2: max_steps=2 reached"
    )


def test_same_seed_same_losses_from_step_one(tmp_path):
    """The README's promise: two identical runs log identical losses, the first included
    (the model is built after seeding)."""
    losses = []
    for name in ("a", "b"):
        cmd = [sys.executable, str(EXAMPLE), "runner.max_steps=2", "runner.log_every=1",
               "runner.val_every=null", "runner.save_every=null", "runner.progress=false",
               f"runner.run_dir={tmp_path / name}"]  # fmt: skip
        result = run_in_session(cmd)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = read_metrics(tmp_path / name)
        losses.append([r["loss"] for r in rows if r["split"] == "train"])
    assert len(losses[0]) == 2 and losses[0] == losses[1]


def test_a_resume_with_a_changed_lr_says_its_step_and_names_the_change(tmp_path):
    """`shardwise run` again with a new optimizer.lr and max_steps: one line says where from,
    one warning names each changed field with both values (the new lr is not used)."""
    run_dir = f"runner.run_dir={tmp_path / 'run'}"
    base = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", str(EXAMPLE), run_dir,
            "runner.val_every=null", "runner.save_every=2"]  # fmt: skip
    first = run_in_session([*base, "runner.max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_in_session([*base, "runner.max_steps=3", "optimizer.lr=0.01"])
    assert again.returncode == 0, again.stderr[-3000:]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert again.stderr.count(f"resumed from step 2 of {checkpoint}") == 1, again.stderr
    assert again.stderr.count("resuming with a config that differs") == 1
    assert "optimizer.lr: checkpoint 0.003, now 0.01 (the checkpoint's is used)" in again.stderr
    assert "runner.max_steps: checkpoint 2, now 3 (now's is used)" in again.stderr
