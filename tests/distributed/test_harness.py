"""shardwise.testing.run_distributed: results, rank errors, crashes, timeouts, no orphans."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import RankError, free_port, run_distributed


def rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t)


def raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad value on purpose")
    dist.barrier()  # rank 0 would wait here forever without the harness


def crash_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def hang_on_rank_zero() -> int:
    if dist.get_rank() == 0:
        time.sleep(600)
    return os.getpid()


def report_pid() -> int:
    return os.getpid()


def env_only() -> tuple[str, str, bool]:
    return os.environ["RANK"], os.environ["WORLD_SIZE"], dist.is_initialized()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_results_come_back_by_rank():
    assert run_distributed(rank_and_sum, 3, timeout_s=60) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_rank_exception_names_the_rank_and_keeps_traceback():
    with pytest.raises(RankError, match=r"rank 1 raised ValueError: bad value on purpose") as info:
        run_distributed(raise_on_rank_one, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "raise_on_rank_one" in info.value.remote_traceback
    assert not multiprocessing.active_children()


def test_crashed_rank_is_reported_with_exit_code():
    with pytest.raises(RankError, match=r"rank 1 died without reporting \(exit code 3\)"):
        run_distributed(crash_on_rank_one, 2, timeout_s=60)
    assert not multiprocessing.active_children()


def test_timeout_names_the_waiting_ranks_and_kills_everyone():
    start = time.monotonic()
    with pytest.raises(
        RankError,
        match=r"timed out after 8s waiting for rank\(s\) \[0\] to return \(finished: \[1\]\)",
    ):
        run_distributed(hang_on_rank_zero, 2, timeout_s=8)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()


def test_children_are_reaped_after_success():
    pids = run_distributed(report_pid, 2, timeout_s=60)
    assert not any(_alive(pid) for pid in pids)


def test_without_process_group():
    assert run_distributed(env_only, 2, init_process_group=False, timeout_s=60) == [
        ("0", "2", False),
        ("1", "2", False),
    ]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"world_size=0\) must be >= 1"):
        run_distributed(report_pid, 0)
    with pytest.raises(ValueError, match=r"timeout_s=0\) must be > 0"):
        run_distributed(report_pid, 2, timeout_s=0)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
