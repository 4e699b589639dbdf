"""Run a command on a busy machine: N CPU-bound processes beside it, stopped afterwards.

    .venv/bin/python -m tools.busy make test          # three busy processes (the default)
    .venv/bin/python -m tools.busy --hogs 3 -- make test-launcher

For anyone changing the launcher, its report or the collective guards: the suite must pass
when the machine is not the test's alone (docs/testing.md). Each busy process is
`python -c 'while True: pass'`; they are stopped when the command ends, fails or is
interrupted. Prints the command's wall time and exits with its exit code.

Must not: change the command's environment or working directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

BUSY = "while True: pass"


def run_busy(command: list[str], hogs: int) -> int:
    """Run `command` with `hogs` busy processes beside it; its exit code."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(hogs)]
    start = time.monotonic()
    try:
        code = subprocess.call(command)
    except KeyboardInterrupt:
        code = 130
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    took = time.monotonic() - start
    print(
        f"tools.busy: {' '.join(command)!r} exited with {code} after {took // 60:.0f} min "
        f"{took % 60:.0f} s, with {hogs} busy process(es) beside it",
        file=sys.stderr,
        flush=True,
    )
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hogs", type=int, default=3, help="busy processes (default 3)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run, e.g. `python -m tools.busy make test`")
    if args.hogs < 0:
        parser.error(f"--hogs={args.hogs}: use a whole number >= 0")
    return run_busy(command, args.hogs)


if __name__ == "__main__":
    sys.exit(main())
