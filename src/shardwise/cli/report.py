"""What `shardwise run` says when workers fail: each error once, with the ranks that raised it.

Owns: turning torch's elastic failures (`ChildFailedError.failures`, the per-rank error files
that shardwise's worker hook writes, see distributed/worker_errors.py) into a few lines, and
observing torch's elastic agent through its log records so that a restart under
`--max-restarts` is announced with the same lines and the attempt number.

The rules (docs/troubleshooting.md, "What the launcher reports"): a rank is a *cause* unless
it was stopped because another one ended. A rank ended that way when the launcher stopped it
(still running at the end of the grace, cli/grace.py), or when its own error is a lost peer
(`PeerExitedError`) while another rank of this node failed on its own. Both are true of the
same event, and which one a survivor shows depends on the machine's load, so both read
"rank 0: stopped because rank 1 ended". Each distinct error of the causes is shown once with
its ranks.

How: the agent logs "failed (exitcode ...)" when a worker ends badly and "N/M attempts left;
will restart worker group" before a restart. `AgentLogReader` is a logging filter on those two
loggers: it reads the records, prints shardwise's lines instead of torch's, and lets the rest
through. Must not: change what the agent does (it only reads and reprints).
"""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardwise.cli.grace import Attempt

__all__ = [
    "AgentLogReader",
    "Failure",
    "describe_exit",
    "failures_from_torch",
    "preempted",
    "summary",
]

_MP_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def describe_exit(exitcode: int) -> str:
    """'exited with code 1' or 'was killed by signal 9 (SIGKILL)'; code 75 says what a
    Runner means by it."""
    from shardwise.train.resume import PREEMPTED_EXIT_CODE

    if exitcode == PREEMPTED_EXIT_CODE:
        return f"exited with code {exitcode}: stopped on a stop signal, after saving a checkpoint"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return f"was killed by signal {-exitcode} ({name})"
    return f"exited with code {exitcode}"


@dataclass(frozen=True)
class Failure:
    """One worker that ended badly: its rank, exit code, and the error it wrote (if any)."""

    rank: int
    local_rank: int
    exitcode: int
    message: str = ""
    """'Type: message' from the worker's error file; '' when it wrote none (a signal)."""
    traceback: str = ""
    short: bool = False
    """The worker showed it as one line (a config error, a lost peer): no traceback needed."""


def _read_error(data: Any) -> tuple[str, str, bool]:
    """(message, traceback, shown as one line) from a worker's error file."""
    message = data.get("message", "") if isinstance(data, dict) else ""
    if message == "<NONE>":  # torch's placeholder when a worker wrote no error file
        return "", "", False
    if isinstance(message, dict):
        text, extra = str(message.get("message", "")), message.get("extraInfo", {})
        one_line = bool(extra.get("one_line")) or _is_short(text)
        return text, str(extra.get("py_callstack", "")), one_line
    return str(message), "", _is_short(str(message))


def _type_name(message: str) -> str:
    """'ConfigError' from 'ConfigError: ...' (or from 'shardwise.x.ConfigError: ...')."""
    return message.partition(":")[0].rpartition(".")[2]


def _is_short(message: str) -> bool:
    from shardwise.distributed.worker_errors import is_one_line

    return is_one_line(_type_name(message))


def failures_from_torch(failures: Mapping[int, Any]) -> list[Failure]:
    """Our `Failure`s from `ChildFailedError.failures` (global rank -> ProcessFailure)."""
    out = []
    for rank, f in sorted(failures.items()):
        message, tb, one_line = _read_error(getattr(f, "error_file_data", {}))
        out.append(
            Failure(
                rank=rank,
                local_rank=f.local_rank,
                exitcode=f.exitcode,
                message=message,
                traceback=tb,
                short=one_line,
            )
        )
    return out


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _lost_peer(f: Failure) -> bool:
    return _type_name(f.message) == "PeerExitedError"


