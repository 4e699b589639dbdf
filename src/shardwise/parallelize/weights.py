"""Safetensors weights into a (possibly sharded) model: `load_weights`.

Owns: finding the weight files (`model.safetensors`, or the shards an index names, each
inside the index's own directory), matching their names against the model's (tied names
included), and filling each rank's local shards, each rank reading its own slices or rank 0
reading and sending (`broadcast_from_rank0`). Export, the other direction, is
checkpoint/export.py, which shares these names.

Must not: unpickle anything, or write files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from shardwise.distributed.process_group import rank_and_world
from shardwise.parallelize.wrapped import unwrap

SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


class WeightsError(ValueError):
    """Weights could not be exported or loaded; the message lists what did not match."""


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict under its own FQNs (no wrapper prefixes), DTensors if sharded."""
    return cast(dict[str, torch.Tensor], get_model_state_dict(model))


def _weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, for a file, a directory or an index."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).is_file():
            path = path / SINGLE_FILE
        else:
            raise WeightsError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}.")
    if not path.is_file():
        raise WeightsError(f"weights path {path} does not exist.")
    if path.name.endswith(".index.json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            items = list(weight_map.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(
                f"{path} is not a safetensors index (JSON with a weight_map object): {exc!r}."
            ) from None
        checked: dict[str, Path] = {}  # thousands of tensors share a few files
        for name, file in items:
            if not isinstance(file, str) or file not in checked:
                checked[file] = _inside(path, name, file)
        return {name: checked[file] for name, file in items}
    with safe_open(str(path), framework="pt") as f:
        return {name: path for name in f.keys()}


def _inside(index: Path, tensor: str, file: Any) -> Path:
    """`file` from an index's weight_map, refused unless it lies in the index's directory:
    the entries are opened as they are, so `../..` or `/etc/...` would be read."""
    base = index.parent.resolve()
    if not isinstance(file, str) or file in ("", "."):
        why = "which is not a file name"
    elif os.path.isabs(file) or PurePosixPath(file).is_absolute():
        why = "an absolute path"
    elif ".." in PurePosixPath(file).parts:
        why = "a path with '..'"
    elif not (base / file).resolve().is_relative_to(base):
        why = "a path that resolves outside that directory (through a link)"
    elif not (index.parent / file).is_file():
        why = "which is not in that directory (an incomplete copy or export?)"
    else:
        return index.parent / file
    raise WeightsError(
        f"{index}: weight_map[{tensor!r}] names {file!r}, {why}. An index may only name "
        f"files in its own directory ({index.parent}); nothing was loaded."
    )


def _local_slice(value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, global offset) of this rank's part of a DTensor; None for a plain tensor."""
    if not isinstance(value, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return tuple(shape), tuple(offset)


def _tied_names(model: nn.Module) -> dict[str, set[str]]:
    """name -> the other names of the same parameter (tied weights), from the module tree,
    so every rank gets the same answer whatever its shards hold."""
    groups: dict[int, set[str]] = {}
    for name, p in unwrap(model).named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name.replace("_orig_mod.", ""))
    return {n: group - {n} for group in groups.values() if len(group) > 1 for n in group}


def _match(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    files: dict[str, Path],
    path: str | Path,
    strict: bool,
) -> tuple[list[str], list[str], list[str]]:
    """(missing, unexpected, names to load); raises WeightsError listing every mismatch.

    Only file headers are read here. The loaders open a file once per tensor: safetensors
    maps the file, and every page read through a long-lived handle stays in the process's
    resident memory until the handle closes (a whole model's worth, on a rank that reads
    it all). Closing after each tensor keeps it to one tensor.
    """
    tied, present = _tied_names(model), set(files)
    # A tied parameter saved under one of its names (as Hugging Face saves them) is complete.
    missing = sorted(n for n in set(state) - present if not tied.get(n, set()) & present)
    unexpected = sorted(present - set(state))
    names = sorted(set(state) & present)
    mismatched = []
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, in_file in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in in_file:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(state[name].shape):
                    mismatched.append(f"{name}: file {shape} vs model {tuple(state[name].shape)}")
    if mismatched or (strict and (missing or unexpected)):
        raise WeightsError(
            f"weights in {path} do not match {type(model).__name__}. Missing: {missing[:20]}. "
            f"Unexpected: {unexpected[:20]}. Shape mismatches: {mismatched[:20]}."
        )
    return missing, unexpected, names


