"""Every shell command the docs show is run by a test: the doc driver runs the cheap ones
(test_snippets.py); each of the rest names the test that runs it, and that test is checked
to exist and to run it. Also: documented runs that share a directory cannot both start
(the vision example's second command used to fail late on the first one's run_dir)."""

from __future__ import annotations

import ast
import re
import shlex
import sys
from pathlib import Path

import pytest
from _covered import COVERED
from _doc_blocks import ROOT, all_blocks

DOCUMENTED = {c.text: c for b in all_blocks() if not b.not_run for c in b.commands()}


def _source(where: str) -> str:
    path, _, function = where.partition("::")
    text = (ROOT / path).read_text()
    if not function:
        return text
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return "\n".join(text.splitlines()[first - 1 : node.end_lineno])  # with parametrize
    raise AssertionError(f"{where}: no function {function!r} in {path}")


def test_every_mapped_command_is_still_documented():
    stale = sorted(set(COVERED) - set(DOCUMENTED))
    assert not stale, f"_covered.py names commands no page shows any more: {stale}"


@pytest.mark.parametrize("command", sorted(COVERED))
def test_a_mapped_command_is_run_by_its_test(command):
    run_by = COVERED[command]
    source = _source(run_by.where)
    for text in run_by.evidence:
        assert text in source, f"{run_by.where} no longer shows it runs `{command}` ({text!r})"
    for path, text in run_by.also:
        assert text in (ROOT / path).read_text(), f"{path}: {text!r} (for `{command}`)"


def test_the_other_commands_are_ones_the_driver_runs():
    for text, command in DOCUMENTED.items():
        if text in COVERED:
            continue
        words = shlex.split(text)
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words.pop(0)
        assert words[0] in ("python", "shardwise", "torchrun"), (
            f"{command.origin}: `{text}` is neither run by the doc tests nor mapped to a test "
            "in tests/docs/_covered.py, nor marked '*Not run by the tests: <reason>.*'"
        )


# --- what the commands of one example write ---------------------------------------------


def _run_dir(command: str, default: str) -> str:
    words = shlex.split(command)
    return words[words.index("--run-dir") + 1] if "--run-dir" in words else default


def test_the_vision_commands_each_have_a_run_dir_of_their_own():
    example = (ROOT / "examples" / "vision_bf16.py").read_text()
    default = re.search(r'"--run-dir", default="([^"]+)"', example).group(1)
    documented = [t for t in DOCUMENTED if "examples/vision_bf16.py" in t]
    assert len(documented) >= 2
    dirs = [_run_dir(t, default) for t in documented]
    assert len(set(dirs)) == len(dirs), (
        f"two documented runs share a run_dir (the Runner refuses the second): {documented}"
    )
    # The example's own usage lines are the same commands.
    usage = [" ".join(line.split("#")[0].split()) for line in example.split('"""')[1].splitlines()]
    for text in documented:
        assert text in usage, f"examples/vision_bf16.py's docstring does not show `{text}`"


def test_the_demo_data_size_is_what_the_demo_reads():
    from shardwise.cli.demo import DemoConfig, load_text

    page = (ROOT / "docs" / "examples.md").read_text()
    stated = re.search(r"on (\d+) KB\s+of Python's own standard-library source", page)
    assert stated, "docs/examples.md states the demo's data size"
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the figure is Python 3.11's (the page says other versions differ)")
    assert round(len(load_text(DemoConfig().data)) / 1000) == int(stated.group(1))


def test_readme_is_a_ten_minute_read():
    size = len((ROOT / "README.md").read_bytes())
    assert size < 15_000, f"README.md is {size} bytes: move detail to docs/ (under 15 KB)"


def test_the_mmengine_resume_command_carries_the_weights_only_switch():
    resumes = [t for t in DOCUMENTED if "examples/mmengine/train.py" in t and "--resume" in t]
    assert resumes and all(t.startswith("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 ") for t in resumes)
    assert (
        Path(ROOT / "docs" / "hosts.md").read_text().count("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") >= 2
    )
