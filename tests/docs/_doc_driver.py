"""Runs the pages' snippets and commands in one process: `python _doc_driver.py PLAN RESULT`.

PLAN is JSON: a list of pages, each `{"page", "workdir", "steps"}`, every step
`{"kind": "python" | "file" | "shell", "origin", "text", ...}`. Each page runs in its own
working directory (with `examples/` linked in, as at the repository root), in document
order, and stops at its first failure; the next page still runs. Each Python block runs in
a fresh namespace, so a block that needs another's imports or names fails here as it
would for a reader who copies it; files written by one step are there for the next.
RESULT gets `{page: {"ok", "error", "ran", "seconds"}}`.

`shardwise plan|config|checkpoint|plot` run in this process through `shardwise.cli.main`
(the console script's own function), which saves a torch import per command; everything
else (`python X.py`, `shardwise run`, `torchrun`) is a child process in its own session,
killed whole at its deadline.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

IN_PROCESS = {"plan", "config", "checkpoint", "plot"}
COMMAND_TIMEOUT_S = 180
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
REL_TOL = 0.05
"""Figures in a transcript may differ by this much from a fresh run (another torch's
allocator or op decompositions); every other character must match."""


class DocFailure(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(text: str) -> tuple[dict[str, str], list[str]]:
    """Leading VAR=value assignments, then the command with its program made runnable."""
    words = shlex.split(text)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    program = {
        "python": [sys.executable],
        "shardwise": [sys.executable, "-m", "shardwise.cli"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }.get(words[0])
    if program is None:
        raise DocFailure(f"no way to run {words[0]!r} here: map the command to a test instead")
    return env, [*program, *words[1:]]


def _same_line(got: str, want: str) -> bool:
    if got == want:
        return True
    got_numbers, want_numbers = NUMBER.findall(got), NUMBER.findall(want)
    if NUMBER.sub("#", got) != NUMBER.sub("#", want) or len(got_numbers) != len(want_numbers):
        return False
    for g, w in zip(got_numbers, want_numbers, strict=True):
        a, b = float(g.replace(",", "")), float(w.replace(",", ""))
        if abs(a - b) > REL_TOL * max(abs(a), abs(b)):
            return False
    return True


def check_transcript(output: str, expected: list[str]) -> None:
    """The expected lines appear in order; `...` stands for any lines (none included)."""
    got = [line.rstrip() for line in output.splitlines()]
    chunks: list[list[str]] = [[]]
    for line in expected:
        if line.strip() == "...":
            chunks.append([])
        else:
            chunks[-1].append(line)
    at = 0
    for n, chunk in enumerate(chunks):
        if not chunk:
            continue
        anchored = n == 0  # no leading "...": the output starts here
        starts = [at] if anchored else range(at, len(got) - len(chunk) + 1)
        for start in starts:
            window = got[start : start + len(chunk)]
            if len(window) == len(chunk) and all(map(_same_line, window, chunk)):
                at = start + len(chunk)
                break
        else:
            raise DocFailure(
                "the transcript does not match the output; expected\n"
                + "\n".join(chunk)
                + "\n--- got ---\n"
                + output
            )
    if chunks[-1] and at != len(got):  # no trailing "...": the output ends there too
        raise DocFailure("the output goes on past the transcript:\n" + "\n".join(got[at:]))


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    from shardwise.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


def _child(env: dict[str, str], argv: list[str]) -> tuple[int, str, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(_free_port()), **env}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise DocFailure(f"timed out after {COMMAND_TIMEOUT_S} s\n{err[-3000:]}") from None
    return proc.returncode, out, err


def run_shell(step: dict) -> None:
    env, argv = _argv(step["text"])
    words = shlex.split(step["text"])
    if words[0] == "shardwise" and len(words) > 1 and words[1] in IN_PROCESS and not env:
        code, out, err = _in_process(words[1:])
    else:
        code, out, err = _child(env, argv)
    if code != 0:
        raise DocFailure(
            f"exit code {code}\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}"
        )
    if step.get("expected") is not None:
        check_transcript(out, step["expected"])


def run_page(page: dict) -> dict:
    workdir = Path(page["workdir"])
    os.chdir(workdir)
    ran: list[str] = []
    start = time.perf_counter()
    for step in page["steps"]:
        began = time.perf_counter()
        try:
            if step["kind"] == "file":
                (workdir / step["file"]).write_text(step["text"])
            elif step["kind"] == "python":
                # A fresh namespace per block: a reader copies one block, not the page.
                exec(compile(step["text"], step["origin"], "exec"), {"__name__": "__main__"})
            else:
                run_shell(step)
        except BaseException as exc:  # reported with the step it came from
            detail = "".join(traceback.format_exception(exc))
            _shutdown()
            return {"ok": False, "error": f"{step['origin']}: {step['text'][:200]}\n{detail}",
                    "ran": ran, "seconds": time.perf_counter() - start}  # fmt: skip
        ran.append(f"{step['origin']} {time.perf_counter() - began:.1f}s")
    _shutdown()
    return {"ok": True, "error": "", "ran": ran, "seconds": time.perf_counter() - start}


def _shutdown() -> None:
    """A page's process group (a snippet that forgot shutdown) does not leak into the next."""
    if "shardwise" in sys.modules:
        sys.modules["shardwise"].shutdown()


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for page in plan:
        results[page["page"]] = run_page(page)
        Path(sys.argv[2]).write_text(json.dumps(results, indent=1))  # what ran, if we die


if __name__ == "__main__":
    main()
