"""docs/testing.md's commands run as written: the mutation script lists its mutants, the
documented single mutant is killed (which also shows the script works on a copy), and the
busy-machine wrapper runs a command beside three busy processes and stops them after it
(`make test` itself, the command it wraps there, is run by .ci/run)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

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
        ".venv/bin/python -m tools.busy make test",
    ]
    listed = run_in_session(shlex.split(commands[0]), timeout_s=240)
    assert listed.returncode == 0, listed.stderr
    assert "latest_before_rename: src/shardwise/" in listed.stdout
    one = run_in_session(shlex.split(commands[1]), timeout_s=240)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "latest_before_rename: killed" in one.stdout
    assert "1 killed, 0 not killed, of 1" in one.stdout

    busy = shlex.split(commands[2])
    assert busy[-2:] == ["make", "test"]
    out = run_in_session([*busy[:-2], sys.executable, "-c", _BUSY_SIBLINGS], timeout_s=240)
    assert out.returncode == 3, out.stderr  # the command's own exit code
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3, out.stdout  # three busy processes beside the command
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]  # stopped and reaped after it
    assert "with 3 busy process(es) beside it" in out.stderr


# Run by tools.busy in place of `make test`: prints the pids of the busy processes beside it
# (its parent's other children) and exits 3.
_BUSY_SIBLINGS = """
import os, sys
from pathlib import Path
me, parent = os.getpid(), os.getppid()
for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
        pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        cmd = (stat.parent / "cmdline").read_bytes()
    except (OSError, ValueError):
        continue
    if ppid == parent and pid != me and b"while True: pass" in cmd:
        print(pid)
sys.exit(3)
"""
