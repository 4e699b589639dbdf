"""The grace period: when a worker fails, the others get a few seconds to end on their own.

Owns: `FailureGrace`, which holds torch's elastic agent back from stopping the other workers
for `grace_s` seconds after the first one failed, and the record of each failed attempt
(`Attempt`): torch's failures, and the ranks that were still running when the grace ran out,
which are the ranks the launcher stopped.

Why: torch's agent sends SIGTERM to every other worker in the same poll (every 0.1 s) that
first sees one fail. An error raised in every rank was then reported as raised in every
rank, or in one rank with the rest "stopped", depending on which process the machine ran
first; so was a survivor's own error about a dead peer. With the grace, whatever a rank does
on its own within `grace_s` it does, on a quiet machine and a busy one, and the report says
so. A rank that is still running after it (stalled, waiting for a dead peer) is stopped as
before, `grace_s` later.

How: for the duration of a run, `LocalElasticAgent._monitor_workers` (the agent's poll) is
wrapped. While a worker has ended with a non-zero code, others are still running and the
grace has not run out, the poll answers "healthy" without calling torch's, which would stop
the rest. Once every worker has ended, or the grace is over, torch's own poll runs and does
what it always does: SIGTERM to the rest (SIGKILL 30 s later), or a restart under
`--max-restarts`. The exit codes are read with `Popen.poll`, which torch's poll reads again.

It also leaves torch's remaining restarts unused when every failed rank refused the user's
setting (a ConfigError, or a layout that cannot exist at this world): a restart would refuse
it again, and after an elastic world change must not train something else.

Must not: start, signal or wait for processes itself (torch's agent does all three), or
change anything while no worker has failed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GRACE_S", "Attempt", "FailureGrace"]

GRACE_S = 10.0
"""Seconds the other workers get after one fails (`shardwise run --grace`). Measured on a
2-core machine with three CPU-bound processes beside the run: the two ranks of a config typo
raised at most 0.8 s apart (six runs), so ten seconds is ample and still short next to
torch's 30 s between SIGTERM and SIGKILL."""


@dataclass(frozen=True)
class Attempt:
    """One attempt of the workers that ended in a failure."""

    failures: dict[int, Any]
    """Global rank -> torch's `ProcessFailure`, for every rank that ended badly."""
    stopped: frozenset[int] | None
    """Global ranks the launcher stopped: still running when the grace ran out (none when
    every rank ended on its own); None when this could not be seen."""


def _exit_codes(agent: Any) -> dict[int, int | None] | None:
    """Local rank -> exit code (None: running), or None when the processes are not visible
    (a process context other than torchrun's subprocesses)."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
    if not handlers:
        return None
    return {local: handler.proc.poll() for local, handler in handlers.items()}


def _all_refusals(failures: dict[int, Any]) -> bool:
    """Whether every failure is a worker's refusal of the user's setting (its error file
    says so: distributed/worker_errors.py)."""

    def refusal(failure: Any) -> bool:
        message = getattr(failure, "error_file_data", {}).get("message")
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        return bool(extra.get("refusal"))

    return bool(failures) and all(refusal(f) for f in failures.values())


class FailureGrace:
    """`with FailureGrace(10.0) as grace:` around torch's `run()`; `grace.attempts` after."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self.attempts: list[Attempt] = []
        self._since: float | None = None  # when this attempt's first failure was seen
        self._original: Any = None
        self.refused_restart = False
        """Restarts were left unused: every failed rank refused its setting."""

    def __enter__(self) -> FailureGrace:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        self._original = LocalElasticAgent._monitor_workers
        grace = self

        def monitor(agent: Any, worker_group: Any) -> Any:
            return grace._monitor(agent, worker_group)

        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        LocalElasticAgent._monitor_workers = self._original  # type: ignore[method-assign]

    def _monitor(self, agent: Any, worker_group: Any) -> Any:
        from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

        codes = _exit_codes(agent)
        stopped: frozenset[int] | None = None
        if codes is not None and any(code not in (None, 0) for code in codes.values()):
            running = [local for local, code in codes.items() if code is None]
            now = time.monotonic()
            if self._since is None:
                self._since = now
            if running and now - self._since < self.grace_s:
                return RunResult(state=WorkerState.HEALTHY)
            stopped = frozenset(worker_group.workers[local].global_rank for local in running)
        # No failure seen here but one in torch's poll just after: it ended in between, and
        # torch stopped the rest at once; `stopped` stays unknown (None) for that attempt.
        result = self._original(agent, worker_group)
        if result.is_failed():
            self.attempts.append(Attempt(dict(result.failures), stopped))
            self._since = None
            if _all_refusals(result.failures) and getattr(agent, "_remaining_restarts", 0) > 0:
                # Every failed rank refused the user's setting (a layout that cannot exist
                # at this world, say): a restart would refuse it again, or, after a world
                # change, train something else. torch's agent restarts while this is above 0.
                agent._remaining_restarts = 0
                self.refused_restart = True
        return result
