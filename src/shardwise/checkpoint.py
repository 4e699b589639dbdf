"""Checkpoints: sharded, atomic, exact to resume, loadable at any world size or strategy.

Owns: `save_checkpoint`/`load_checkpoint` (every rank writes and reads its own part
through torch.distributed.checkpoint), the checkpoint directory layout, the manifest,
`latest`, pruning, and the rule that a checkpoint is visible only once complete.

Layout of ROOT/step_00000100/:
    state/        DCP files: model and optimizer tensors only (resharded on load)
    rng/          rank_<r>.safetensors: each rank's RNG states
    shardwise.json  the manifest: counters, configs, optimizer hyperparameters, scheduler
                  and grad-scaler state, runner position, versions, SHA-256 of every file
ROOT/latest       name of the newest complete checkpoint

Safety: nothing here unpickles with code execution. Only tensors go through DCP (so its
byte-object path, torch.load(weights_only=False), is never used, and a load planner
refuses it), DCP's pickled `.metadata` is read with an allow-list unpickler, RNG states are
safetensors, and everything else is JSON.

Paths stay inside: DCP's `.metadata` names, per stored chunk, the file that holds it
(`relative_path`); an entry that is absolute, contains `..` or resolves (through a link)
outside the checkpoint's state/ directory is refused before anything is read.

The directory rule (what a save does to what is already under ROOT):
- A save at step N supersedes every checkpoint under ROOT with a step >= N: they are
  moved, never deleted, to ROOT/superseded/<UTC time>/ (one log line each) just before the
  new one is renamed into place. So `latest`, `keep_last` and the newest-complete fallback
  always see one linear history, whether the step existed because a kill came between the
  rename and the `latest` update, because training resumed from an older checkpoint, or
  because the directory holds an older run. `set_aside_newer(root, step)` applies the same
  rule right after resuming, before any save.
- Leftovers of killed saves and prunings (`.tmp-step_*`, `.deleting-step_*`, and `step_*`
  without a manifest) are removed by rank 0 at the next save, one log line each. Pruning
  renames a directory to `.deleting-step_*` before removing it, so a half-deleted one is
  never mistaken for a checkpoint.

Asynchronous saves (`save_checkpoint(..., async_=True)`) use DCP's `async_save`: the state
is copied to CPU memory during the call (later steps cannot leak into it), files are
written by a background thread, and the manifest, rename, `latest` and pruning happen in
`PendingCheckpoint.result()`, which every rank calls (the next save, and
`wait_for_checkpoint()`, call it). The background thread's collectives run on a separate
gloo group: on the default group they interleave with training's own collectives, and gloo
aborts the process ("Received data size doesn't match expected size", measured at torch
2.13); DCP also requires a CPU backend for async saves, which a NCCL job lacks.

Must not: hand-write sharding or the tensor format (DCP owns both).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import random
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardwise.dcp_safe import (
    CheckpointError,
    SafeReader,
    TensorOnlyLoadPlanner,
    read_dcp_metadata,
    root_cause,
)
from shardwise.distributed import _register_shutdown_hook, get_dist_info, rank_and_world

MANIFEST = "shardwise.json"
LATEST = "latest"
STATE_DIR = "state"
RNG_DIR = "rng"
TMP_PREFIX = ".tmp-"
DELETING_PREFIX = ".deleting-"
SUPERSEDED = "superseded"
FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1


_log = logging.getLogger("shardwise.checkpoint")


# --- helpers ---------------------------------------------------------------------------------


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
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag)
        failed = int(flag.item())
    else:
        failed = int(error is not None)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{what} failed on {failed} other rank(s); see their errors.")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _listing(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def _files(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    return {
        n: {"size": (directory / n).stat().st_size, "sha256": _sha256(directory / n)} for n in names
    }


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonable(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, default=_json_default))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} cannot be stored as JSON: {exc}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if callable(value):
        return getattr(value, "__qualname__", repr(value))
    return repr(value)


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None or not dataclasses.is_dataclass(config):
        return {}
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return dict(_jsonable(fields, f"{type(config).__name__}"))


# --- RNG --------------------------------------------------------------------------------------


def _rng_tensors() -> dict[str, torch.Tensor]:
    version, state, gauss = random.getstate()
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "torch": torch.get_rng_state(),
        "python_state": torch.tensor(state, dtype=torch.int64),
        "python_meta": torch.tensor([version, gauss is not None, 0], dtype=torch.float64),
        "python_gauss": torch.tensor([gauss or 0.0], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_meta": torch.tensor([np_pos, np_has_gauss, np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _restore_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    meta = t["python_meta"].tolist()
    gauss = float(t["python_gauss"][0]) if meta[1] else None
    random.setstate((int(meta[0]), tuple(int(x) for x in t["python_state"].tolist()), gauss))
    pos, has_gauss, cached = t["numpy_meta"].tolist()
    np.random.set_state(
        ("MT19937", t["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), cached)
    )
    if "cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["cuda"])


# --- listing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    complete: bool
    size_bytes: int


def list_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Checkpoints under `root`, oldest first, incomplete ones (temporary) included."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory of checkpoints.")
    found = []
    for p in root.iterdir():
        name = p.name.removeprefix(TMP_PREFIX)
        if not p.is_dir() or not name.startswith("step_") or not name[5:].isdigit():
            continue
        complete = not p.name.startswith(TMP_PREFIX) and (p / MANIFEST).is_file()
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        found.append(CheckpointInfo(p, int(name[5:]), complete, size))
    return sorted(found, key=lambda c: (c.step, c.complete))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself, from a root (its `latest`), or ROOT/latest."""
    path = Path(path)
    if path.name == LATEST and path.is_file():
        path = path.parent
    if (path / MANIFEST).is_file():
        return path
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist.")
    latest = path / LATEST
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / MANIFEST).is_file():
            return target
    complete = [c for c in list_checkpoints(path) if c.complete]
    if complete:
        return complete[-1].path
    raise CheckpointError(
        f"{path} holds no complete checkpoint (no {MANIFEST}; incomplete saves are ignored)."
    )


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    path = resolve_checkpoint(checkpoint) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path} is unreadable or not JSON ({exc}): the checkpoint is corrupted."
        ) from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a shardwise checkpoint manifest.")
    return dict(manifest)


