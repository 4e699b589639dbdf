"""An uncaught error in a shardwise program: one line for a refusal, shown once.

Owns: the `sys.excepthook` shardwise installs when it is imported (never over a user's own),
and the error file it writes in a worker of `shardwise run`. The same mistake (a config
typo, a bad mesh) raises in every rank; printed by each it would fill the screen once per
rank. So a worker of `shardwise run` (known by SHARDWISE_LAUNCHER_PID) writes its error into
the file torch's elastic agent gives it (TORCHELASTIC_ERROR_FILE, torch's own JSON format,
read back as `ProcessFailure.message`), local rank 0 prints its own error as it happens, and
the launcher prints the others once, grouped by message, with the ranks that raised each
(cli/report.py).

Errors that are the user's input, not the code's, print one line without a traceback:
`ConfigError`, a ValueError marked with `refused` (a ParallelConfig layout that does not fit
the job, found in `wrap`), and any ValueError, TypeError or NotImplementedError that a
`raise` statement of shardwise's own code raised (its messages name the setting, the value
and the fix; the same types raised by Python or torch inside shardwise are bugs and keep
their traceback). So do a lost peer or stall (`StallError`, whose message already says where
and what to do). The traceback stays in the error file, and SHARDWISE_TRACEBACK=1 prints it
as Python would. A lost peer (`PeerExitedError`) is not printed by the worker at all: the
launcher reports it, as "stopped because rank N ended" when rank N is on its node
(cli/report.py). Printed by local rank 0 only when it raised before the launcher stopped it,
it would make the report differ between a quiet machine and a busy one.

Outside `shardwise run` (plain `python`, torchrun) the hook prints the same one line for a
refusal and leaves every other error to Python's own hook; nothing is written. A Ctrl-C
(KeyboardInterrupt) in a worker prints nothing: the launcher says it once (cli/interrupt.py).

Must not: replace a hook the user installed, or hide the traceback of an error that is not
the user's input (a bug keeps it, in the terminal and in the error file).
"""

from __future__ import annotations

import dis
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
    "raised_by_shardwise",
    "record_error",
    "refused",
    "short_error",
]

from shardwise.distributed.process_group import LAUNCHER_PID_ENV

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
TRACEBACK_ENV = "SHARDWISE_TRACEBACK"
"""Set to 1: an error shown as one line is printed with its traceback, as Python prints it."""
# shardwise's own source files: where a `raise` of a ValueError/TypeError/NotImplementedError
# is a message written for the user (see `raised_by_shardwise`).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_OWN_MESSAGES = (ValueError, TypeError, NotImplementedError)
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


def raised_by_shardwise(exc: BaseException) -> bool:
    """Whether `exc` is a ValueError, TypeError or NotImplementedError raised by a `raise`
    statement in shardwise's own source: a message written for the user, naming the
    setting and the fix. The same types raised by Python or torch inside shardwise (an
    operation on a wrong value: a bug) are not: the innermost frame's instruction is then
    no `raise`."""
    if not isinstance(exc, _OWN_MESSAGES) or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if not os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR):
        return False
    return any(
        ins.offset == tb.tb_lasti and ins.opname == "RAISE_VARARGS"
        for ins in dis.get_instructions(code)
    )


def short_error(exc: BaseException) -> bool:
    """Whether `exc` is shown as its message alone (input errors, stalls, lost peers)."""
    if getattr(exc, _REFUSED, False) or raised_by_shardwise(exc):
        return True
    return any(is_one_line(cls.__name__) for cls in type(exc).__mro__)


def _show(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Print `exc` on stderr: its message alone when it is a short error (unless
    SHARDWISE_TRACEBACK=1), else as Python's own hook does."""
    if short_error(exc) and os.environ.get(TRACEBACK_ENV, "") in ("", "0"):
        # (torch prefixes "[rankN]: " once the process group exists)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(exc_type, exc, tb)


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
    if issubclass(exc_type, KeyboardInterrupt):
        return  # Ctrl-C: the launcher says it once, not a traceback per rank
    if not path:
        sys.__excepthook__(exc_type, exc, tb)
        return
    record_error(exc.with_traceback(tb), path)
    if os.environ.get("LOCAL_RANK", "0") != "0" or not printed_by_worker(exc_type.__name__):
        return  # the launcher prints it once, with every rank that raised it
    _show(exc_type, exc, tb)


def _plain_hook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """Outside `shardwise run`: a refusal in one line, anything else as Python shows it."""
    _show(exc_type, exc.with_traceback(tb), tb)


def install_if_launched() -> bool:
    """Use the worker hook when this process is a worker of `shardwise run`, and the plain
    one otherwise; whether it is a worker. A user's own hook is never replaced."""
    launched = LAUNCHER_PID_ENV in os.environ and ERROR_FILE_ENV in os.environ
    if sys.excepthook is sys.__excepthook__:
        sys.excepthook = _hook if launched else _plain_hook
    return launched
