"""Asynchronous saves: DCP's async_save into a reused CPU copy, completed by `result()`.

Owns: `PendingCheckpoint` and `wait_for_checkpoint`, the gloo group beside the default one
for DCP's background thread, the staging copy reused from save to save, and abandoning a
save nobody completed at shutdown. The background thread's collectives run on the separate
gloo group: on the default group they interleave with training's own collectives, and gloo
aborts the process ("Received data size doesn't match expected size", measured at torch
2.13); DCP also requires a CPU backend for async saves, which a NCCL job lacks.

Must not: make a checkpoint visible before every rank's files are written (commit.py does,
from `result()`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.staging import AsyncStager

from shardwise.checkpoint.commit import _agree_or_clean, _finish, _hash_share, _write_failed
from shardwise.checkpoint.layout import STATE_DIR, _log
from shardwise.checkpoint.ranks import _gather_to_all, single_process_ok
from shardwise.checkpoint.trust import (
    CheckpointError,
    root_cause,
    stalled_collective,
)
from shardwise.distributed.process_group import (
    _register_shutdown_hook,
    get_dist_info,
    rank_and_world,
)
from shardwise.distributed.watchdog import guard

_PENDING: PendingCheckpoint | None = None  # the asynchronous save in flight in this process


_ASYNC_GROUP: tuple[Any, Any] | None = None  # (default group, its gloo sibling for DCP's thread)


_STAGER: _ReusedStager | None = None  # the CPU copy that asynchronous saves write from


class PendingCheckpoint:
    """A checkpoint being written in the background (`save_checkpoint(..., async_=True)`).

    DCP's thread writes a CPU copy of the state taken during the call, then this rank
    hashes its share of the files, still in the background. Nothing is visible until
    `result()`: a process killed before then leaves only ROOT/.tmp-step_N, which the next
    save removes. Made by `save_checkpoint` only: `manifest` is the JSON it will write (any
    JSON values, typed Any) and `written` DCP's own future, whose value is not read.
    """

    def __init__(
        self,
        root: Path,
        tmp: Path,
        final: Path,
        manifest: dict[str, Any],
        keep_last: int | None,
        written: concurrent.futures.Future[Any],
    ) -> None:
        self.path, self.root, self.tmp = final, root, tmp
        self._manifest, self._keep_last = manifest, keep_last
        self._hashed: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._outcome: Path | BaseException | None = None
        written.add_done_callback(self._hash)

    def _hash(self, written: concurrent.futures.Future[Any]) -> None:
        # Runs on DCP's thread once every rank's data and the .metadata are on disk (DCP's
        # save ends in a collective), so every rank lists the same files.
        try:
            written.result()
            self._hashed.set_result(_hash_share(self.tmp))
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._hashed.set_exception(exc)

    def done(self) -> bool:
        """Whether this rank's background writing and hashing has ended. Local (other
        ranks may still be writing), and `result()` must still be called."""
        return self._outcome is not None or self._hashed.done()

    @guard("finishing an asynchronous checkpoint save")  # a stopped rank is named
    def result(self, timeout_s: float | None = None) -> Path:
        """Make the checkpoint visible (manifest, rename, `latest`, pruning) once every
        rank's files are written; every rank must call it. Returns ROOT/step_N.

        Each rank waits at most `timeout_s` for its background write; if any rank runs
        out, every rank raises `CheckpointError` and the save stays pending (call again).
        A failed write removes the partial files and raises on every rank.
        """
        global _PENDING
        if isinstance(self._outcome, Path):
            return self._outcome
        if self._outcome is not None:
            raise self._outcome
        rank = rank_and_world()[0]
        hashed: Any = None
        error: BaseException | None = None
        try:
            hashed = self._hashed.result(timeout=timeout_s)
        except TimeoutError:
            hashed = "timeout"
        except (OSError, RuntimeError, DCPException) as exc:
            stalled = stalled_collective(exc)
            if stalled is not None:  # the background write waited for a stopped peer
                raise stalled from exc
            error = CheckpointError(_write_failed(self.root, self.tmp, root_cause(exc)))
        late = [r for r, h in enumerate(_gather_to_all(hashed == "timeout")) if h]
        if late:
            raise CheckpointError(
                f"rank {rank}: checkpoint {self.path.name} is still being written on rank(s) "
                f"{late} after {timeout_s} s. It is still pending: call result() again (or "
                "wait_for_checkpoint()); it becomes visible only then."
            )
        if _PENDING is self:
            _PENDING = None
        try:
            _agree_or_clean(error, "writing the checkpoint", self.tmp)
            self._outcome = _finish(
                self.root, self.tmp, self.path, self._manifest, self._keep_last, hashed
            )
        except CheckpointError as exc:
            self._outcome = exc
            raise
        return self._outcome


def wait_for_checkpoint(timeout_s: float | None = None) -> Path | None:
    """Complete the asynchronous save in flight, if any: its path, or None when there is
    none. Collective (every rank calls it). `save_checkpoint` calls it first; call it at the
    end of training and before loading."""
    return None if _PENDING is None else _PENDING.result(timeout_s)


def _async_group() -> Any:
    """A gloo group beside the default one for DCP's background thread (see the module
    docstring for why); made once per default group, collectively."""
    global _ASYNC_GROUP
    if not dist.is_initialized():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _ASYNC_GROUP is None or _ASYNC_GROUP[0] is not default:
        timeout = timedelta(seconds=get_dist_info().timeout_s)
        _ASYNC_GROUP = (default, dist.new_group(backend="gloo", timeout=timeout))
    return _ASYNC_GROUP[1]


class _ReusedStager(AsyncStager):
    """DCP's staging (torch's `_create_cpu_state_dict` and `_copy_state_dict`, as its own
    stagers use) into one CPU copy reused from save to save. Safe to reuse because a save
    first completes the previous one, whose thread was the copy's only reader."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self.copy: dict[str, Any] | None = None
        self.layout: list[Any] = []

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        layout = _layout(state_dict)
        if self.copy is None or layout != self.layout:  # copy_ would broadcast a mismatch
            self.copy = None
            self.copy = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self.layout = layout
        # The returned dict holds the copy's tensors and the state's own non-tensor values.
        return dict(_copy_state_dict(state_dict, self.copy, type_check=False))

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.copy, self.layout = None, []