def verify_checkpoint(checkpoint: str | Path, *, shared: bool = False) -> list[str]:
    """Problems found (empty when every file is present with its recorded size and hash).

    With `shared=True` (every rank must call it) each rank hashes 1/world of the files
    and every rank gets the whole list of problems.
    """
    directory = resolve_checkpoint(checkpoint)
    manifest = read_manifest(directory)
    names = sorted(manifest["files"])
    problems = []
    for rel in _my_share(names) if shared else names:
        want, p = manifest["files"][rel], directory / rel
        try:
            if not p.is_file():
                problems.append(f"{rel}: missing")
            elif p.stat().st_size != want["size"]:
                problems.append(f"{rel}: size {p.stat().st_size} != recorded {want['size']}")
            elif _sha256(p) != want["sha256"]:
                problems.append(f"{rel}: content differs from the recorded SHA-256 (corrupted)")
        except OSError as exc:
            problems.append(f"{rel}: unreadable ({exc})")
    if not shared or rank_and_world()[0] == 0:
        extra = set(_listing(directory)) - set(manifest["files"])
        problems.extend(
            f"{rel}: not part of the checkpoint (unexpected file)" for rel in sorted(extra)
        )
        try:
            read_dcp_metadata(directory / STATE_DIR)
        except CheckpointError as exc:
            problems.append(str(exc))
    if shared:
        problems = sorted(p for share in _gather_to_all(problems) for p in share)
    return problems


# --- the directory rule ------------------------------------------------------------------------


def _step_of(name: str) -> int | None:
    """N for a directory named step_N (digits only), else None."""
    digits = name.removeprefix("step_")
    return int(digits) if name.startswith("step_") and digits.isdigit() else None


