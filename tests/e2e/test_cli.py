"""The shardwise command line, run as a user runs it (subprocesses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from shardwise import Engine, Runner, RunnerConfig, shutdown
from shardwise.checkpoint import save_checkpoint
from shardwise.models import GPT, GPTConfig, random_lm_batches

CFG = GPTConfig()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    shutdown()
    root = tmp_path_factory.mktemp("ck")
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p))
    for batch in random_lm_batches(CFG, 2, 4):
        engine.train_step(batch)
        save_checkpoint(root, engine)
    (root / ".tmp-step_00000009").mkdir()  # an interrupted save
    return root


def test_checkpoint_ls(checkpoints):
    out = cli("checkpoint", "ls", str(checkpoints))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("step_00000001") and "complete" in lines[0]
    assert lines[1].startswith("step_00000002") and lines[1].endswith("<- latest")
    assert ".tmp-step_00000009" in lines[2] and "INCOMPLETE (ignored)" in lines[2]


def test_checkpoint_inspect(checkpoints):
    out = cli("checkpoint", "inspect", str(checkpoints))
    assert out.returncode == 0, out.stderr
    assert '"step": 2' in out.stdout and '"class": "AdamW"' in out.stdout
    assert (
        "model.tok_emb.weight" in out.stdout
        and "(64, 32)" in out.stdout
        and "float32" in out.stdout
    )


def test_checkpoint_export(checkpoints, tmp_path):
    out = cli(
        "checkpoint", "export", str(checkpoints), "--out", str(tmp_path / "w"), "--dtype", "bf16"
    )
    assert out.returncode == 0, out.stderr
    tensors = load_file(str(tmp_path / "w" / "model.safetensors"))
    assert (
        sorted(tensors) == sorted(GPT(CFG).state_dict())
        and tensors["ln_f.weight"].dtype == torch.bfloat16
    )


def test_checkpoint_verify_ok_then_corrupted(checkpoints, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoints / "step_00000002", copy)
    ok = cli("checkpoint", "verify", str(copy))
    assert ok.returncode == 0 and ok.stdout.strip().endswith(": OK"), ok.stdout + ok.stderr
    shard = next((copy / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    bad = cli("checkpoint", "verify", str(copy))
    assert bad.returncode == 1 and "PROBLEM state/__0_0.distcp: size" in bad.stdout


def test_checkpoint_missing_directory(tmp_path):
    out = cli("checkpoint", "ls", str(tmp_path / "nope"))
    assert out.returncode == 2 and "is not a directory of checkpoints" in out.stderr


def test_plot_command(tmp_path):
    shutdown()
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), lambda p: torch.optim.AdamW(p))
    data = TensorDataset(*random_lm_batches(CFG, 1, 16)[0])
    Runner(
        engine,
        data,
        config=RunnerConfig(run_dir=str(tmp_path / "run"), batch_size=4, progress=False),
    ).fit()
    out = cli("plot", str(tmp_path / "run"))
    assert out.returncode == 0 and "wrote" in out.stdout, out.stderr
    assert (tmp_path / "run" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
