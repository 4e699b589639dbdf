"""How the ranks of a checkpoint operation agree: every rank learns every outcome.

Owns: `_agree` (every rank learns whether any rank failed, so none waits forever),
work on rank 0 alone with the result or error sent to all (`_on_rank0`), gathering a small
value from every rank, each rank's share of a file list, and silencing DCP's warning when
there is no process group (`single_process_ok`).

Must not: read or write checkpoint files (layout.py and commit.py do).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardwise.checkpoint.trust import (
    CheckpointError,
)
from shardwise.distributed.process_group import (
    get_dist_info,
    rank_and_world,
    serves_cpu,
)


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """Silence DCP's warning about running without a process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _agree(error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed, so none waits forever for the others."""
    _, world = rank_and_world()
    if world > 1:
        flag = torch.tensor([1.0 if error is not None else 0.0])
        if not serves_cpu(dist.get_backend()):  # a nccl-only group
            flag = flag.cuda()
        dist.all_reduce(flag)
        failed = int(flag.item())
    else:
        failed = int(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on {failed} other rank(s); see their errors.")


def _my_share(names: list[str]) -> list[str]:
    """This rank's part of a file list: every rank hashes 1/world of the files."""
    rank, world = rank_and_world()
    return names[rank::world]


def _gather_to_all(value: Any) -> list[Any]:
    """Every rank's `value`, on every rank (a one-element list without a group)."""
    _, world = rank_and_world()
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return out


def _on_rank0(work: Callable[[], Any], what: str) -> Any:
    """`work()` on rank 0 alone; every rank returns its result or raises its error. The
    others wait in a broadcast, bounded by the process group's timeout."""
    rank, world = rank_and_world()
    result: Any = None
    error: BaseException | None = None
    if rank == 0:
        try:
            result = work()
        except (OSError, CheckpointError) as exc:
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(f"{exc}")
    if world > 1:
        box: list[Any] = [(error is None, result if error is None else str(error))]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as exc:
            raise CheckpointError(
                f"rank {rank}: waiting for rank 0 to {what} failed: {exc} (collectives time "
                f"out after {get_dist_info().timeout_s:.0f} s)."
            ) from None
        ok, value = box[0]
        if rank != 0:
            if not ok:
                raise CheckpointError(f"rank 0 could not {what}: {value}")
            return value
    if error is not None:
        raise CheckpointError(f"could not {what}: {error}") from error
    return result
