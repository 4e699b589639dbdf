"""The shardwise command line, run as a user runs it (subprocesses)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from shardwise import STRATEGIES, Engine, Runner, RunnerConfig, shutdown
from shardwise.checkpoint import save_checkpoint
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

CFG = GPTConfig()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True, timeout=240
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


# --- run, plan, demo, config --------------------------------------------------------------

RANK_SCRIPT = """
import os, sys
import torch.distributed as dist
import shardwise
info = shardwise.init_distributed()
t = __import__("torch").tensor([float(info.rank + 1)])
dist.all_reduce(t)
# One write per line: two ranks share the pipe, and print() writes text and newline apart.
sys.stdout.write(f"rank {info.rank}/{info.world_size} sum {t.item():.0f} args {sys.argv[1:]}\\n")
sys.stdout.flush()
shardwise.shutdown()
"""


def test_run_launches_two_processes(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    out = cli("run", "--nproc", "2", str(script), "--flag", "x")
    assert out.returncode == 0, out.stderr[-2000:]
    found = sorted(re.findall(r"rank \d/\d sum \d args \[[^\]]*\]", out.stdout))
    assert found == ["rank 0/2 sum 3 args ['--flag', 'x']", "rank 1/2 sum 3 args ['--flag', 'x']"]


def test_run_reports_a_failing_script(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit(3)\n")
    out = cli("run", "--nproc", "2", str(script))
    assert out.returncode == 1, out.stderr
    assert "shardwise run: 2 rank(s) failed:\n  ranks 0, 1: exited with code 3" in out.stderr


PLAIN_REFUSALS = {
    "no_optimizer": (
        "shardwise.Engine(GPT(GPTConfig()))",
        "[rank0]: TypeError: Engine(model) needs an optimizer: pass one, or a factory such as "
        "lambda params: torch.optim.AdamW(params, lr=3e-4). (A script launched by `shardwise run "
        "--from FILE` whose file has an optimizer block may leave it out.)\n",
    ),
    "pp_at_world_1": (
        "shardwise.Engine(GPT(GPTConfig()), lambda p: torch.optim.SGD(p, lr=0.1), "
        "shardwise.ParallelConfig(pp=2))",
        "[rank0]: ValueError: ParallelConfig.pp=2 at world size 1: each pipeline stage needs "
        "ranks of its own. Launch at least 2 processes (shardwise run --nproc 2 ...), or use "
        "pp=1.\n",
    ),
}


@pytest.mark.parametrize("case", sorted(PLAIN_REFUSALS))
def test_a_refusal_in_a_plain_python_run_is_one_line(tmp_path, case):
    """Before: a `[rank0]:` traceback of 10 lines ending in the message. SHARDWISE_TRACEBACK=1
    still shows it (docs/troubleshooting.md)."""
    call, line = PLAIN_REFUSALS[case]
    script = tmp_path / "plain.py"
    script.write_text(
        "import torch\nimport shardwise\nfrom shardwise.testing.models import GPT, GPTConfig\n"
        f"shardwise.init_distributed()\n{call}\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert (out.returncode, out.stderr) == (1, line)
    if case == "no_optimizer":
        env = {**os.environ, "SHARDWISE_TRACEBACK": "1"}
        full = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env
        )
        assert full.returncode == 1
        assert full.stderr.startswith("[rank0]: Traceback (most recent call last):")
        assert full.stderr.endswith(line) and "from_env.py" in full.stderr


def test_run_checks_overrides_before_spawning_without_a_config():
    """The newcomer's typo: refused in one line in about 3 s, nothing started (before: the
    workers started and said it 8 s later, with a traceback each)."""
    from shardwise import ParallelConfig

    out = cli("run", "--nproc", "2", "examples/train_lm.py", "parallel.stratgy=full_shard")
    valid = sorted(f.name for f in dataclasses.fields(ParallelConfig) if f.init)
    assert (out.returncode, out.stderr) == (
        2,
        "shardwise run: error: unknown key 'parallel.stratgy'. Did you mean 'strategy'? "
        f"Valid keys in parallel: {valid}.\n",
    )


def test_run_multi_node_needs_an_endpoint(tmp_path):
    out = cli("run", "--nproc", "2", "--nnodes", "2", str(tmp_path / "x.py"))
    assert out.returncode == 2 and "--nnodes=2 needs --rdzv-endpoint HOST:PORT" in out.stderr


def test_plan_prints_units_and_memory():
    out = cli(
        "plan", "shardwise.testing.models:GPT", "--world", "4", "parallel.mixed_precision=bf16"
    )
    assert out.returncode == 0, out.stderr
    assert "WrapPlan: 3 unit(s)" in out.stdout and "auto: 2x Block" in out.stdout
    for strategy in STRATEGIES:
        assert f"\n{strategy} " in out.stdout


def test_plan_json_matches_the_16_psi_over_n_formula():
    import json

    out = cli("plan", "shardwise.testing.models:GPT", "--world", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    params = data["plan"]["total_params"]
    full = next(m for m in data["memory"] if m["strategy"] == "full_shard")
    assert abs(full["model_states"] - 16 * params / 4) <= 16 * 4  # padding of a few elements


def test_plan_bad_target():
    out = cli("plan", "shardwise.testing.models", "--world", "2")
    assert out.returncode == 2 and "is not MODULE:FACTORY" in out.stderr
    out = cli("plan", "shardwise.testing.models:Nope", "--world", "2")
    assert out.returncode == 2 and "has no attribute 'Nope'" in out.stderr


def test_demo_short(tmp_path):
    out = cli("demo", "--short", f"runner.run_dir={tmp_path / 'demo'}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--- summary ---" in out.stdout and out.stdout.count("--- summary ---") == 1
    assert "validation loss" in out.stdout and "tokens/s" in out.stdout
    for name in ("metrics.csv", "export/model.safetensors", "checkpoints/latest"):
        assert (tmp_path / "demo" / name).exists(), name


def test_config_show_and_errors(tmp_path):
    out = cli("config", "show", "runner.max_steps=7", "parallel.strategy=FULL_SHARD")
    assert (
        out.returncode == 0
        and "max_steps: 7" in out.stdout
        and "strategy: full_shard" in out.stdout
    )
    bad = cli("config", "show", "runner.max_step=7")
    assert (
        bad.returncode == 2
        and "unknown key 'runner.max_step'. Did you mean 'max_steps'?" in bad.stderr
    )


def test_run_and_plan_argument_errors():
    bad = cli("run", "--nproc", "zero", "x.py")
    assert bad.returncode == 2 and "--nproc='zero': use a positive integer or 'auto'" in bad.stderr
    bad = cli("plan", "shardwise.testing.models:CFG_NOT_THERE", "--world", "2")
    assert bad.returncode == 2 and "has no attribute" in bad.stderr
    bad = cli("plan", "shardwise:__version__", "--world", "2")
    assert bad.returncode == 2 and "shardwise:__version__ is not callable" in bad.stderr


def test_plan_simulate_reports_each_strategy_with_activations():
    out = cli(
        "plan",
        "shardwise.testing.models:GPT",
        "--world",
        "4",
        "--simulate",
        "--batch",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    sims, estimates = report["simulated"], report["memory"]
    assert [s["strategy"] for s in sims] == [e["strategy"] for e in estimates]
    for sim, est in zip(sims, estimates, strict=True):
        assert sim["world_size"] == 4 and sim["batch"] == 2
        assert sim["category_peaks"]["activations"] > 0
        # a whole step holds at least the model states the analytic plan counts
        assert sim["peak"] >= est["model_states"]
    # each row has the instant estimate next to the simulation, and a fit against the budget
    for row, sim in zip(report["peaks"], sims, strict=True):
        assert row["simulated"] == sim["peak"] and row["fits"] is True
        assert 0.8 <= row["estimate"] / row["simulated"] <= 1.25  # tiny model: fixed costs


def test_plan_marks_rows_and_resolves_auto():
    table = cli("plan", "shardwise.testing.models:GPT", "--world", "4", "--memory-budget", "600KiB")
    assert table.returncode == 0, table.stderr[-3000:]
    marks = [line.split()[-1] for line in table.stdout.splitlines() if line.startswith("  ddp ")]
    assert marks == ["no"]  # ddp's replica does not fit 600 KiB; a sharded row does
    assert any(
        line.startswith("  full_shard ") and line.split()[-1] == "yes"
        for line in table.stdout.splitlines()
    )
    auto = cli(
        "plan", "shardwise.testing.models:GPT", "--world", "4", "--memory-budget", "600KiB",
        "parallel.strategy=auto",
    )  # fmt: skip
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert (
        "chosen: strategy='shard_grad_op'" in auto.stdout or "chosen: strategy='full" in auto.stdout
    )
    nothing = cli(
        "plan", "shardwise.testing.models:GPT", "--world", "2", "--memory-budget", "10KiB",
        "parallel.strategy=auto",
    )  # fmt: skip
    assert nothing.returncode == 2
    assert "No plan fits: the smallest per-rank peak is" in nothing.stderr
    assert "cpu_offload=True" in nothing.stderr


CNN_MODULE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)) + x


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(16) for _ in range(2)])
        self.head = nn.Linear(16, 10)

    def forward(self, x, y):
        logits = self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))
        return nn.functional.cross_entropy(logits, y)


def build():
    return Net()


def batch():
    return torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
"""


