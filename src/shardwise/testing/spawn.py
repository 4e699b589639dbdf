"""Run a function in N processes on CPU/gloo, the way shardwise tests itself.

Owns: spawning ranks with torchrun's environment on a free port, collecting each
rank's return value, re-raising a rank's exception with its rank and traceback, and
killing every process on failure or timeout (no orphans: children also die with the
parent on Linux).

The timeout is the function's: its clock starts once every rank has started (imported
torch and joined the process group), which a loaded machine can take many seconds to do;
start-up has its own, generous bound (`STARTUP_S`). Counted from the spawn, a short timeout
was spent before the function ran, and a rank that had nothing to wait for was reported as
blocked.

Must not: know about strategies or models. Public API: `run_distributed`, `RankError`,
`free_port`, `count_collectives`, `assert_same_distribution`.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

STARTUP_S = 240.0
"""Seconds every rank may take to start (spawn, import torch, join the process group)
before `run_distributed` gives up; the function's own `timeout_s` counts after that."""

__all__ = [
    "RankError",
    "assert_same_distribution",
    "count_collectives",
    "free_port",
    "run_distributed",
]


class RankError(RuntimeError):
    """A rank of `run_distributed` raised, crashed or timed out."""

    def __init__(self, message: str, rank: int | None, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _worker(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    conn: Connection,
    init: bool,
    backend: str,
    timeout_s: float,
    threads: int,
) -> None:
    _die_with_parent()
    os.environ.update(env)
    import torch

    torch.set_num_threads(threads)
    from shardwise.distributed.process_group import init_distributed, shutdown

    try:
        if init:
            init_distributed(backend=backend, device="cpu", timeout_s=timeout_s)
        conn.send_bytes(pickle.dumps(("started",)))
        result = fn(*args, **kwargs)
        # Plain pickle copies tensor data; torch's multiprocessing reducers would pass
        # shared-memory handles that vanish when this process exits.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as exc:
        message = ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        conn.send_bytes(pickle.dumps(message))
    finally:
        try:
            if init:
                shutdown()
        finally:
            conn.close()


def _kill_all(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_distributed(
    fn: Callable[..., T],
    world_size: int = 2,
    *,
    args: tuple[object, ...] = (),
    kwargs: Mapping[str, object] | None = None,
    timeout_s: float = 120.0,
    backend: str = "gloo",
    init_process_group: bool = True,
    env: Mapping[str, str] | None = None,
    threads_per_rank: int = 1,
) -> list[T]:
    """Run `fn(*args, **kwargs)` on `world_size` spawned ranks; return the results by rank.

    Each rank gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT as torchrun would
    set them and, unless `init_process_group=False`, a process group from
    `shardwise.init_distributed` whose collectives time out after `timeout_s`.
    `fn`, its arguments and results must be picklable (define `fn` at module level).

    Raises `RankError` naming the first rank that raised (with its traceback), a rank
    that died without reporting, or the ranks still running `timeout_s` after every rank
    started (or not started after `STARTUP_S`); every child is killed before it returns or
    raises.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed(world_size={world_size}) must be >= 1.")
    if timeout_s <= 0:
        raise ValueError(f"run_distributed(timeout_s={timeout_s}) must be > 0 seconds.")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, Connection] = {}
    for rank in range(world_size):
        rank_env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **(env or {}),
        }
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_worker,
            args=(
                fn,
                rank,
                rank_env,
                args,
                dict(kwargs or {}),
                child_end,
                init_process_group,
                backend,
                timeout_s,
                threads_per_rank,
            ),
            name=f"shardwise-rank{rank}",
            daemon=True,
        )
        p.start()
        child_end.close()
        procs.append(p)
        conns[rank] = parent_end
    try:
        return _collect(procs, conns, timeout_s)
    finally:
        _kill_all(procs)


def _collect(
    procs: list[mp.process.BaseProcess], conns: dict[int, Connection], timeout_s: float
) -> list[Any]:
    results: dict[int, Any] = {}
    pending = dict(conns)
    starting = set(conns)  # ranks that have not said "started"
    deadline, timing_fn = time.monotonic() + STARTUP_S, False
    while pending:
        if not starting and not timing_fn:  # every rank started: the function's clock
            deadline, timing_fn = time.monotonic() + timeout_s, True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timed_out(timeout_s, sorted(pending), sorted(results), sorted(starting))
        for conn in wait(list(pending.values()), timeout=min(remaining, 1.0)):
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                msg = pickle.loads(cast(Connection, conn).recv_bytes())
            except EOFError:
                raise _died(procs, rank) from None
            starting.discard(rank)
            if msg[0] == "started":
                continue
            del pending[rank]
            if msg[0] == "error":
                raised = RankError(
                    f"rank {rank} raised {msg[1]}\n--- rank {rank} traceback ---\n{msg[2]}",
                    rank=rank,
                    remote_traceback=msg[2],
                )
                # A rank that died makes the others' collectives fail ("connection reset by
                # peer"), sometimes before its own death is seen: report the death first.
                dead = _first_death(procs, pending, grace_s=2.0)
                raise dead if dead is not None else raised
            results[rank] = msg[1]
    return [results[r] for r in range(len(procs))]


def _timed_out(
    timeout_s: float, pending: list[int], finished: list[int], starting: list[int]
) -> RankError:
    if starting:
        return RankError(
            f"run_distributed: rank(s) {starting} did not start within {STARTUP_S:.0f}s "
            "(spawn, import torch, join the process group); the others were killed.",
            rank=min(starting),
        )
    return RankError(
        f"run_distributed timed out after {timeout_s:.0f}s waiting for rank(s) "
        f"{pending} to return (finished: {finished}). A rank is "
        "probably blocked in a collective that another rank never entered.",
        rank=min(pending),
    )


def _died(procs: list[mp.process.BaseProcess], rank: int) -> RankError:
    procs[rank].join(timeout=5)
    return RankError(
        f"rank {rank} died without reporting (exit code {procs[rank].exitcode}); the other "
        "ranks were killed.",
        rank=rank,
    )


def _first_death(
    procs: list[mp.process.BaseProcess], pending: dict[int, Connection], grace_s: float
) -> RankError | None:
    """A pending rank that exits without reporting within `grace_s`, if any."""
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        for conn in wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic())):
            rank = next(r for r, c in pending.items() if c is conn)
            try:
                msg = pickle.loads(cast(Connection, conn).recv_bytes())
            except EOFError:
                return _died(procs, rank)
            if msg[0] != "started":
                del pending[rank]  # it reported (a result or an error of its own)
    return None


COUNTED_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "all_gather_single",
    "broadcast",
)


@contextlib.contextmanager
def count_collectives(names: tuple[str, ...] = COUNTED_COLLECTIVES) -> Iterator[Counter[str]]:
    """Count calls of torch.distributed collectives made from Python inside the block.

    FSDP2 issues its gradient reduce-scatter/all-reduce through these functions, so the
    counter shows whether a step communicated. DDP reduces in C++: count it with a comm
    hook instead.
    """
    import torch.distributed as dist

    counts: Counter[str] = Counter()
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def assert_same_distribution(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    *,
    std_rtol: float = 0.1,
    mean_sigmas: float = 4.0,
    label: str = "",
) -> None:
    """Check that each tensor in `got` looks drawn like its namesake in `want`.

    Per tensor of more than one element: as many values that are not finite as its
    namesake has (a mask's -inf on both sides; a NaN on one side only is memory left
    uninitialised, and would make the mean and std NaN, which no `>` check fails), then
    over the finite values the standard deviations agree within `std_rtol`, and the means
    within `mean_sigmas` standard errors. This is how a meta-device build is compared with
    an eager build, since values drawn on other ranks cannot be identical.
    """
    import math

    import torch

    missing = sorted(set(want) - set(got))
    if missing:
        raise AssertionError(f"{label}: not in the tensors checked: {missing[:10]}")
    for name, w in want.items():
        g = got[name]
        if w.numel() <= 1:
            continue
        g_finite, w_finite = g[torch.isfinite(g)].float(), w[torch.isfinite(w)].float()
        if g.numel() - g_finite.numel() != w.numel() - w_finite.numel():
            raise AssertionError(
                f"{label}: {name} holds {g.numel() - g_finite.numel()} values that are not "
                f"finite (NaN or inf), expected {w.numel() - w_finite.numel()}: left "
                "uninitialised, or initialised by another rule?"
            )
        if w_finite.numel() <= 1:
            continue
        w_mean, w_std = float(w_finite.mean()), float(w_finite.std())
        g_mean, g_std = float(g_finite.mean()), float(g_finite.std())
        if abs(g_std - w_std) > std_rtol * w_std + 1e-6:
            raise AssertionError(f"{label}: {name} std {g_std:.5f}, expected {w_std:.5f}")
        if abs(g_mean - w_mean) > mean_sigmas * w_std / math.sqrt(g_finite.numel()) + 1e-6:
            raise AssertionError(f"{label}: {name} mean {g_mean:.5f}, expected {w_mean:.5f}")
