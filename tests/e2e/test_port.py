"""examples/port: the causal LM script ported to shardwise runs unchanged under a DeepSpeed
ZeRO-3 JSON, an Accelerate FSDP YAML and a torchtitan TOML (tp 2) at world 2, and each run
equals the plain one-process script it was ported from: the loss at every step and the
final weights, within rel 1e-5. A file that changes the training (clipping at 0.01) is
caught. docs/comparison.md's line counts are the ones bench/port_lines.py measures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise.testing.parity import ParityError, Trajectory, compare_trajectories

pytestmark = pytest.mark.foreign  # `make test-foreign` (and .ci/run), not `make test`

ROOT = Path(__file__).resolve().parents[2]
PORT = ROOT / "examples" / "port"
FILES = {
    "deepspeed": ("--deepspeed", "ds_zero3.json"),
    "accelerate": ("--accelerate-config", "accelerate_fsdp.yaml"),
    "torchtitan": ("--from", "torchtitan.toml"),
}


def _train(tmp: Path, cmd: list[str]) -> Trajectory:
    from safetensors.torch import load_file

    out = tmp / f"out{len(list(tmp.glob('out*')))}"
    done = subprocess.run(
        [*cmd, str(out)], capture_output=True, text=True, timeout=300, cwd=tmp,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^loss (\S+)$", done.stdout, re.MULTILINE)]
    assert len(losses) == 4, done.stdout
    return Trajectory(losses, load_file(str(out / "model.safetensors")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Trajectory:
    return _train(tmp_path_factory.mktemp("plain"), [sys.executable, str(PORT / "train_plain.py")])


def _shardwise(flag: str, config: Path) -> list[str]:
    cli = [sys.executable, "-m", "shardwise.cli", "run", "--nproc", "2"]
    return [*cli, flag, str(config), str(PORT / "train.py")]


@pytest.mark.parametrize("tool", list(FILES))
def test_the_ported_script_under_each_file_equals_the_plain_one(tmp_path, plain, tool) -> None:  # type: ignore[no-untyped-def]
    flag, name = FILES[tool]
    got = _train(tmp_path, _shardwise(flag, PORT / name))
    print(f"{tool}:", compare_trajectories(plain, got, rtol=1e-5, label=tool))


def test_a_file_that_changes_the_training_is_caught(tmp_path, plain) -> None:  # type: ignore[no-untyped-def]
    config = json.loads((PORT / "ds_zero3.json").read_text())
    config["gradient_clipping"] = 0.01
    path = tmp_path / "ds_clipped.json"
    path.write_text(json.dumps(config))
    clipped = _train(tmp_path, _shardwise("--deepspeed", path))
    with pytest.raises(ParityError):
        compare_trajectories(plain, clipped, rtol=1e-3)


def test_comparison_page_states_the_measured_line_counts() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import port_lines

    page = (ROOT / "docs" / "comparison.md").read_text()
    for pair, count in port_lines.measure().items():
        before, after = pair.split(" -> ")
        row = f"| `{before}` | `{after}` | {count} |"
        assert row in page, f"docs/comparison.md lacks the row {row!r}"
