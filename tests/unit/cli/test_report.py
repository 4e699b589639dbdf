"""What `shardwise run` prints when workers fail: each error once, with its ranks."""

from __future__ import annotations

import logging
import signal

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from shardwise.cli.grace import Attempt
from shardwise.cli.report import (
    AgentLogReader,
    Failure,
    describe_exit,
    failures_from_torch,
    preempted,
    summary,
)
from shardwise.distributed.worker_errors import record_error, refused


def test_describe_exit():
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "was killed by signal 9 (SIGKILL)"
    assert describe_exit(75) == (
        "exited with code 75: stopped on a stop signal, after saving a checkpoint"
    )


def test_ranks_that_all_exited_75_read_as_stopped_and_saved_not_failed():
    saved = [Failure(0, 0, 75), Failure(1, 1, 75)]
    assert preempted(saved)
    assert summary(saved).splitlines() == [
        "shardwise run: 2 rank(s) stopped and saved:",
        "  ranks 0, 1: exited with code 75: stopped on a stop signal, after saving a checkpoint",
    ]
    # One rank that failed otherwise, or a 75 with an error of its own: a failure.
    assert not preempted([*saved, Failure(2, 0, 1)])
    assert not preempted([Failure(0, 0, 75, "SystemExit: 75")])
    assert not preempted([])
    assert summary([*saved, Failure(2, 0, 1)]).startswith("shardwise run: 3 rank(s) failed:")


def test_the_same_error_in_every_rank_is_one_line_naming_them():
    message = "ConfigError: unknown key 'train.max_stepz'"
    out = summary([Failure(r, r, 1, message, "Traceback ...", True) for r in range(4)])
    assert out.splitlines() == [
        "shardwise run: 4 rank(s) failed:",
        "  ranks 0, 1, 2, 3: ConfigError (shown above)",  # local rank 0 printed it live
    ]
    assert out.count("unknown key") == 0


def test_an_error_that_local_rank_0_did_not_print_is_printed_whole_once():
    tb = 'Traceback (most recent call last):\n  File "x.py", line 4\nValueError: boom on 1\n'
    out = summary(
        [
            Failure(0, 0, 1, "ValueError: boom on 0", "tb0", False),
            Failure(1, 1, 1, "ValueError: boom on 1", tb, False),
            Failure(3, 1, 1, "ValueError: boom on 1", tb, False),
        ]
    )
    assert "  rank 0: ValueError (shown above)" in out
    assert "  ranks 1, 3 raised:" in out and out.count("boom on 1") == 1


def test_a_killed_rank_is_named_with_its_signal_and_the_stopped_rest_as_such():
    # Without the grace's record (stopped=None) a SIGTERM with no error counts as a stop.
    out = summary([Failure(0, 0, -15), Failure(1, 1, -9)])
    assert out.splitlines()[1:] == [
        "  rank 1: was killed by signal 9 (SIGKILL)",
        "  rank 0: stopped because rank 1 ended",
    ]
    # Only SIGTERMs (a preempted node): nothing else to blame, so they are named plainly.
    assert "rank 0: was killed by signal 15 (SIGTERM)" in summary([Failure(0, 0, -15)])
    # With it, a SIGTERM the launcher did not send is a cause like any other signal.
    out = summary([Failure(0, 0, -15), Failure(1, 1, -9)], stopped=set())
    assert "  rank 0: was killed by signal 15 (SIGTERM)" in out and "stopped" not in out


LOST_PEER = (
    "PeerExitedError: rank 0: during step 3 the connection to another rank closed: that "
    "rank's process ended (...).\nCollective error: Connection closed by peer [127.0.0.1]:1"
)
DEAD_PEER_REPORT = [
    "shardwise run: 2 rank(s) failed:",
    "  rank 1: was killed by signal 9 (SIGKILL)",
    "  rank 0: stopped because rank 1 ended",
]


def test_a_survivors_lost_peer_and_a_launcher_stop_read_alike():
    """Quiet machine: rank 0 raises PeerExitedError within the grace. Busy machine: it is
    still running when the grace ends and the launcher stops it. One report for both."""
    dead = Failure(1, 1, -9)
    quiet = summary([Failure(0, 0, 1, LOST_PEER, "Traceback ...", True), dead], stopped=set())
    busy = summary([Failure(0, 0, -15), dead], stopped={0})
    assert quiet.splitlines() == busy.splitlines() == DEAD_PEER_REPORT