def test_plan_any_model_from_the_current_directory_with_its_own_input(tmp_path):
    # Before: the current directory was not importable, --simulate and --batch were silently
    # ignored for a model without a sequence length, and strategy=auto asked for an
    # example_input the CLI could not pass.
    (tmp_path / "mycnn.py").write_text(CNN_MODULE)
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    shardwise_cli = [sys.executable, "-m", "shardwise.cli", "plan", "mycnn:build"]
    auto = run([*shardwise_cli, "--input", "mycnn:batch", "--world", "2", "--simulate",
                "--memory-budget", "1GiB", "parallel.strategy=auto"])  # fmt: skip
    assert auto.returncode == 0, auto.stderr
    assert "strategy='auto' at world 2, the example batch" in auto.stdout
    assert re.search(
        r"ddp\s+none\s+[\d.]+ [KM]iB\s+[\d.]+ [KM]iB (fast|full)\s+yes\s+<- chosen", auto.stdout
    )
    ignored = run([*shardwise_cli, "--world", "2", "--simulate"])
    assert ignored.returncode == 2
    assert "--simulate needs the batch the model trains on" in ignored.stderr
    assert "--input MODULE:FUNCTION" in ignored.stderr
    both = run([*shardwise_cli, "--input", "mycnn:batch", "--batch", "8", "--world", "2"])
    assert both.returncode == 2 and "--batch describes the default token input" in both.stderr