def load_weights(
    model: nn.Module,
    path: str | Path,
    *,
    strict: bool = True,
    broadcast_from_rank0: bool = False,
) -> dict[str, list[str]]:
    """Fill `model` (wrapped or not) from safetensors written by `export_weights` (or any
    file with the same names).

    By default each rank reads only the slices its shards own (every rank needs the path).
    With `broadcast_from_rank0=True` only rank 0 opens `path` (the other ranks' `path` is
    ignored, so the weights may live on rank 0's disk alone): it reads one tensor at a time
    and torch's `distribute_tensor` scatters each shard (or `broadcast` sends each
    replicated tensor) to the ranks that own it. Either way no rank holds more than one
    full tensor beyond its own shards. Without a process group (or at world size 1) the
    two modes are the same.

    Raises `WeightsError` listing missing and unexpected names and shape mismatches
    (with `strict=False`, missing/unexpected are returned instead; shapes must match).
    Under `broadcast_from_rank0`, every rank raises rank 0's error.
    """
    if broadcast_from_rank0 and rank_and_world()[1] > 1:
        return _load_from_rank0(model, path, strict)
    files = _weight_files(path)
    state = _model_state(model)
    missing, unexpected, names = _match(model, state, files, path, strict)
    with torch.no_grad():
        for name in names:
            target = state[name]
            piece = _local_slice(target)
            with safe_open(str(files[name]), framework="pt") as f:  # see _match
                if piece is None:
                    target.copy_(f.get_tensor(name).to(target.dtype))
                    continue
                shape, offset = piece
                index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
                local = cast(DTensor, target).to_local()
                if local.numel():
                    local.copy_(f.get_slice(name)[index].to(local.dtype))
    return {"missing": missing, "unexpected": unexpected}


def _load_from_rank0(model: nn.Module, path: str | Path, strict: bool) -> dict[str, list[str]]:
    """Rank 0 reads and checks; every rank learns the verdict before any tensor moves, so a
    bad file raises the same error everywhere instead of leaving ranks waiting."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    rank, _ = rank_and_world()
    state = _model_state(model)
    files: dict[str, Path] = {}
    verdict: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            files = _weight_files(path)
            verdict[0] = _match(model, state, files, path, strict)
        except Exception as exc:  # sent to every rank, then raised everywhere
            failure = exc
            verdict[0] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(verdict, src=0)  # bounded by the process group's timeout
    if isinstance(verdict[0], str):
        if failure is not None:
            raise failure
        raise WeightsError(f"rank 0 could not load the weights: {verdict[0]}")
    missing, unexpected, names = verdict[0]
    with torch.no_grad():
        for name in names:
            target = state[name]
            if rank == 0:
                with safe_open(str(files[name]), framework="pt") as f:  # see _match
                    full = f.get_tensor(name).to(device=target.device, dtype=target.dtype)
            else:  # a NaN placeholder: a send that never arrived cannot pass unseen
                full = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                if full.is_floating_point():
                    full.fill_(float("nan"))
            if isinstance(target, DTensor):
                shard = distribute_tensor(
                    full, target.device_mesh, target.placements, src_data_rank=0
                )
                target.to_local().copy_(shard.to_local())
            else:
                dist.broadcast(full, src=0)
                target.copy_(full)
            del full
    return {"missing": missing, "unexpected": unexpected}
