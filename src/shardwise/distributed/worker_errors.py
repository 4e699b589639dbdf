"""An uncaught error in a worker of `shardwise run`: written for the launcher, shown once.

Owns: the `sys.excepthook` that workers started by `shardwise run` use (installed when
`shardwise` is imported in such a worker, known by SHARDWISE_LAUNCHER_PID), and the error
file it writes. The same mistake (a config typo, a bad mesh) raises in every rank; printed
by each it would fill the screen once per rank. So each worker writes its error into the
file torch's elastic agent gives it (TORCHELASTIC_ERROR_FILE, torch's own JSON format, read
back as `ProcessFailure.message`), local rank 0 prints its own error as it happens, and the
launcher prints the others once, grouped by message, with the ranks that raised each
(cli/report.py).

Errors that are the user's input, not the code's (`ConfigError`, and a ValueError marked
with `refused`: a ParallelConfig layout that does not fit the job, found in `wrap`), and a
lost peer or stall
(`StallError`, whose message already says where and what to do) print one line without a
traceback; the traceback stays in the error file. A lost peer (`PeerExitedError`) is not
printed by the worker at all: the launcher reports it, as "stopped because rank N ended"
when rank N is on its node (cli/report.py). Printed by local rank 0 only when it raised
before the launcher stopped it, it would make the report differ between a quiet machine and
a busy one. Must not: change anything outside a worker of `shardwise run` (plain `python`
and `torchrun` keep Python's own hook).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import TracebackType
from typing import TypeVar

__all__ = [
    "install_if_launched",
    "is_one_line",
    "is_refusal",
    "printed_by_worker",
    "record_error",
    "refused",
    "short_error",
]

from shardwise.distributed.process_group import LAUNCHER_PID_ENV

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# Exception classes (by name, so this module imports nothing) shown as one line.
_ONE_LINE = {"ConfigError", "StallError", "PeerExitedError"}
# A ValueError or TypeError that refuses the user's setting where only the running job can
# tell (the world size in `wrap`): marked on the instance, so it stays the plain ValueError
# the style asks for, and written into the error file for the launcher.
_REFUSED = "shardwise_refused"
# ... and those the launcher reports instead of the worker (see the module docstring).
_LAUNCHER_REPORTS = {"PeerExitedError"}


def is_one_line(type_name: str) -> bool:
    """Whether an error of this class (by name) is shown as its message alone."""
    return type_name in _ONE_LINE


def printed_by_worker(type_name: str) -> bool:
    """Whether local rank 0 prints an error of this class (by name) as it happens."""
    return type_name not in _LAUNCHER_REPORTS


E = TypeVar("E", bound=BaseException)


def refused(exc: E) -> E:
    """`exc`, marked as a refusal of the user's setting: shown by a worker of `shardwise run`
    as its message alone, like a ConfigError (`raise refused(ValueError(...))`)."""
    setattr(exc, _REFUSED, True)
    return exc


def is_refusal(exc: BaseException) -> bool:
    """Whether `exc` refuses the user's setting (a ConfigError, or marked with `refused`):
    the same input is refused again, so a restart cannot help."""
    return bool(getattr(exc, _REFUSED, False)) or any(
        cls.__name__ == "ConfigError" for cls in type(exc).__mro__
    )


def short_error(exc: BaseException) -> bool:
    """Whether `exc` is shown as its message alone (input errors, stalls, lost peers)."""
    if getattr(exc, _REFUSED, False):
        return True
    return any(is_one_line(cls.__name__) for cls in type(exc).__mro__)


def record_error(exc: BaseException, path: str) -> None:
    """Write `exc` into `path` in the format of torch's elastic `ErrorHandler`."""
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
                "one_line": short_error(exc),  # read by cli/report.py; torch ignores it
                "refusal": is_refusal(exc),  # read by cli/grace.py: no restart repeats it
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass  # the launcher then reports the exit code alone; the hook still prints


def _hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if exc_type is KeyboardInterrupt or not path:
        sys.__excepthook__(exc_type, exc, tb)
        return
    record_error(exc.with_traceback(tb), path)
    if os.environ.get("LOCAL_RANK", "0") != "0" or not printed_by_worker(exc_type.__name__):
        return  # the launcher prints it once, with every rank that raised it
    if short_error(exc):  # (torch prefixes "[rankN]: " once the process group exists)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(exc_type, exc, tb)


def install_if_launched() -> bool:
    """Use the worker hook when this process is a worker of `shardwise run`."""
    if LAUNCHER_PID_ENV not in os.environ or ERROR_FILE_ENV not in os.environ:
        return False
    if sys.excepthook is sys.__excepthook__:  # never replace a user's own hook
        sys.excepthook = _hook
    return True
