"""A plain script, unchanged, driven by another tool's config file: `shardwise run --nproc 2
--deepspeed ds_config.json train.py` (ZeRO-3) and `--accelerate-config` an FSDP YAML, each
against the same script in one process. The script calls `shardwise.Engine(model, ...)`
with no config (after `shardwise.init_distributed()`), so its layout comes from the file;
it reads its rows of every global batch from `wrap_info`. Compared: the loss at every step (the mean over ranks) and the final
parameters, within rel 1e-5. A file with a refused key stops `shardwise run` before
anything starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.testing.parity import worst_of

pytestmark = pytest.mark.foreign  # `make test-foreign` (and .ci/run), not `make test`

SCRIPT = """
import functools, json, sys
import torch
import shardwise
from shardwise.testing.models import GPT, GPTConfig, random_lm_batches

shardwise.init_distributed()
cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
torch.manual_seed(0)
engine = shardwise.Engine(GPT(cfg), functools.partial(torch.optim.SGD, lr=0.5))
info = shardwise.wrap_info(engine.model)
rank, size = (info.dp_rank, info.dp_size) if info is not None else (0, 1)
losses = []
for x, y in random_lm_batches(cfg, 3, 8):
    rows = slice(rank * 8 // size, (rank + 1) * 8 // size)
    loss = engine.train_step((x[rows], y[rows]))["loss"]
    losses.append(float(shardwise.mean_across_ranks(torch.tensor(loss))))
params = {}
for name, p in engine.model.named_parameters():
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    params[name] = full.detach().double().flatten().tolist()
launched = shardwise.translation_from_env()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"losses": losses, "params": params, "size": size,
                   "strategy": None if info is None else info.config.strategy,
                   "source": None if launched is None else launched.source}, f)
"""
DS_ZERO3 = {
    "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 8,
    "steps_per_print": 100,
}  # fmt: skip
ACCELERATE_FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


def _run(tmp_path: Path, *launch: str) -> dict:  # type: ignore[type-arg]
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.json"
    cmd = [*launch, str(script), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    result["stderr"] = done.stderr
    return result  # type: ignore[no-any-return]


def _shardwise(*args: str) -> list[str]:
    return [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2", *args]


def _rel(a: float | list[float], b: float | list[float]) -> float:
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((x - y).norm() / y.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    return _run(tmp_path_factory.mktemp("one"), sys.executable)


@pytest.mark.parametrize("tool", ["deepspeed", "accelerate"])
def test_the_unchanged_script_on_two_processes_equals_one(
    tmp_path: Path,
    one_process: dict,
    tool: str,  # type: ignore[type-arg]
) -> None:
    if tool == "deepspeed":
        config = tmp_path / "ds_config.json"
        config.write_text(json.dumps(DS_ZERO3))
        flag, strategy, source = "--deepspeed", "full_shard", "DeepSpeed"
    else:
        config = tmp_path / "default_config.yaml"
        config.write_text(ACCELERATE_FSDP)
        flag, strategy, source = "--accelerate-config", "shard_grad_op", "Accelerate"
    got = _run(tmp_path, *_shardwise(flag, str(config)))
    assert (got["size"], got["strategy"], got["source"]) == (2, strategy, source)
    assert f"shardwise run: {source} config" in got["stderr"]
    assert one_process["size"] == 1 and one_process["source"] is None
    worst = worst_of(
        [_rel(got["losses"], one_process["losses"])]
        + [_rel(got["params"][name], value) for name, value in one_process["params"].items()]
    )
    print(f"{tool}: rel {worst:.2e}")
    assert worst < 1e-5


def test_a_refused_key_stops_the_launch_before_anything_starts(tmp_path: Path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(
        json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}})
    )
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not start')\n")
    done = subprocess.run(
        _shardwise("--from", str(config), str(script)), capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "zero_optimization.zero_quantized_weights" in done.stderr
    assert "Nothing was started." in done.stderr and "must not start" not in done.stderr
