"""The simulation's traces run side by side in forked children (memory/workers.py): the same
answers in the same order as one after another, errors raised here with the child's own
type, and no child left running."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from typing import Any

import pytest

from shardwise.memory import workers
from shardwise.memory.workers import ChildTraceback, drive, gather, run_jobs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks on Linux")


def _square(job: dict[str, Any]) -> tuple[int, int]:
    return job["x"] ** 2, os.getpid()


def _jobs(n: int) -> list[dict[str, Any]]:
    return [{"x": x} for x in range(n)]


@pytest.mark.parametrize("n_workers", [1, 2, 3])
def test_answers_in_order_whatever_the_workers(n_workers: int) -> None:
    out = run_jobs(_jobs(5), _square, n_workers, timeout_s=60)
    assert [v for v, _ in out] == [x * x for x in range(5)]
    pids = [pid for _, pid in out]
    if n_workers == 1:
        assert set(pids) == {os.getpid()}  # here, one after another
    else:  # the first here (it warms what the children inherit), a fresh fork for each other
        assert pids[0] == os.getpid() and os.getpid() not in pids[1:] and len(set(pids)) == 5
    assert not mp.active_children()


def _timed(job: dict[str, Any]) -> tuple[float, float]:
    start = time.monotonic()
    if job["x"] == 0:
        time.sleep(1.0)
    return start, time.monotonic()


def test_the_first_children_start_beside_the_parents_trace_and_the_rest_after_it() -> None:
    """With more jobs than workers, `workers` children run while this process traces the
    first job (no core idles), and the rest fork after it (inheriting what it warmed)."""
    (_, here_end), *forked = run_jobs(_jobs(4), _timed, 2, timeout_s=60)
    assert [start < here_end for start, _ in forked] == [True, True, False]


def test_one_job_runs_here_and_as_many_jobs_as_workers_all_fork() -> None:
    ((_, pid),) = run_jobs(_jobs(1), _square, 4, timeout_s=60)
    assert pid == os.getpid()
    pids = [pid for _, pid in run_jobs(_jobs(2), _square, 2, timeout_s=60)]
    assert os.getpid() not in pids and len(set(pids)) == 2


def _raise(job: dict[str, Any]) -> None:
    if job["x"] == 1:
        raise ValueError("ParallelConfig.tp=3 does not divide 8")
    time.sleep(0.2)


def test_a_childs_exception_is_raised_here_with_its_type_and_traceback() -> None:
    with pytest.raises(ValueError, match="tp=3 does not divide 8") as info:
        run_jobs(_jobs(3), _raise, 2, timeout_s=60)
    assert isinstance(info.value.__cause__, ChildTraceback)
    assert "Traceback" in str(info.value.__cause__) and "_raise" in str(info.value.__cause__)
    assert not mp.active_children()


class _Unpicklable(Exception):
    def __init__(self, handle: Any) -> None:
        super().__init__("no pickle")
        self.handle = handle

    def __reduce__(self) -> Any:
        raise TypeError("cannot pickle")


def _raise_unpicklable(job: dict[str, Any]) -> None:
    raise _Unpicklable(lambda: None)


def test_an_exception_that_does_not_pickle_comes_back_as_its_text() -> None:
    from shardwise import ParallelConfig

    jobs = [{"config": ParallelConfig(strategy="full_shard")}, {"config": None}]
    with pytest.raises(RuntimeError, match=r"tracing strategy=full_shard failed: _Unpicklable"):
        run_jobs(jobs, _raise_unpicklable, 2, timeout_s=60)


def _die(job: dict[str, Any]) -> None:
    os._exit(3)


def test_a_child_that_dies_is_named() -> None:
    from shardwise import ParallelConfig

    jobs = [{"config": ParallelConfig(strategy="ddp"), "segments": (None, 5)}] * 2
    with pytest.raises(
        RuntimeError, match=r"strategy=ddp, the run cut to 5 blocks died \(exit code 3\)"
    ):
        run_jobs(jobs, _die, 2, timeout_s=60)
    assert not mp.active_children()


def _sleep(job: dict[str, Any]) -> None:
    time.sleep(job["x"])


def test_a_trace_over_the_timeout_is_named_and_every_child_killed() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ran over 1.0s in its forked worker"):
        run_jobs([{"x": 30}, {"x": 30}], _sleep, 2, timeout_s=1.0)
    assert time.monotonic() - t0 < 20
    assert not mp.active_children()


def _nested(job: dict[str, Any]) -> list[int]:
    return [pid for _, pid in run_jobs(_jobs(2), _square, 2, timeout_s=60)]


def test_a_forked_child_does_not_fork_again() -> None:
    out = run_jobs(_jobs(2), _nested, 2, timeout_s=60)
    for pids in out:
        assert len(set(pids)) == 1 and os.getpid() not in pids


def _ask(tag: str, rounds: int) -> workers.Job:
    got = []
    for r in range(rounds):
        answers = yield [{"x": 10 * r + k, "tag": tag} for k in range(2)]
        got.append(answers)
    return tag, got


def test_gather_asks_every_jobs_traces_together_and_answers_each_its_own() -> None:
    batches: list[list[Any]] = []

    def runs(wanted: list[dict[str, Any]]) -> list[Any]:
        batches.append(wanted)
        return [(w["tag"], w["x"]) for w in wanted]

    answers = drive(gather([_ask("a", 2), _ask("b", 1), _ask("c", 0)]), runs)
    assert [len(b) for b in batches] == [4, 2]  # a's and b's first round together
    assert answers == [
        ("a", [[("a", 0), ("a", 1)], [("a", 10), ("a", 11)]]),
        ("b", [[("b", 0), ("b", 1)]]),
        ("c", []),
    ]


def test_nested_gathers_are_one_job() -> None:
    def outer() -> workers.Job:
        inner = yield from gather([_ask("x", 1), _ask("y", 1)])
        (last,) = yield [{"x": 99, "tag": "z"}]
        return inner, last

    calls = []

    def runs(wanted: list[dict[str, Any]]) -> list[Any]:
        calls.append(len(wanted))
        return [w["x"] for w in wanted]

    assert drive(gather([outer(), _ask("w", 1)]), runs) == [
        ([("x", [[0, 1]]), ("y", [[0, 1]])], 99),
        ("w", [[0, 1]]),
    ]
    assert calls == [6, 1]


def test_workers_default_to_this_process_cpus_at_most_four(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert workers.check_workers(None) == min(len(os.sched_getaffinity(0)), 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert workers.check_workers(None) == 4  # a plan's host memory stays under 4 GiB
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert workers.check_workers(None) == 3
    assert workers.check_workers(9) == 9


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_workers_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"simulate_step\(workers={bad!r}\).*an int >= 1"):
        workers.check_workers(bad)


def _softmax(job: dict[str, Any]) -> float:
    import torch

    return float(torch.ones(256, 4096).softmax(-1).sum())


def test_a_child_runs_real_ops_after_the_parent_used_its_thread_pool() -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(256, 4096).softmax(-1)  # the parent's OpenMP pool is started
        out = run_jobs(_jobs(2), _softmax, 2, timeout_s=10)
    finally:
        torch.set_num_threads(threads)
    assert out == [256.0, 256.0]


def test_in_background_runs_beside_this_process_and_answers_later() -> None:
    from shardwise.memory.workers import in_background

    answer = in_background(lambda: (os.getpid(), 6 * 7), "the instant estimates", 30)
    pid, value = answer()
    assert value == 42 and pid != os.getpid()
    assert not mp.active_children()


def test_in_background_raises_the_childs_error_and_names_a_death_or_a_timeout() -> None:
    from shardwise.memory.workers import in_background

    def refuse() -> None:
        raise NotImplementedError("tp is only simulated")

    with pytest.raises(NotImplementedError, match="tp is only simulated") as info:
        in_background(refuse, "the instant estimates", 30)()
    assert isinstance(info.value.__cause__, ChildTraceback)
    with pytest.raises(RuntimeError, match=r"worker of the instant estimates died \(exit code 5\)"):
        in_background(lambda: os._exit(5), "the instant estimates", 30)()
    with pytest.raises(TimeoutError, match=r"the instant estimates ran over 0\.5s"):
        in_background(lambda: time.sleep(30), "the instant estimates", 0.5)()
    assert not mp.active_children()