def _layout(value: Any, key: str = "") -> list[Any]:
    """(key, kind, shape, dtype) of every tensor in a nested state dict (a DTensor's local
    shard), and the key of everything else: equal layouts can share a staging copy."""
    if isinstance(value, dict):
        return [x for k in sorted(value, key=str) for x in _layout(value[k], f"{key}/{k}")]
    if isinstance(value, (list, tuple)):
        return [x for i, v in enumerate(value) for x in _layout(v, f"{key}/{i}")]
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return [(key, type(value).__name__, tuple(local.shape), local.dtype)]
    return [(key, type(value).__name__)]


def _start_async(
    root: Path,
    tmp: Path,
    final: Path,
    manifest: dict[str, Any],
    keep_last: int | None,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
) -> PendingCheckpoint:
    global _PENDING, _ASYNC_GROUP, _STAGER
    error: BaseException | None = None
    written: Any = None
    try:
        _STAGER = _STAGER or _ReusedStager()
        if not dist.is_initialized():  # DCP's thread warns after single_process_ok() ended
            warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        with single_process_ok():
            # The stager copies every tensor to CPU before this returns: the snapshot.
            written = dcp.async_save(
                {"model": model_sd, "optim": optim_sd["state"]},
                storage_writer=FileSystemWriter(
                    tmp / STATE_DIR, sync_files=True, per_thread_copy_ahead=0
                ),
                process_group=_async_group(),
                async_stager=_STAGER,
                no_dist=not dist.is_initialized(),
            )
    except (OSError, RuntimeError, DCPException) as exc:
        error = CheckpointError(_write_failed(root, tmp, root_cause(exc)))
        # Ranks whose save did start wait in the side group for this one: use a fresh one.
        _ASYNC_GROUP = None
    try:
        _agree_or_clean(error, "starting the asynchronous checkpoint", tmp)
    except CheckpointError:
        _ASYNC_GROUP = None
        raise
    upload = getattr(written, "upload_completion", written)  # an AsyncSaveResponse or a Future
    _PENDING = PendingCheckpoint(root, tmp, final, manifest, keep_last, upload)
    return _PENDING


def _abandon_pending() -> None:
    """At shutdown: a save nobody completed stays invisible (its temporary directory goes
    at the next save); let its thread finish with the group before the group is destroyed."""
    global _PENDING, _ASYNC_GROUP, _STAGER
    pending, _PENDING, _ASYNC_GROUP, _STAGER = _PENDING, None, None, None
    if pending is not None and pending._outcome is None:
        _log.warning(
            "shardwise checkpoint: %s was saved asynchronously but never completed "
            "(wait_for_checkpoint() was not called); it is not a checkpoint",
            pending.path,
        )
        with contextlib.suppress(Exception, DCPException):
            pending._hashed.result(timeout=get_dist_info().timeout_s)


_register_shutdown_hook(_abandon_pending)