def test_a_rank_the_launcher_stopped_is_no_cause_whatever_its_exit():
    """A Runner turns the launcher's SIGTERM into a checkpoint and exit 75; a rank that
    ignores SIGTERM dies by torch's SIGKILL 30 s later. Neither is why the job ended."""
    stall = Failure(0, 0, 1, "StallError: rank 0: train step 3 stalled: rank(s) 1 ...", "", True)
    for stopped_rank in (
        Failure(1, 1, 75, "Preempted: stopped at step 3", "tb"),
        Failure(1, 1, -9),
    ):
        out = summary([stall, stopped_rank], stopped={1})
        assert out.splitlines()[1:] == [
            "  rank 0: StallError (shown above)",
            "  rank 1: stopped because rank 0 ended",
        ]


def test_a_lost_peer_with_nothing_else_to_blame_on_this_node_is_printed_whole():
    """The dead peer was on another node: this node's report is the survivors' own error,
    which local rank 0 did not print (the launcher reports lost peers)."""
    out = summary([Failure(0, 0, 1, LOST_PEER, "Traceback ...", True), Failure(1, 1, -15)],
                  stopped={1})  # fmt: skip
    assert out.splitlines()[1:] == [
        "  rank 0: " + LOST_PEER.splitlines()[0],
        "    " + LOST_PEER.splitlines()[1],
        "  rank 1: stopped because rank 0 ended",
    ]


def test_torch_reads_the_error_file_the_worker_hook_writes(tmp_path):
    try:
        raise ValueError("boom")
    except ValueError as exc:
        record_error(exc, str(tmp_path / "error.json"))
    torch_failure = ProcessFailure(
        local_rank=1, pid=7, exitcode=1, error_file=str(tmp_path / "error.json")
    )
    missing = ProcessFailure(
        local_rank=0, pid=8, exitcode=-9, error_file=str(tmp_path / "none.json")
    )
    ours = failures_from_torch({4: torch_failure, 3: missing})
    assert [(f.rank, f.local_rank, f.exitcode) for f in ours] == [(3, 0, -9), (4, 1, 1)]
    assert ours[0].message == ""  # torch's "<NONE>" placeholder is no message
    assert ours[1].message == "ValueError: boom" and 'raise ValueError("boom")' in ours[1].traceback


def test_a_refused_setting_only_other_ranks_raised_is_one_line(tmp_path):
    """A ValueError marked as the user's setting (a layout wrap() refused) is printed as its
    message: the mark travels in the error file, as the class name cannot say it."""
    try:
        raise refused(ValueError("ParallelConfig.dp_shard=3 does not divide the world size 4."))
    except ValueError as exc:
        record_error(exc, str(tmp_path / "error.json"))
    failure = ProcessFailure(
        local_rank=1, pid=7, exitcode=1, error_file=str(tmp_path / "error.json")
    )
    out = summary(failures_from_torch({5: failure}))
    assert out.splitlines()[1:] == [
        "  rank 5: ValueError: ParallelConfig.dp_shard=3 does not divide the world size 4."
    ]


def _record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_restart_is_announced_with_the_report_of_the_attempt(tmp_path, capsys):
    try:
        raise RuntimeError("CUDA error: an illegal memory access")
    except RuntimeError as exc:
        record_error(exc, str(tmp_path / "error.json"))
    failures = {
        3: ProcessFailure(
            local_rank=1, pid=99, exitcode=1, error_file=str(tmp_path / "error.json")
        ),
        2: ProcessFailure(local_rank=0, pid=98, exitcode=-15, error_file=str(tmp_path / "no")),
    }
    mp = "torch.distributed.elastic.multiprocessing.api"
    agent = "torch.distributed.elastic.agent.server.api"
    attempts: list[Attempt] = []
    with AgentLogReader(attempts) as reader:
        failed = _record(
            mp,
            logging.ERROR,
            "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
            1,
            1,
            99,
            "python",
        )
        assert not reader.filter(failed)  # torch's line is replaced by ours
        closing = _record(
            mp, logging.WARNING, "Sending process %s closing signal %s", 98, "SIGTERM"
        )
        assert not reader.filter(closing)  # "stopped because rank 3 ended" says it
        attempts.append(Attempt(failures, frozenset({2})))  # as cli/grace.py records it
        restart = _record(
            agent,
            logging.INFO,
            "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
            "default",
            "FAILED",
            2,
            2,
        )
        assert not reader.filter(restart)
        assert not reader.filter(_record(agent, logging.INFO, "[default] Starting worker group"))
        death = "Received %s death signal, shutting down workers"
        assert reader.filter(_record(agent, logging.WARNING, death, signal.SIGTERM))
        # Ctrl-C: the workers' rank 0 or the launcher says it, in one line.
        assert not reader.filter(_record(agent, logging.WARNING, death, signal.SIGINT))
    err = capsys.readouterr().err
    assert "shardwise run: 2 rank(s) failed:\n  rank 3 raised:" in err
    assert "an illegal memory access" in err
    assert "  rank 2: stopped because rank 3 ended\n" in err
    assert "restarting the workers: restart 1 of 2 (1 left)" in err
    assert logging.getLogger(agent).filters == []  # put back as it was