def summary(
    failures: Iterable[Failure], *, world: int | None = None, stopped: Iterable[int] | None = None
) -> str:
    """Each distinct error once, with the ranks that raised it; then the ranks that were
    stopped because those ended, in one line.

    `stopped`: the ranks the launcher stopped (cli/grace.py's `Attempt.stopped`); None when
    unknown, and then a rank ended by SIGTERM without an error of its own counts as stopped.
    A local rank 0 printed its own error as it happened (unless the launcher reports that
    kind, see worker_errors.py), so its group points there instead of printing it again. A
    worker that ended by a signal or exit code without an error is named with it.
    """
    failures = list(failures)
    stopped_set = None if stopped is None else set(stopped)

    def by_launcher(f: Failure) -> bool:
        if stopped_set is not None:
            return f.rank in stopped_set
        return not f.message and f.exitcode == -signal.SIGTERM

    causes = [f for f in failures if not by_launcher(f) and not _lost_peer(f)]
    if not causes:  # nothing else on this node to blame (the dead peer was on another node)
        causes = [f for f in failures if not by_launcher(f)] or failures
    cause_ranks = {f.rank for f in causes}
    groups: dict[str, list[Failure]] = {}
    for f in causes:
        groups.setdefault(f.message or f"\0{f.exitcode}", []).append(f)
    of = f" of {world}" if world else ""
    ended = "stopped and saved" if preempted(failures) else "failed"
    lines = [f"shardwise run: {len(failures)}{of} rank(s) {ended}:"]
    for group in groups.values():
        ranks = [f.rank for f in group]
        first = group[0]
        if not first.message:
            lines.append(f"  {_ranks(ranks)}: {describe_exit(first.exitcode)}")
        elif any(f.local_rank == 0 for f in group) and _shown_live(first.message):
            lines.append(f"  {_ranks(ranks)}: {_type_name(first.message)} (shown above)")
        elif first.short or not first.traceback:
            head, *rest = first.message.splitlines() or [""]
            lines.append(f"  {_ranks(ranks)}: {head}")
            lines.extend("    " + line for line in rest)
        else:
            lines.append(f"  {_ranks(ranks)} raised:")
            lines.extend("    " + line for line in first.traceback.rstrip().splitlines())
    after = [f.rank for f in failures if f.rank not in cause_ranks]
    if after:
        lines.append(f"  {_ranks(after)}: stopped because {_ranks(sorted(cause_ranks))} ended")
    return "\n".join(lines)


def preempted(failures: Iterable[Failure]) -> bool:
    """Whether every rank that ended exited with PREEMPTED_EXIT_CODE and wrote no error:
    a Runner stopped them all at one step, after its checkpoint (a stop signal to this node
    or to another), which is no failure."""
    from shardwise.train.resume import PREEMPTED_EXIT_CODE

    failures = list(failures)
    return bool(failures) and all(
        f.exitcode == PREEMPTED_EXIT_CODE and not f.message for f in failures
    )


def _shown_live(message: str) -> bool:
    from shardwise.distributed.worker_errors import printed_by_worker

    return printed_by_worker(_type_name(message))


class AgentLogReader(logging.Filter):
    """Reads torch's elastic agent log and announces failures and restarts in our words.

    `attempts`: the failed attempts as cli/grace.py records them (the list grows during the
    run); a restart is announced with the last one's `summary`.
    """

    def __init__(self, attempts: Sequence[Attempt]) -> None:
        super().__init__()
        self.attempts = attempts
        self.restarts = 0
        self._loggers: list[tuple[logging.Logger, int]] = []
        self._quiet: set[str] = set()  # loggers whose INFO we enabled only to read it

    def __enter__(self) -> AgentLogReader:
        for name in (_MP_LOGGER, _AGENT_LOGGER):
            logger = logging.getLogger(name)
            self._loggers.append((logger, logger.level))
            if not logger.isEnabledFor(logging.INFO):
                logger.setLevel(logging.INFO)  # to see "attempts left"; dropped in filter()
                self._quiet.add(name)
            logger.addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for logger, level in self._loggers:
            logger.removeFilter(self)
            logger.setLevel(level)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        args = [str(a) for a in record.args] if isinstance(record.args, tuple) else []
        if msg.startswith("failed (exitcode"):
            return False  # said by us: at a restart below, or in the final summary
        if msg.startswith("Sending process") and "closing signal" in msg:
            # Said by us too ("stopped because rank 1 ended"); torch's line, one per rank the
            # launcher stopped, would show only where a rank outran the grace.
            return False
        if "death signal" in msg and isinstance(record.args, tuple) and record.args:
            # Ctrl-C: a Runner's rank 0 says where it stopped, or the launcher does, in one
            # line (cli/interrupt.py); SIGTERM's line stays, before the launcher's own.
            return record.args[0] != signal.SIGINT
        if "attempts left" in msg and len(args) >= 4:
            self._announce_restart(int(args[2]), int(args[3]))
            return False
        return record.levelno > logging.INFO or record.name not in self._quiet

    def _announce_restart(self, left: int, max_restarts: int) -> None:
        lines = []
        if len(self.attempts) > self.restarts:
            attempt = self.attempts[-1]
            lines.append(summary(failures_from_torch(attempt.failures), stopped=attempt.stopped))
        self.restarts += 1
        lines.append(
            f"shardwise run: restarting the workers: restart {self.restarts} of {max_restarts} "
            f"({left - 1} left); a Runner with resume='latest' resumes from its last checkpoint"
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
