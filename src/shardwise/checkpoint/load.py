"""Loading a checkpoint into an engine, at any world size or strategy.

Owns: `load_checkpoint`: resolving and verifying the checkpoint, checking its keys and
shapes against the model, reading the tensors through DCP (resharded into this engine's
layout) with the trust checks of trust.py, and restoring optimizer hyperparameters,
scheduler, grad scaler, counters and, at the saving world size, RNG states.

Must not: write anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from shardwise.checkpoint.adapters import (
    ADAPTERS,
    FULL,
    check_adapter_checkpoint,
    loaded_all_adapters,
    state_options,
    without_frozen,
)
from shardwise.checkpoint.contents import EngineState, _restore_rng, train_state
from shardwise.checkpoint.layout import (
    RNG_DIR,
    STATE_DIR,
    read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from shardwise.checkpoint.ranks import _agree, single_process_ok
from shardwise.checkpoint.trust import (
    CheckpointError,
    SafeReader,
    TensorOnlyLoadPlanner,
    read_dcp_metadata,
    root_cause,
    stalled_collective,
)
from shardwise.distributed.process_group import (
    rank_and_world,
)
from shardwise.distributed.watchdog import guard
from shardwise.parallelize.pipeline import tied_aliases
from shardwise.parallelize.wrapped import unwrap, wrap_info


def _check_keys(
    model_sd: dict[str, Any], metadata: Metadata, where: Path, *, stage: bool = False
) -> None:
    """Every key of the model in the checkpoint with its shape, and (for a whole model) no
    key the model lacks. A pipeline stage holds only its part: the checkpoint's other keys
    are the other stages'."""
    saved = {
        k.removeprefix("model."): md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.")
    }
    missing = sorted(set(model_sd) - set(saved))
    unexpected = [] if stage else sorted(set(saved) - set(model_sd))
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


@guard("load_checkpoint")  # a rank that stops inside is named (StallError)
def load_checkpoint(
    directory: str | Path,
    model: nn.Module | EngineState,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Stateful | None = None,
    scaler: Stateful | None = None,
    verify: bool = True,
    load_optimizer: bool = True,
) -> dict[str, Any]:
    """Restore a training state from a checkpoint (a checkpoint directory, a root, or
    ROOT/latest) into `model` (what `shardwise.wrap` returned) and the loop's `optimizer`,
    `scheduler` and grad `scaler` when given, or into a shardwise `Engine`, whose counters
    are set too. The manifest's `step` is the step to continue from.

    Works at any world size and strategy: DCP reshards model and optimizer tensors into
    this engine's layout. RNG states are restored when the world size matches the one
    that saved. With `verify`, every file's size and SHA-256 are checked first (each rank
    hashes its share of the files).
    An adapters-only checkpoint (`save_checkpoint(..., adapters_only=True)`) fills the
    model's adapters and their optimizer state and leaves its base as it is; it is refused
    (CheckpointError) unless the model has the same adapters on the same base.
    Returns the manifest (counters, runner position, `extra`): JSON read from the
    checkpoint, so its values are of any JSON type (typed Any).
    """
    engine = train_state(model, optimizer, None, scheduler, scaler, "load_checkpoint")
    load_optimizer = load_optimizer and engine.optimizer is not None
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
        if load_optimizer and manifest.get("optimizer") is None:
            raise CheckpointError(
                f"checkpoint {path} holds no optimizer state (it was saved with "
                "optimizer=None). Load the model alone: load_checkpoint(..., optimizer=None)."
            )
        if load_optimizer and manifest["optimizer"]["class"] != type(engine.optimizer).__name__:
            raise CheckpointError(
                f"checkpoint {path} holds {manifest['optimizer']['class']} state but the engine "
                f"uses {type(engine.optimizer).__name__}. Use the same optimizer class, or "
                "load_checkpoint(..., load_optimizer=False) for the model alone."
            )
        contents = manifest.get("contents", FULL)
        if contents == ADAPTERS:
            check_adapter_checkpoint(manifest, engine.model, path)
        options = state_options(contents)
        metadata = read_dcp_metadata(path / STATE_DIR)
        if load_optimizer and engine.optimizer is not None:
            model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=options)
        else:
            model_sd, optim_sd = get_model_state_dict(engine.model, options=options), {}
        if contents == ADAPTERS:
            model_sd = without_frozen(engine.model, model_sd)
        info = wrap_info(engine.model)
        _check_keys(model_sd, metadata, path, stage=info is not None and info.stages is not None)
    except CheckpointError as exc:
        error = exc
    _agree(error, "checking the checkpoint")

    state: dict[str, Any] = {"model": model_sd}
    # The last pipeline stage's copy of a tied parameter reads the optimizer state a whole
    # model saved under the first stage's name (both copies hold the same state).
    aliases = tied_aliases(unwrap(engine.model)) if load_optimizer else {}
    if load_optimizer:
        held = cast(dict[str, Any], optim_sd["state"])
        state["optim"] = {aliases.get(k, k): v for k, v in held.items()}
    try:
        with single_process_ok():
            dcp.load(
                state,
                storage_reader=SafeReader(path / STATE_DIR),
                planner=TensorOnlyLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
    except (RuntimeError, ValueError, KeyError, DCPException) as exc:
        stalled = stalled_collective(exc)
        if stalled is not None:  # a peer stopped: the guard names it
            raise stalled from exc
        raise CheckpointError(f"could not read checkpoint {path}: {root_cause(exc)}") from None
    if load_optimizer and engine.optimizer is not None:
        back = {first: last for last, first in aliases.items()}
        optim_state = {
            "state": {back.get(k, k): v for k, v in state["optim"].items()},
            "param_groups": manifest["optimizer"]["param_groups"],
        }
        result = set_state_dict(
            engine.model,
            engine.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=optim_state,
            options=options,
        )
    else:
        result = set_model_state_dict(engine.model, state["model"], options=options)
    if contents == ADAPTERS:
        loaded_all_adapters(engine.model, list(result.missing_keys), path)
    if load_optimizer and engine.scheduler is not None and manifest.get("scheduler") is not None:
        engine.scheduler.load_state_dict(manifest["scheduler"])
    if load_optimizer and engine.scaler is not None and manifest.get("grad_scaler") is not None:
        engine.scaler.load_state_dict(manifest["grad_scaler"])
    if engine.engine is not None:
        engine.engine.step = int(manifest["step"])
        engine.engine.skipped_steps = int(manifest.get("skipped_steps", 0))
        engine.engine.micro_step = 0
    rng_file = path / RNG_DIR / f"rank_{rank}.safetensors"
    manifest["rng_restored"] = manifest["world_size"] == world and rng_file.is_file()
    if manifest["rng_restored"]:
        _restore_rng(load_file(str(rng_file)))
    return manifest
