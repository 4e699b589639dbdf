"""Lines a user changes to port examples/port's causal LM script, counted, not estimated.

Every script in examples/port trains the same transformers causal LM: `train_plain.py` in
one process with plain PyTorch, `train_deepspeed.py` and `train_accelerate.py` as those
tools' guides port it, and `train.py` under shardwise, which runs unchanged with
`shardwise run --deepspeed ds_zero3.json`, `--accelerate-config accelerate_fsdp.yaml` and
`--from torchtitan.toml` (tests/e2e/test_port.py checks that each equals the plain script
in one process).

A changed line is one a user types or deletes: the module docstring and blank lines are
left out, and difflib's opcodes count a replaced block as its longer side, an inserted or
deleted block as its length.

    python bench/port_lines.py     # JSON: lines changed for each (from, to) pair
"""

from __future__ import annotations

import ast
import difflib
import json
from pathlib import Path

PORT = Path(__file__).resolve().parents[1] / "examples" / "port"
PAIRS = (
    ("train_plain.py", "train_deepspeed.py"),
    ("train_plain.py", "train_accelerate.py"),
    ("train_plain.py", "train.py"),
    ("train_deepspeed.py", "train.py"),
    ("train_accelerate.py", "train.py"),
)


def code_lines(path: Path) -> list[str]:
    """The script's lines without its module docstring and blank lines."""
    text = path.read_text()
    tree = ast.parse(text)
    skip = 0
    if (
        tree.body
        and isinstance(tree.body[0], ast.Expr)
        and isinstance(tree.body[0].value, ast.Constant)
    ):
        skip = tree.body[0].end_lineno or 0
    return [line.rstrip() for line in text.splitlines()[skip:] if line.strip()]


def lines_changed(before: list[str], after: list[str]) -> int:
    changed = 0
    for op, a1, a2, b1, b2 in difflib.SequenceMatcher(
        None, before, after, autojunk=False
    ).get_opcodes():
        if op != "equal":
            changed += max(a2 - a1, b2 - b1)
    return changed


def measure() -> dict[str, int]:
    return {
        f"{a} -> {b}": lines_changed(code_lines(PORT / a), code_lines(PORT / b)) for a, b in PAIRS
    }


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
