"""Saving a checkpoint: `save_checkpoint`, from an Engine or from a plain loop's own objects.

Owns: checking what is saved (no half-done accumulation window, a step for a plain loop),
writing each rank's RNG states and its tensors through torch.distributed.checkpoint into
the temporary directory, and handing over to commit.py (synchronous) or async_save.py
(`async_=True`). The package docstring (checkpoint/__init__.py) has the layout, the trust
rules and the directory rule.

Must not: make a checkpoint visible itself (commit.py does), or hand-write sharding or the
tensor format (DCP owns both).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from shardwise.checkpoint.adapters import (
    ADAPTERS,
    FULL,
    adapter_record,
    refuse_adapters_only,
    state_options,
    without_frozen,
)
from shardwise.checkpoint.async_save import (
    PendingCheckpoint,
    _start_async,
    wait_for_checkpoint,
)
from shardwise.checkpoint.commit import (
    _agree_or_clean,
    _finish,
    _hash_share,
    _prepare,
    _write_failed,
)
from shardwise.checkpoint.contents import (
    EngineState,
    _jsonable,
    _manifest,
    _rng_tensors,
    train_state,
)
from shardwise.checkpoint.layout import RNG_DIR, STATE_DIR, TMP_PREFIX, checkpoint_name
from shardwise.checkpoint.ranks import _agree, single_process_ok
from shardwise.checkpoint.trust import (
    CheckpointError,
    root_cause,
    stalled_collective,
)
from shardwise.distributed.process_group import (
    rank_and_world,
)
from shardwise.distributed.watchdog import guard

# --- helpers ---------------------------------------------------------------------------------


# --- RNG --------------------------------------------------------------------------------------


# --- listing ----------------------------------------------------------------------------------


# --- the directory rule ------------------------------------------------------------------------


# --- save ---------------------------------------------------------------------------------------


@overload
def save_checkpoint(
    directory: str | Path,
    model: nn.Module | EngineState,
    optimizer: torch.optim.Optimizer | None = ...,
    *,
    step: int | None = ...,
    scheduler: Stateful | None = ...,
    scaler: Stateful | None = ...,
    extra: Mapping[str, object] | None = ...,
    keep_last: int | None = ...,
    runner_state: Mapping[str, object] | None = ...,
    adapters_only: bool = ...,
    async_: Literal[False] = ...,
) -> Path: ...


@overload
def save_checkpoint(
    directory: str | Path,
    model: nn.Module | EngineState,
    optimizer: torch.optim.Optimizer | None = ...,
    *,
    step: int | None = ...,
    scheduler: Stateful | None = ...,
    scaler: Stateful | None = ...,
    extra: Mapping[str, object] | None = ...,
    keep_last: int | None = ...,
    runner_state: Mapping[str, object] | None = ...,
    adapters_only: bool = ...,
    async_: Literal[True],
) -> PendingCheckpoint: ...


@guard("save_checkpoint")  # a rank that stops inside is named (StallError)
def save_checkpoint(
    directory: str | Path,
    model: nn.Module | EngineState,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    extra: Mapping[str, object] | None = None,
    keep_last: int | None = None,
    runner_state: Mapping[str, object] | None = None,
    async_: bool = False,
    adapters_only: bool = False,
) -> Path | PendingCheckpoint:
    """Save a training state (model, optimizer, scheduler, scaler, counters, RNG) under
    `directory`, as ROOT/step_<step>.

    `model` is what `shardwise.wrap` returned, with the loop's own `optimizer` (None leaves
    it out), `step` (the optimizer steps done, required), and optionally `scheduler` and
    grad `scaler` (anything with state_dict/load_state_dict, such as torch's LRScheduler
    and GradScaler); or a shardwise `Engine`, which carries all of them.

    Every rank writes its own shards in parallel. The checkpoint is written to a
    temporary directory and renamed to ROOT/step_<step> only after every rank has
    finished; `latest` then points at it and, with `keep_last`, older complete checkpoints
    beyond that many are deleted. On failure the partial files are removed and nothing
    already saved is touched. Call it between optimizer steps (not mid-accumulation).

    What is already there: checkpoints with a step >= this one (a kill after a rename, a
    resume from an older checkpoint, an older run) are moved to ROOT/superseded/<UTC
    time>/ just before the rename, never deleted. Once the checkpoint is visible, rank 0
    prunes beyond `keep_last` and removes leftovers of killed saves and prunings while the
    other ranks go back to training (no rank waits for it in a collective). Each gets a log
    line (logger "shardwise.checkpoint").

    With `async_=True` the state is copied to CPU memory now and written by a background
    thread while training goes on; the call returns a `PendingCheckpoint`, and the
    checkpoint becomes visible (manifest, rename, `latest`) only in its
    `result()`, which every rank must call. The next `save_checkpoint` and
    `wait_for_checkpoint()` call it; call `wait_for_checkpoint()` before exiting, or the
    save is abandoned (its temporary directory is removed by the next save). The CPU copy
    (this rank's model and optimizer shards, pinned when CUDA is present) is kept for the
    next asynchronous save and released by `shardwise.shutdown()`: allocating it anew
    cost more than copying into it (0.25-1 s against 0.05 s for a 110M-parameter AdamW
    state on 2 CPU ranks), and the copy is the training stall.

    With `adapters_only=True` (a peft model: LoRA and peft's other methods) the checkpoint
    holds the parameters that train and their optimizer state, not the frozen base: every
    rank writes its own shards of them, as for a full checkpoint, and the manifest says it
    holds adapters only, which adapters, and a fingerprint of the base they need
    (`contents: "adapters"`, `adapters`). `load_checkpoint` fills the adapters and their
    optimizer state and leaves the base as it is. A model without adapters, or with nothing
    frozen, is refused (ValueError).
    """
    engine = train_state(model, optimizer, step, scheduler, scaler, "save_checkpoint")
    if engine.engine is None and step is None:
        raise TypeError(
            "save_checkpoint(directory, model, optimizer, step=...) needs step, the optimizer "
            "steps done so far: it names the checkpoint (ROOT/step_<step>) and is what "
            "load_checkpoint gives back."
        )
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
    if not isinstance(adapters_only, bool):
        raise TypeError(f"save_checkpoint(adapters_only={adapters_only!r}) must be True or False.")
    contents = ADAPTERS if adapters_only else FULL
    # Checked before any collective: every rank holds the same model, so all refuse alike.
    adapters = refuse_adapters_only(engine.model) if adapters_only else adapter_record(engine.model)
    extra = _jsonable(extra, "save_checkpoint(extra=...)") if extra is not None else None
    root = Path(directory)
    name = checkpoint_name(engine.step)
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"
    _agree(_prepare(root, tmp) if rank == 0 else None, "creating the checkpoint directory")

    model_sd, optim_sd = _state_dicts(engine.model, engine.optimizer, contents)
    # All but the tensors is taken now, so an asynchronous save holds this step's state.
    manifest = _manifest(engine, optim_sd, world, extra, runner_state)
    manifest.update(contents=contents, adapters=adapters)
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
        stalled = stalled_collective(exc)
        if stalled is not None:  # a peer stopped: the guard names it (no second timeout)
            raise stalled from exc
        error = CheckpointError(_write_failed(root, tmp, root_cause(exc)))
    _agree_or_clean(error, "writing the checkpoint", tmp)
    if async_:
        return _start_async(root, tmp, final, manifest, keep_last, model_sd, optim_sd)
    # Every rank hashes its share of the files (they are still in the page cache).
    return _finish(root, tmp, final, manifest, keep_last, _hash_share(tmp))


def _state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, contents: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's state dicts (this rank's shards) for a checkpoint of
    `contents`: all of them, or the trainable parameters' alone."""
    options = state_options(contents)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    else:
        model_sd, optim_sd = get_model_state_dict(model, options=options), {"state": {}}
    if contents == ADAPTERS:
        model_sd = without_frozen(model, model_sd)
    return model_sd, optim_sd


# --- asynchronous save ---------------------------------------------------------------------------


# --- load -----------------------------------------------------------------------------------------
