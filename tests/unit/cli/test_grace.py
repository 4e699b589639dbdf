"""The grace period after a worker fails (cli/grace.py), against a stand-in for torch's agent.

The agent's poll is called as torch calls it; the workers are stand-ins whose exit codes the
test sets, so nothing here depends on how fast a process runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from shardwise.cli.grace import Attempt, FailureGrace


def _agent(codes: dict[int, int | None]) -> tuple[Any, Any]:
    """(agent, worker group): local rank r is global rank 10 + r; `codes` are exit codes."""
    handlers = {
        local: SimpleNamespace(proc=SimpleNamespace(poll=lambda c=code: c))
        for local, code in codes.items()
    }
    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers=handlers))
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=10 + r) for r in codes])
    return agent, group


def _torch_poll(calls: list[dict[int, int | None]]) -> Any:
    """torch's poll: failed when any code is non-zero (it then stops the rest)."""

    def poll(agent: Any, group: Any) -> RunResult:
        codes = {r: h.proc.poll() for r, h in agent._pcontext.subprocess_handlers.items()}
        calls.append(codes)
        failed = {10 + r: f"failure of {r}" for r, c in codes.items() if c not in (None, 0)}
        if failed:
            return RunResult(state=WorkerState.FAILED, failures=failed)
        done = all(c == 0 for c in codes.values())
        return RunResult(state=WorkerState.SUCCEEDED if done else WorkerState.HEALTHY)

    return poll


@pytest.fixture
def grace_with(monkeypatch):
    calls: list[dict[int, int | None]] = []
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", _torch_poll(calls))

    def make(grace_s: float) -> tuple[FailureGrace, list[dict[int, int | None]]]:
        return FailureGrace(grace_s), calls

    return make


def test_the_others_run_on_while_the_grace_lasts(grace_with):
    grace, calls = grace_with(1e9)
    with grace:
        agent, group = _agent({0: 1, 1: None})  # rank 0 failed, rank 1 still running
        result = LocalElasticAgent._monitor_workers(agent, group)
        assert result.state == WorkerState.HEALTHY and calls == []  # torch's poll not asked
        agent, group = _agent({0: 1, 1: 1})  # rank 1 failed on its own, within the grace
        result = LocalElasticAgent._monitor_workers(agent, group)
    assert result.state == WorkerState.FAILED and len(calls) == 1
    assert grace.attempts == [Attempt({10: "failure of 0", 11: "failure of 1"}, frozenset())]


def test_after_the_grace_torch_stops_the_rest_and_they_are_recorded_as_stopped(grace_with):
    grace, calls = grace_with(0.0)
    with grace:
        agent, group = _agent({0: None, 1: -9, 2: None})
        result = LocalElasticAgent._monitor_workers(agent, group)
    assert result.state == WorkerState.FAILED and len(calls) == 1
    assert grace.attempts[0].stopped == frozenset({10, 12})


def test_nothing_changes_while_no_worker_failed(grace_with):
    grace, calls = grace_with(1e9)
    with grace:
        for codes in ({0: None, 1: None}, {0: 0, 1: None}, {0: 0, 1: 0}):
            agent, group = _agent(codes)
            LocalElasticAgent._monitor_workers(agent, group)
    assert len(calls) == 3 and grace.attempts == []


def test_the_agents_poll_is_put_back(grace_with):
    grace, _ = grace_with(1.0)
    before = LocalElasticAgent._monitor_workers
    with grace:
        assert LocalElasticAgent._monitor_workers is not before
    assert LocalElasticAgent._monitor_workers is before


def test_each_attempt_gets_its_own_grace(grace_with, monkeypatch):
    """Issue 48: after a restart the grace starts again at the new attempt's first failure
    (a clock left from the first attempt would give the second none, and its report would
    blame the ranks torch stopped)."""
    import shardwise.cli.grace as grace_module

    clock = [100.0]
    monkeypatch.setattr(grace_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    grace, calls = grace_with(5.0)
    with grace:
        agent, group = _agent({0: 1, 1: None})  # attempt 1: rank 0 fails, rank 1 runs
        assert LocalElasticAgent._monitor_workers(agent, group).state == WorkerState.HEALTHY
        clock[0] += 6.0  # the grace runs out: torch stops rank 1
        assert LocalElasticAgent._monitor_workers(agent, group).state == WorkerState.FAILED
        clock[0] += 60.0  # the restart; attempt 2's rank 0 fails, its rank 1 still runs
        agent, group = _agent({0: 1, 1: None})
        assert LocalElasticAgent._monitor_workers(agent, group).state == WorkerState.HEALTHY
        clock[0] += 4.0  # within attempt 2's own grace
        assert LocalElasticAgent._monitor_workers(agent, group).state == WorkerState.HEALTHY
    assert len(calls) == 1  # torch's poll asked once: at the end of attempt 1's grace