def _node_failure(tmp_path, rank: int, local: int, exc: BaseException | None, code: int = 1):
    """torch's ProcessFailure for global `rank` (local rank `local`), with the error file the
    worker hook writes when `exc` is given."""
    path = tmp_path / f"error-{rank}.json"
    if exc is not None:
        try:
            raise exc
        except BaseException as raised:  # recorded, as the hook does
            record_error(raised, str(path))
    return ProcessFailure(local_rank=local, pid=100 + rank, exitcode=code, error_file=str(path))


def test_the_second_node_of_a_two_node_job_reads_its_local_rank_0_by_local_rank(tmp_path):
    """Node 1 of 2 runs global ranks 2 and 3 as local ranks 0 and 1. Its local rank 0 (global
    rank 2) printed its own error live; global rank 0 is on the other node."""
    from shardwise.config import ConfigError

    typo = ConfigError("unknown key 'train.max_stepz'. Did you mean 'max_steps'?")
    both = failures_from_torch(
        {2: _node_failure(tmp_path, 2, 0, typo), 3: _node_failure(tmp_path, 3, 1, typo)}
    )
    assert [(f.rank, f.local_rank) for f in both] == [(2, 0), (3, 1)]
    out = summary(both, world=4, stopped=set())
    assert out.splitlines() == [
        "shardwise run: 2 of 4 rank(s) failed:",
        "  ranks 2, 3: ConfigError (shown above)",
    ]
    # Only global rank 3 (local rank 1) raised: nobody printed it, so it is printed once,
    # whole; global rank 2, stopped by the launcher, is named as such.
    boom = ValueError("boom on rank 3")
    one = failures_from_torch(
        {2: _node_failure(tmp_path, 2, 0, None, -15), 3: _node_failure(tmp_path, 3, 1, boom)}
    )
    lines = summary(one, world=4, stopped={2}).splitlines()
    assert lines[:2] == ["shardwise run: 2 of 4 rank(s) failed:", "  rank 3 raised:"]
    assert lines[-2:] == [
        "    ValueError: boom on rank 3",
        "  rank 2: stopped because rank 3 ended",
    ]
    assert sum("boom on rank 3" in line for line in lines) == 1
    # Only global rank 2 (local rank 0): printed live, so pointed to, not printed again.
    own = failures_from_torch(
        {2: _node_failure(tmp_path, 2, 0, typo), 3: _node_failure(tmp_path, 3, 1, None, -15)}
    )
    assert summary(own, world=4, stopped={3}).splitlines()[1:] == [
        "  rank 2: ConfigError (shown above)",
        "  rank 3: stopped because rank 2 ended",
    ]


def test_a_rank_that_wrote_its_error_before_sigterm_ended_it_is_a_cause():
    """Issue 48: SIGTERM alone is the launcher stopping a rank; a rank that wrote its own
    error first (a watchdog timeout, then torch's SIGTERM) failed, and its error is shown."""
    first = Failure(0, 0, -15, "RuntimeError: NCCL watchdog timeout", "tb", False)
    other = Failure(1, 1, 1, "ValueError: bad shape", "", True)
    lines = summary([first, other]).splitlines()
    assert "  rank 0: RuntimeError (shown above)" in lines
    assert "  rank 1: ValueError: bad shape" in lines
    assert not any("stopped because" in line for line in lines)
    quiet = summary([Failure(0, 0, -15), other]).splitlines()  # SIGTERM, no error of its own
    assert "  rank 0: stopped because rank 1 ended" in quiet
