"""Ctrl-C under `shardwise run`: the first stops the workers after their step, the second at once.

Owns: `InterruptedShutdown`, which wraps torch's elastic agent's shutdown for the duration of
a run, and what the launcher makes of the workers' exit codes after a SIGINT.

Why: Ctrl-C in a terminal sends SIGINT to the launcher only (torch starts each worker in a
session of its own), and torch's agent passes it on to the workers and waits for them (30 s,
then SIGKILL). A Runner reads a first SIGINT as SIGTERM: it finishes its optimizer step,
saves, and exits 75, with one line from rank 0 naming the step and the checkpoint
(train/resume.py). A second Ctrl-C while the launcher waits raised torch's SignalException
out of that wait: the launcher sent SIGTERM once more and printed "stopped by signal 2".
Here it is passed on as SIGINT, and a Runner stops at once (exit 130), in one line naming
the last good checkpoint. A worker with no Runner ends by the SIGINT itself, without a
traceback (distributed/worker_errors.py), and the launcher says so in one line.

Must not: decide anything about a signal other than SIGINT (SIGTERM and SIGUSR1 are passed on
as torch passes them).
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["InterruptedShutdown"]


class InterruptedShutdown:
    """`with InterruptedShutdown() as interrupt:` around torch's `run()`;
    `interrupt.exit_codes` after a SIGINT (local rank -> exit code, None: still running)."""

    def __init__(self) -> None:
        self.exit_codes: dict[int, int | None] = {}
        self._original: Any = None

    def __enter__(self) -> InterruptedShutdown:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        self._original = LocalElasticAgent._shutdown
        interrupt = self

        def shutdown(
            agent: Any, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30
        ) -> None:
            interrupt._shutdown(agent, death_sig, timeout)

        LocalElasticAgent._shutdown = shutdown  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        LocalElasticAgent._shutdown = self._original  # type: ignore[method-assign]

    def _shutdown(self, agent: Any, death_sig: signal.Signals, timeout: int) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if death_sig != signal.SIGINT:
            self._original(agent, death_sig, timeout)
            return
        try:
            self._original(agent, death_sig, timeout)
        except SignalException as again:
            if again.sigval != signal.SIGINT:
                raise
            # A second Ctrl-C while they finish their step: stop them at once.
            self._original(agent, signal.SIGINT, timeout)
        handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None) or {}
        self.exit_codes = {local: h.proc.poll() for local, h in handlers.items()}