def _superseded_dir(root: Path) -> Path:
    """A new, empty ROOT/superseded/<UTC time>/ (suffixed if two sets land in one instant)."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    candidate, n = root / SUPERSEDED / stamp, 1
    while True:
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            n += 1
            candidate = root / SUPERSEDED / f"{stamp}-{n}"


def _move_aside(root: Path, dirs: list[Path], why: str) -> list[Path]:
    """Move `dirs` into one new ROOT/superseded/<time>/, a log line each; never deletes."""
    if not dirs:
        return []
    into = _superseded_dir(root)
    moved = []
    for d in sorted(dirs):
        os.rename(d, into / d.name)
        _log.warning("shardwise checkpoint: moved %s aside to %s (%s)", d, into / d.name, why)
        moved.append(into / d.name)
    return moved


def _checkpoint_dirs(root: Path, newer_than: int) -> list[Path]:
    """ROOT/step_N directories (complete or not) with N > `newer_than`."""
    steps = {p: _step_of(p.name) for p in root.iterdir() if p.is_dir() and not p.is_symlink()}
    return [p for p, step in steps.items() if step is not None and step > newer_than]


def _remove_leftovers(root: Path, keep: Path) -> None:
    """Rank 0, at a save: remove what killed saves and prunings left behind. `keep` (this
    save's target, moved aside if it exists) and a save still in flight are left alone."""
    busy = {keep} | ({_PENDING.tmp} if _PENDING is not None else set())
    for p in sorted(root.iterdir()):
        if p in busy or not p.is_dir() or p.is_symlink():
            continue
        if p.name.startswith(TMP_PREFIX) and _step_of(p.name[len(TMP_PREFIX) :]) is not None:
            why = "the temporary directory of a save that did not finish"
        elif p.name.startswith(DELETING_PREFIX):
            why = "a checkpoint whose pruning did not finish"
        elif _step_of(p.name) is not None and not (p / MANIFEST).is_file():
            why = f"an incomplete checkpoint (no {MANIFEST}: a save or pruning was killed)"
        else:
            continue
        shutil.rmtree(p, ignore_errors=True)
        _log.warning("shardwise checkpoint: removed %s, %s", p, why)


def _prune(path: Path) -> None:
    """Delete an old checkpoint; renamed first, so a kill midway leaves `.deleting-step_*`
    (removed at the next save), never a `step_*` directory that lost part of its files."""
    doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
    try:
        os.rename(path, doomed)
    except OSError as exc:
        _log.warning("shardwise checkpoint: could not prune %s (%s); it was kept", path, exc)
        return
    shutil.rmtree(doomed, ignore_errors=True)


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


def set_aside_newer(root: str | Path, step: int) -> list[Path]:
    """Move every checkpoint under `root` with a step > `step` to ROOT/superseded/<UTC
    time>/ (never deleted; a log line each) and point `latest` at the newest complete
    checkpoint left. Returns where they went (the same list on every rank).

    Call it right after resuming from a checkpoint that may not be the newest (every rank
    calls; rank 0 moves, the others wait within the process group's timeout): without it
    a restart before the next save would resume from the abandoned newer checkpoint, and
    `keep_last` would prune the resumed run's own checkpoints first. A save applies the
    same rule to steps >= its own.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"set_aside_newer(step={step!r}) must be a step number (an int >= 0).")
    root = Path(root)

    def work() -> list[Path]:
        if not root.is_dir():
            return []
        moved = _move_aside(
            root,
            _checkpoint_dirs(root, step),
            f"newer than step {step}, which training resumed from",
        )
        if moved:
            complete = [c for c in list_checkpoints(root) if c.complete]
            if complete:
                _write_atomic(root / LATEST, complete[-1].path.name + "\n")
            else:
                (root / LATEST).unlink(missing_ok=True)
        return moved

    return list(_on_rank0(work, f"set aside the checkpoints newer than step {step} in {root}"))


# --- save ---------------------------------------------------------------------------------------

_PENDING: PendingCheckpoint | None = None  # the asynchronous save in flight in this process
_ASYNC_GROUP: tuple[Any, Any] | None = None  # (default group, its gloo sibling for DCP's thread)
_STAGER: _ReusedStager | None = None  # the CPU copy that asynchronous saves write from


@overload
def save_checkpoint(
    directory: str | Path,
    engine: Any,
    *,
    extra: dict[str, Any] | None = ...,
    keep_last: int | None = ...,
    runner_state: dict[str, Any] | None = ...,
    async_: Literal[False] = ...,
) -> Path: ...


@overload
def save_checkpoint(
    directory: str | Path,
    engine: Any,
    *,
    extra: dict[str, Any] | None = ...,
    keep_last: int | None = ...,
    runner_state: dict[str, Any] | None = ...,
    async_: Literal[True],
) -> PendingCheckpoint: ...


def save_checkpoint(
    directory: str | Path,
    engine: Any,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    runner_state: dict[str, Any] | None = None,
    async_: bool = False,
) -> Path | PendingCheckpoint:
    """Save `engine` (model, optimizer, scheduler, scaler, counters, RNG) under `directory`.

    Every rank writes its own shards in parallel. The checkpoint is written to a
    temporary directory and renamed to ROOT/step_<step> only after every rank has
    finished; `latest` then points at it and, with `keep_last`, older complete checkpoints
    beyond that many are deleted. On failure the partial files are removed and nothing
    already saved is touched. Call it between optimizer steps (not mid-accumulation).

    What is already there: checkpoints with a step >= this one (a kill after a rename, a
    resume from an older checkpoint, an older run) are moved to ROOT/superseded/<UTC
    time>/ just before the rename, never deleted; leftovers of killed saves and prunings
    are removed first. Each gets a log line (logger "shardwise.checkpoint").

    With `async_=True` the state is copied to CPU memory now and written by a background
    thread while training goes on; the call returns a `PendingCheckpoint`, and the
    checkpoint becomes visible (manifest, rename, `latest`, pruning) only in its
    `result()`, which every rank must call. The next `save_checkpoint` and
    `wait_for_checkpoint()` call it; call `wait_for_checkpoint()` before exiting, or the
    save is abandoned (its temporary directory is removed by the next save). The CPU copy
    (this rank's model and optimizer shards, pinned when CUDA is present) is kept for the
    next asynchronous save and released by `shardwise.shutdown()`: allocating it anew
    cost more than copying into it (0.25-1 s against 0.05 s for a 110M-parameter AdamW
    state on 2 CPU ranks), and the copy is the training stall.
    """
    wait_for_checkpoint()  # the previous asynchronous save becomes visible first
    rank, world = rank_and_world()
    if engine.micro_step != 0:
        raise CheckpointError(
            f"save_checkpoint: the engine is {engine.micro_step} micro-batch(es) into an "
            "accumulation window; their gradients are not part of any state and would be lost. "
            "Save right after an optimizer step."
        )
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"save_checkpoint(keep_last={keep_last!r}) must be a positive int or None."
        )
    if not isinstance(async_, bool):
        raise TypeError(f"save_checkpoint(async_={async_!r}) must be True or False.")
    extra = _jsonable(extra, "save_checkpoint(extra=...)") if extra is not None else None
    root = Path(directory)
    name = checkpoint_name(engine.step)
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"
    _agree(_prepare(root, tmp, final) if rank == 0 else None, "creating the checkpoint directory")

    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    # All but the tensors is taken now, so an asynchronous save holds this step's state.
    manifest = _manifest(engine, optim_sd, world, extra, runner_state)
    error: BaseException | None = None
    try:
        save_file(_rng_tensors(), str(tmp / RNG_DIR / f"rank_{rank}.safetensors"))
        if not async_:
            with single_process_ok():
                dcp.save(
                    {"model": model_sd, "optim": optim_sd["state"]},
                    storage_writer=FileSystemWriter(tmp / STATE_DIR, sync_files=True),
                    no_dist=not dist.is_initialized(),
                )
    except (OSError, RuntimeError, DCPException, SafetensorError) as exc:
        error = CheckpointError(_write_failed(root, tmp, root_cause(exc)))
    _agree_or_clean(error, "writing the checkpoint", tmp)
    if async_:
        return _start_async(root, tmp, final, manifest, keep_last, model_sd, optim_sd)
    # Every rank hashes its share of the files (they are still in the page cache).
    return _finish(root, tmp, final, manifest, keep_last, _hash_share(tmp))


def _prepare(root: Path, tmp: Path, final: Path) -> BaseException | None:
    """Rank 0: the root, without leftovers, and an empty temporary directory."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root, keep=final)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / STATE_DIR).mkdir(parents=True)
        (tmp / RNG_DIR).mkdir()
    except OSError as exc:
        return CheckpointError(
            f"cannot create the checkpoint directory {tmp}: {exc}. Nothing was written; "
            f"checkpoints already under {root} are intact."
        )
    return None


def _agree_or_clean(error: BaseException | None, what: str, tmp: Path) -> None:
    try:
        _agree(error, what)
    except CheckpointError:
        if rank_and_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _hash_share(tmp: Path) -> dict[str, Any] | str:
    """This rank's share of the files, hashed; or what went wrong, to report on rank 0."""
    try:
        return _files(tmp, _my_share(_listing(tmp)))
    except OSError as exc:
        return f"rank {rank_and_world()[0]}: {exc}"


def _finish(
    root: Path,
    tmp: Path,
    final: Path,
    manifest: dict[str, Any],
    keep_last: int | None,
    hashed: dict[str, Any] | str,
) -> Path:
    """Every rank, after all wrote: rank 0 gets the hashes and makes the checkpoint visible."""
    shares = _gather_to_all(hashed)
    error = None
    if rank_and_world()[0] == 0:
        try:
            failures = [h for h in shares if isinstance(h, str)]
            if failures:
                raise OSError(f"hashing the written files failed: {'; '.join(failures)}")
            files: dict[str, Any] = {}
            for share in shares:
                files.update(share)
            _finalize(root, tmp, final, manifest, keep_last, files)
        except (OSError, CheckpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = CheckpointError(_write_failed(root, tmp, exc))
    _agree(error, "finalising the checkpoint")
    return final


def _write_failed(root: Path, tmp: Path, exc: BaseException | str) -> str:
    latest = root / LATEST
    kept = latest.read_text().strip() if latest.is_file() else "none yet"
    try:
        # Libraries report a full disk in their own words; the free space says it plainly.
        free = f" Free space on that filesystem: {shutil.disk_usage(root).free:,} bytes."
    except OSError:
        free = ""
    return (
        f"could not write checkpoint {tmp.name.removeprefix(TMP_PREFIX)} under {root}: {exc}. "
        f"The partial files were removed; earlier checkpoints are intact (latest: {kept}).{free}"
    )


def _manifest(
    engine: Any, optim_sd: dict[str, Any], world: int, extra: Any, runner_state: Any
) -> dict[str, Any]:
    from shardwise import __version__

    info = getattr(engine, "config", None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": engine.step,
        "skipped_steps": engine.skipped_steps,
        "world_size": world,
        "strategy": getattr(info, "strategy", None),
        "parallel_config": _config_dict(info),
        "train_config": _config_dict(getattr(engine, "train_config", None)),
        "optimizer": {
            "class": type(engine.optimizer).__name__,
            "param_groups": _jsonable(optim_sd["param_groups"], "optimizer param_groups"),
        },
        "scheduler": _jsonable(engine.scheduler.state_dict(), "scheduler state")
        if engine.scheduler is not None
        else None,
        "grad_scaler": _jsonable(engine.scaler.state_dict(), "grad scaler state")
        if engine.scaler is not None
        else None,
        "runner": _jsonable(runner_state, "runner state") if runner_state is not None else None,
        "extra": extra,
        "versions": {
            "shardwise": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _finalize(
    root: Path,
    tmp: Path,
    final: Path,
    manifest: dict[str, Any],
    keep_last: int | None,
    files: dict[str, Any],
) -> None:
    """Rank 0, after every rank wrote and hashed: manifest, rename, `latest`, prune."""
    # A file that no rank listed (a slow shared filesystem) is hashed here.
    files.update(_files(tmp, [n for n in _listing(tmp) if n not in files]))
    manifest["files"] = dict(sorted(files.items()))
    manifest["bytes"] = sum(f["size"] for f in manifest["files"].values())
    _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2))
    step = int(manifest["step"])
    _move_aside(root, _checkpoint_dirs(root, step - 1), f"superseded by the save at step {step}")
    os.rename(tmp, final)  # the moment the checkpoint becomes visible
    _write_atomic(root / LATEST, final.name + "\n")
    if keep_last is not None:
        complete = [c for c in list_checkpoints(root) if c.complete and c.path != final]
        for old in complete[: max(0, len(complete) - (keep_last - 1))]:
            _prune(old.path)


# --- asynchronous save ---------------------------------------------------------------------------


class PendingCheckpoint:
    """A checkpoint being written in the background (`save_checkpoint(..., async_=True)`).

    DCP's thread writes a CPU copy of the state taken during the call, then this rank
    hashes its share of the files, still in the background. Nothing is visible until
    `result()`: a process killed before then leaves only ROOT/.tmp-step_N, which the next
    save removes.
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


# --- load -----------------------------------------------------------------------------------------


def _check_keys(model_sd: dict[str, Any], metadata: Metadata, where: Path) -> None:
    saved = {
        k.removeprefix("model."): md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.")
    }
    missing = sorted(set(model_sd) - set(saved))
    unexpected = sorted(set(saved) - set(model_sd))
    mismatched = []
    for key in sorted(set(model_sd) & set(saved)):
        md = saved[key]
        want = tuple(model_sd[key].shape) if isinstance(model_sd[key], torch.Tensor) else None
        if isinstance(md, TensorStorageMetadata) and want is not None and tuple(md.size) != want:
            mismatched.append(f"{key}: checkpoint {tuple(md.size)} vs model {want}")
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"the checkpoint {where} was saved from a different model. "
            f"Missing from the checkpoint: {missing[:20]}. Unexpected in the checkpoint: "
            f"{unexpected[:20]}. Shape mismatches: {mismatched[:20]}."
        )


def load_checkpoint(
    directory: str | Path,
    engine: Any,
    *,
    verify: bool = True,
    load_optimizer: bool = True,
) -> dict[str, Any]:
    """Restore `engine` from a checkpoint (a checkpoint directory, a root, or ROOT/latest).

    Works at any world size and strategy: DCP reshards model and optimizer tensors into
    this engine's layout. RNG states are restored when the world size matches the one
    that saved. With `verify`, every file's size and SHA-256 are checked first (each rank
    hashes its share of the files).
    Returns the manifest (counters, runner position, `extra`).
    """
    rank, world = rank_and_world()
    error: BaseException | None = None
    path = Path(directory)
    manifest: dict[str, Any] = {}
    try:
        path = resolve_checkpoint(directory)
        manifest = read_manifest(path)
    except CheckpointError as exc:
        error = exc
    _agree(error, "reading the checkpoint manifest")
    if verify:
        problems = verify_checkpoint(path, shared=True)  # the same list on every rank
        if problems:
            raise CheckpointError(
                f"checkpoint {path} failed verification ({len(problems)} problem(s)): "
                f"{'; '.join(problems[:5])}. It was not loaded."
            )
    try:
        if load_optimizer and manifest["optimizer"]["class"] != type(engine.optimizer).__name__:
            raise CheckpointError(
                f"checkpoint {path} holds {manifest['optimizer']['class']} state but the engine "
                f"uses {type(engine.optimizer).__name__}. Use the same optimizer class, or "
                "load_checkpoint(..., load_optimizer=False) for the model alone."
            )
        metadata = read_dcp_metadata(path / STATE_DIR)
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        _check_keys(model_sd, metadata, path)
    except CheckpointError as exc:
        error = exc
    _agree(error, "checking the checkpoint")

    state: dict[str, Any] = {"model": model_sd}
    if load_optimizer:
        state["optim"] = optim_sd["state"]
    try:
        with single_process_ok():
            dcp.load(
                state,
                storage_reader=SafeReader(path / STATE_DIR),
                planner=TensorOnlyLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
    except (RuntimeError, ValueError, KeyError, DCPException) as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {root_cause(exc)}") from None
    if load_optimizer:
        optim_state = {
            "state": state["optim"],
            "param_groups": manifest["optimizer"]["param_groups"],
        }
        set_state_dict(
            engine.model,
            engine.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=optim_state,
        )
    else:
        set_model_state_dict(engine.model, state["model"])
    if load_optimizer and engine.scheduler is not None and manifest.get("scheduler") is not None:
        engine.scheduler.load_state_dict(manifest["scheduler"])
    if load_optimizer and engine.scaler is not None and manifest.get("grad_scaler") is not None:
        engine.scaler.load_state_dict(manifest["grad_scaler"])
    engine.step = int(manifest["step"])
    engine.skipped_steps = int(manifest.get("skipped_steps", 0))
    engine.micro_step = 0
    rng_file = path / RNG_DIR / f"rank_{rank}.safetensors"
    manifest["rng_restored"] = manifest["world_size"] == world and rng_file.is_file()
    if manifest["rng_restored"]:
        _restore_rng(load_file(str(rng_file)))
    return manifest
