"""docs/hosts.md's mmengine, Lightning, Fabric and Hugging Face Trainer commands, run as written in a fresh directory.

They take about a minute together (mmengine and Lightning each start their own processes),
so they run with the other host tests under `-m integrations`, not in `make test`."""

from __future__ import annotations

import pytest
from _doc_blocks import ROOT, read_blocks
from _doc_driver import run_shell

pytestmark = pytest.mark.integrations

PAGE = "hosts.md"


def _commands(example: str) -> list[str]:
    blocks = read_blocks(ROOT / "docs" / PAGE)
    return [c.text for b in blocks for c in b.commands() if example in c.text]


@pytest.mark.parametrize(
    ("example", "count"),
    [
        ("examples/mmengine/train.py", 2),
        ("examples/lightning_train.py", 2),
        ("examples/fabric_train.py", 2),
        ("examples/hf_trainer.py", 2),
    ],
)
def test_host_examples_run_as_written(example, count, tmp_path, monkeypatch):
    commands = _commands(example)
    assert len(commands) == count, commands
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    for text in commands:  # in order: the mmengine resume continues the first run
        run_shell({"text": text, "expected": None})
    if "mmengine" in example:
        assert (tmp_path / "work_dirs" / "toy" / "last_checkpoint").is_file()
    if "hf_trainer" in example:  # the resume exported what from_pretrained opens
        assert (tmp_path / "hf_trainer_out" / "final" / "model.safetensors").is_file()
        assert (tmp_path / "hf_trainer_out" / "checkpoint-4" / "shardwise").is_dir()
    if "fabric" in example:  # the second run continued the first one's checkpoint
        assert (tmp_path / "fabric_ckpt" / "step_00000020" / "shardwise.json").is_file()
