"""Reading a checkpoint's model tensors without a model: for exports from a directory.

Owns: the model entries of a checkpoint (names and shapes, from DCP's metadata) and reading
chosen ones into fresh CPU tensors, group by group, in DCP loads of about `max_bytes` each,
through trust.py's reader and planner (nothing is unpickled).

Must not: write anything, or load more than one batch of tensors at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardwise.checkpoint.layout import STATE_DIR
from shardwise.checkpoint.ranks import single_process_ok
from shardwise.checkpoint.trust import (
    CheckpointError,
    SafeReader,
    TensorOnlyLoadPlanner,
    root_cause,
)


def model_entries(checkpoint: Path) -> dict[str, TensorStorageMetadata]:
    """The checkpoint's model tensors (names as the model's state dict has them) and their
    metadata, in the order they were saved."""
    metadata = SafeReader(checkpoint / STATE_DIR).read_metadata()
    return {
        key.removeprefix("model."): md
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }


def read_groups(
    checkpoint: Path, groups: list[list[str]], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Each group of model tensors (by name) read from `checkpoint`, in order. Groups are
    read together until they reach `max_bytes` (a larger group alone), so a group's tensors
    (a base weight and its LoRA factors) always arrive together."""
    entries = model_entries(checkpoint)
    missing = sorted({k for g in groups for k in g} - set(entries))
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint} holds no tensor named {missing[:5]}.")
    batch: dict[str, torch.Tensor] = {}
    waiting: list[list[str]] = []
    size = 0
    for i, group in enumerate(groups):
        for key in group:
            md = entries[key]
            batch[f"model.{key}"] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            size += batch[f"model.{key}"].nbytes
        waiting.append(group)
        if size >= max_bytes or i == len(groups) - 1:
            _load(checkpoint, batch)
            for done in waiting:
                yield {k: batch[f"model.{k}"] for k in done}
            batch, waiting, size = {}, [], 0


def _load(checkpoint: Path, batch: dict[str, torch.Tensor]) -> None:
    try:
        with single_process_ok():
            dcp.load(
                batch,
                storage_reader=SafeReader(checkpoint / STATE_DIR),
                planner=TensorOnlyLoadPlanner(),
                no_dist=True,
            )
    # DCP's own exception is a BaseException: unwrapped, it escapes the CLI's handler.
    except (RuntimeError, ValueError, KeyError, DCPException) as exc:
        raise CheckpointError(
            f"could not read checkpoint {checkpoint}: {root_cause(exc)}"
        ) from None
