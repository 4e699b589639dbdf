"""Stalls that name the stuck rank: `guard(what)` and `StallError`.

Owns: turning a collective that failed inside `with guard("train step 12"):` into a
`StallError` that says what the ranks were doing, which rank raised, which rank(s) never
arrived, and the timeout setting to change.

How: when a collective on the default group times out (its timeout is
`init_distributed(timeout_s=)`, `shardwise run --timeout`, or SHARDWISE_TIMEOUT_S), every
rank that was waiting calls torch's `dist.monitored_barrier` on the monitor group with a
short timeout. Rank 0 collects the others there; a rank that is still stuck in its step
never arrives, and gloo names it ("Ranks 1 failed to pass monitoredBarrier"). The monitor
group (made by `init_distributed`, see process_group.py) is a separate gloo group so the
check works after the default group's collective failed, and on nccl jobs too. Nothing
runs unless a collective fails: on the good path `guard` is a plain try block.

On nccl, torch's own watchdog aborts the process when a collective times out
(TORCH_NCCL_ASYNC_ERROR_HANDLING), so no exception reaches `guard`; use torch's flight
recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) there. Must not: issue collectives on the good
path, or catch errors that are not a collective failing.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from shardwise.distributed.process_group import get_dist_info, monitor_group

__all__ = ["PeerExitedError", "StallError", "guard", "is_comm_failure"]

MAX_CHECK_S = 30.0
"""The barrier that finds the missing rank waits at most this long (less for short timeouts)."""

# Gloo reports a timed-out or broken collective as a plain RuntimeError; recognise it by text.
_COMM_FAILURE = re.compile(
    r"timed out|timeout|connection (closed|reset|refused)|broken pipe|gloo|nccl|"
    r"monitoredbarrier|socket",
    re.IGNORECASE,
)
# A peer whose process ended: its sockets close at once, long before any timeout.
_PEER_GONE = re.compile(
    r"connection (closed|reset) by peer|broken pipe|econnreset|remote worker crash", re.IGNORECASE
)
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class StallError(RuntimeError):
    """A collective inside `guard(what)` failed; says which rank(s) did not arrive."""

    def __init__(self, message: str, *, what: str, rank: int, missing: list[int] | None) -> None:
        super().__init__(message)
        self.what = what
        self.rank = rank
        self.missing = missing
        """Ranks that did not reach the check; None when this rank could not tell."""


class PeerExitedError(StallError):
    """A collective inside `guard(what)` broke because another rank's process ended.

    Not a stall: the peer is gone (crashed, killed, out of memory), so a longer timeout does
    not help. `shardwise run` names the rank and its exit code or signal.
    """


def is_comm_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing (torch's DistError, or the plain RuntimeError
    gloo raises). A library's own error class (a CheckpointError) is never one, whatever
    its text says: it has already been reported in its own words."""
    if isinstance(exc, dist.DistError):
        return True
    return type(exc) is RuntimeError and bool(_COMM_FAILURE.search(str(exc)))


def _find_missing(check_s: float) -> tuple[list[int] | None, str]:
    """(ranks that did not arrive or None, how that was found) via monitored_barrier."""
    monitor = monitor_group()
    if monitor is None:
        return None, "no monitor group (init_distributed did not create the process group)"
    try:
        dist.monitored_barrier(
            group=monitor, timeout=timedelta(seconds=check_s), wait_all_ranks=True
        )
    except RuntimeError as exc:
        found = _MISSING.search(str(exc))
        if found:
            return [int(r) for r in found.group(1).replace(",", " ").split()], ""
        return None, (
            "rank 0, which runs the check, did not confirm: either rank 0 is the stuck rank "
            "or it found another one (see rank 0's error)"
        )
    return [], "every rank reached the check, so no rank is stuck"


def _timeout_s() -> float:
    return get_dist_info().timeout_s


def _peer_exited(what: str, exc: BaseException) -> PeerExitedError:
    rank = dist.get_rank()
    message = (
        f"rank {rank}: during {what} the connection to another rank closed: that rank's "
        "process ended (it crashed, was killed, or ran out of memory). Its own error, or "
        "the launcher's line naming its exit code or signal, says why; this is not a stall, "
        f"so a longer timeout will not help.\nCollective error: {str(exc).strip()[:300]}"
    )
    return PeerExitedError(message, what=what, rank=rank, missing=None)


def _stall_error(what: str, exc: BaseException) -> StallError:
    rank = dist.get_rank()
    if _PEER_GONE.search(str(exc)):
        return _peer_exited(what, exc)
    timeout_s = _timeout_s()
    check_s = min(MAX_CHECK_S, max(2.0, timeout_s))
    missing, how = _find_missing(check_s)
    if missing:
        names = ", ".join(str(r) for r in missing)
        head = (
            f"rank {rank}: {what} stalled: rank(s) {names} did not arrive within the "
            f"collective timeout ({timeout_s:g} s); rank(s) {names} are stuck inside or before "
            f"{what}"
        )
    else:
        head = (
            f"rank {rank}: a collective in {what} failed after waiting up to {timeout_s:g} s; {how}"
        )
    message = (
        f"{head}.\nCollective error: {str(exc).strip()[:500]}\n"
        "If the step is only slow (a long first compile, a slow save), raise the timeout: "
        "`shardwise run --timeout SECONDS`, SHARDWISE_TIMEOUT_S, or "
        "init_distributed(timeout_s=...)."
    )
    return StallError(message, what=what, rank=rank, missing=missing or None)


@contextlib.contextmanager
def guard(what: str) -> Iterator[None]:
    """Name the stuck rank if a collective inside the block times out or breaks.

        with guard(f"train step {step}"):
            loss = engine.train_step(batch)

    Raises `StallError` (from the collective's own error) on the ranks whose collective
    failed. Free when nothing fails; with one rank or no process group it only re-raises.
    """
    try:
        yield
    except StallError:
        raise  # an inner guard already checked
    except Exception as exc:
        if not (is_comm_failure(exc) and dist.is_initialized() and dist.get_world_size() > 1):
            raise
        raise _stall_error(what, exc) from exc
