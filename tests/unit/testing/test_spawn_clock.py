"""run_distributed's timeout is the function's: it starts once every rank has started.

The ranks are stand-ins whose messages arrive at set times on a fake clock, so a slow
start-up (a loaded machine) is exact and costs no time.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from shardwise.testing import RankError, spawn


class _Rank:
    """A rank's end of the pipe: (time, message) pairs, readable from their time on."""

    def __init__(self, clock: list[float], *messages: tuple[float, tuple[Any, ...]]) -> None:
        self.clock = clock
        self.messages = list(messages)

    def ready(self) -> bool:
        return bool(self.messages) and self.messages[0][0] <= self.clock[0]

    def recv_bytes(self) -> bytes:
        return pickle.dumps(self.messages.pop(0)[1])


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [0.0]

    def wait(conns: list[_Rank], timeout: float) -> list[_Rank]:
        ready = [c for c in conns if c.ready()]
        if not ready:
            now[0] += timeout
        return ready

    monkeypatch.setattr(spawn.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(spawn, "wait", wait)
    return now


def test_a_slow_start_does_not_spend_the_functions_timeout(clock):
    """Start-up takes 20 s; rank 1 returns at once, rank 0 never does. With the clock
    counted from the spawn, the 8 s were gone before either started (finished: [])."""
    ranks = {
        0: _Rank(clock, (20.0, ("started",))),
        1: _Rank(clock, (20.0, ("started",)), (20.0, ("ok", 1))),
    }
    with pytest.raises(
        RankError, match=r"after 8s waiting for rank\(s\) \[0\] .*\(finished: \[1\]\)"
    ):
        spawn._collect([None, None], ranks, timeout_s=8)
    assert 28.0 <= clock[0] < 30.0  # the 8 s counted from the start at 20 s


def test_the_function_gets_its_whole_timeout_after_start_up(clock):
    ranks = {
        0: _Rank(clock, (20.0, ("started",)), (27.0, ("ok", 0))),
        1: _Rank(clock, (25.0, ("started",)), (26.0, ("ok", 1))),
    }
    assert spawn._collect([None, None], ranks, timeout_s=8) == [0, 1]


def test_a_rank_that_never_starts_is_named_after_the_start_up_bound(clock):
    ranks = {0: _Rank(clock, (1.0, ("started",))), 1: _Rank(clock)}
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] did not start within 240s"):
        spawn._collect([None, None], ranks, timeout_s=8)
    assert clock[0] >= spawn.STARTUP_S
