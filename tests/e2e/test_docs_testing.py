"""docs/testing.md's commands run as written: the mutation script lists its mutants, and
the documented single mutant is killed (which also shows the script works on a copy)."""

from __future__ import annotations

import re
import shlex

from _proc import ROOT, run_in_session

DOC = ROOT / "docs" / "testing.md"


def _commands() -> list[str]:
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", DOC.read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_every_command_in_the_testing_doc_runs():
    commands = _commands()
    assert commands == [
        ".venv/bin/python tests/mutants.py --list",
        ".venv/bin/python tests/mutants.py --only latest_before_rename",
    ]
    listed = run_in_session(shlex.split(commands[0]), timeout_s=240)
    assert listed.returncode == 0, listed.stderr
    assert "latest_before_rename: src/shardwise/" in listed.stdout
    one = run_in_session(shlex.split(commands[1]), timeout_s=240)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "latest_before_rename: killed" in one.stdout
    assert "1 killed, 0 not killed, of 1" in one.stdout
