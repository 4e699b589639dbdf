"""What `shardwise run` says when workers fail: each error once, with the ranks that raised it.

Owns: turning torch's elastic failures (`ChildFailedError.failures`, the per-rank error files
that shardwise's worker hook writes, see distributed/worker_errors.py) into a few lines, and
observing torch's elastic agent through its log records so that a restart under
`--max-restarts` is announced with the rank that ended, how, and the attempt number.

How: the agent logs "failed (exitcode ...)" when a worker ends badly and "N/M attempts left;
will restart worker group" before a restart. `AgentLogReader` is a logging filter on those two
loggers: it reads the records, prints shardwise's lines instead of torch's, and lets the rest
through. Must not: change what the agent does (it only reads and reprints).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AgentLogReader", "Failure", "describe_exit", "failures_from_torch", "summary"]

_MP_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"


def describe_exit(exitcode: int) -> str:
    """'exited with code 1' or 'was killed by signal 9 (SIGKILL)'."""
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


def _read_error(data: Any) -> tuple[str, str]:
    message = data.get("message", "") if isinstance(data, dict) else ""
    if message == "<NONE>":  # torch's placeholder when a worker wrote no error file
        return "", ""
    if isinstance(message, dict):
        return str(message.get("message", "")), str(
            message.get("extraInfo", {}).get("py_callstack", "")
        )
    return str(message), ""


def _is_short(message: str) -> bool:
    from shardwise.distributed.worker_errors import _ONE_LINE

    return message.partition(":")[0].rpartition(".")[2] in _ONE_LINE


def failures_from_torch(failures: Mapping[int, Any]) -> list[Failure]:
    """Our `Failure`s from `ChildFailedError.failures` (global rank -> ProcessFailure)."""
    out = []
    for rank, f in sorted(failures.items()):
        message, tb = _read_error(getattr(f, "error_file_data", {}))
        out.append(
            Failure(
                rank=rank,
                local_rank=f.local_rank,
                exitcode=f.exitcode,
                message=message,
                traceback=tb,
                short=_is_short(message),
            )
        )
    return out


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def summary(failures: Iterable[Failure], *, world: int | None = None) -> str:
    """Each distinct error once, with the ranks that raised it.

    A local rank 0 printed its own error as it happened, so its group points there instead
    of printing it again. Workers ended by the launcher's SIGTERM after the first failure
    are named as such, and a worker that ended by a signal or exit code without an error is
    named with it.
    """
    failures = list(failures)

    def stopped(f: Failure) -> bool:  # the agent's SIGTERM to the rest after a failure
        return not f.message and f.exitcode == -signal.SIGTERM

    causes = [f for f in failures if not stopped(f)]
    groups: dict[str, list[Failure]] = {}
    for f in causes or failures:
        groups.setdefault(f.message or f"\0{f.exitcode}", []).append(f)
    of = f" of {world}" if world else ""
    lines = [f"shardwise run: {len(failures)}{of} rank(s) failed:"]
    for group in groups.values():
        ranks = [f.rank for f in group]
        first = group[0]
        if not first.message:
            lines.append(f"  {_ranks(ranks)}: {describe_exit(first.exitcode)}")
        elif any(f.local_rank == 0 for f in group):
            lines.append(f"  {_ranks(ranks)}: {first.message.partition(':')[0]} (shown above)")
        elif first.short or not first.traceback:
            lines.append(f"  {_ranks(ranks)}: {first.message}")
        else:
            lines.append(f"  {_ranks(ranks)} raised:")
            lines.extend("    " + line for line in first.traceback.rstrip().splitlines())
    rest = [f.rank for f in failures if stopped(f)] if causes else []
    if rest:
        lines.append(
            f"  {_ranks(rest)}: stopped by the launcher (SIGTERM) after "
            f"{_ranks([f.rank for f in causes])} ended"
        )
    return "\n".join(lines)


def _attempt_failures(log_dir: Path, attempt: int) -> list[Failure]:
    """The errors the workers of one attempt wrote (local ranks as ranks: one node's view)."""
    out = []
    for path in sorted(log_dir.glob(f"*/attempt_{attempt}/*/error.json")):
        try:
            message, tb = _read_error(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
        local = int(path.parent.name)
        out.append(Failure(local, local, 1, message, tb, _is_short(message)))
    return out


class AgentLogReader(logging.Filter):
    """Reads torch's elastic agent log and announces failures and restarts in our words."""

    def __init__(self, log_dir: Path, *, single_node: bool) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.single_node = single_node
        self.restarts = 0
        self._failed: tuple[int, int, int] | None = None
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

    def _who(self, local_rank: int, pid: int) -> str:
        if self.single_node:
            return f"rank {local_rank} (pid {pid})"
        return f"local rank {local_rank} on this node (pid {pid})"

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        args = [str(a) for a in record.args] if isinstance(record.args, tuple) else []
        if msg.startswith("failed (exitcode") and len(args) >= 3:
            exitcode, local_rank, pid = (int(a) for a in args[:3])
            self._failed = (exitcode, local_rank, pid)
            return False  # said by us: at a restart below, or in the final summary
        if "attempts left" in msg and len(args) >= 4:
            self._announce_restart(int(args[2]), int(args[3]))
            return False
        return record.levelno > logging.INFO or record.name not in self._quiet

    def _announce_restart(self, left: int, max_restarts: int) -> None:
        lines = []
        if self._failed is not None:
            exitcode, local_rank, pid = self._failed
            lines.append(f"shardwise run: {self._who(local_rank, pid)} {describe_exit(exitcode)}")
        errors = [f for f in _attempt_failures(self.log_dir, self.restarts) if f.message]
        if errors:
            lines.append(summary(errors).partition("\n")[2])
        self.restarts += 1
        lines.append(
            f"shardwise run: restarting the workers: restart {self.restarts} of {max_restarts} "
            f"({left - 1} left); a Runner with resume='latest' resumes from its last checkpoint"
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        self._failed = None
