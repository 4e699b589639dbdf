"""Consolidated weights: export to safetensors, and load safetensors into a wrapped model.

Owns: `export_weights` (from a live, possibly sharded model, or from a checkpoint
directory) and `load_weights`. Files use the model's own parameter names, with no `module.`
or `_orig_mod.` prefixes, in Hugging Face's layout: `model.safetensors`, or numbered shards
plus `model.safetensors.index.json` above `max_shard_bytes`. One tensor is gathered at a
time, onto CPU, so no rank's accelerator ever holds the whole model.

A model with a Hugging Face config (`model.config.save_pretrained`) also gets its
config.json (and generation_config.json), so `from_pretrained` opens the export; that is
duck-typed, and transformers is never imported here. A checkpoint is verified against its
manifest's SHA-256 hashes before any tensor is read, as `load_checkpoint` does.

Exporting again into the same directory replaces the previous export: the new files are
written into a hidden staging directory inside `out`, then the old export's files are moved
out of the way and the new ones in, entry file (model.safetensors or the index) last, so
`out` never holds an index naming files of another export. Files no export writes are
never touched: an `out` holding any is refused. `load_weights` reads only files inside the
index's own directory (a `weight_map` entry that is absolute, has `..` or leads out through a
link is refused).

Must not: invent a format (safetensors is the format) or unpickle anything.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from shardwise.distributed import rank_and_world

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
STAGING_PREFIX = ".shardwise-export-"
_WEIGHT_FILE = re.compile(
    r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
    r"|\.part-\d{5}\.safetensors"  # a part left by an export killed before this layout
)
_CONFIG_FILES = ("config.json", "generation_config.json")


class WeightsError(ValueError):
    """Weights could not be exported or loaded; the message lists what did not match."""


def _checked_checkpoint(directory: str | Path, out: Path, verify: bool) -> Path:
    """The checkpoint `directory` names, resolved once (a later save may move `latest`, and
    the checkpoint read must be the one verified), refused before `out` is touched if its
    files differ from its manifest.

    Corruption is found by the same check `load_checkpoint` runs, so the two cannot
    disagree about what an intact checkpoint is (and `shardwise checkpoint verify` is it).
    """
    from shardwise.checkpoint import CheckpointError, resolve_checkpoint, verify_checkpoint

    path = resolve_checkpoint(directory)
    problems = verify_checkpoint(path) if verify else []
    if problems:
        raise CheckpointError(
            f"checkpoint {path} failed verification ({len(problems)} problem(s)): "
            f"{'; '.join(problems[:5])}. Nothing was written to {out}. Export an intact "
            "checkpoint (`shardwise checkpoint ls` lists them), or pass verify=False "
            "(--no-verify) to export the bytes as they are."
        )
    return path


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict under its own FQNs (no wrapper prefixes), DTensors if sharded."""
    return cast(dict[str, torch.Tensor], get_model_state_dict(model))


def _model_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU tensor) per state_dict entry; all ranks must iterate together."""
    for name, value in _model_state(model).items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        yield name, value.detach().to("cpu", copy=True)


def _checkpoint_tensors(
    directory: str | Path, max_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the model entries of a shardwise checkpoint, read in batches."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException as DCPException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from shardwise.checkpoint import STATE_DIR, resolve_checkpoint, single_process_ok
    from shardwise.dcp_safe import CheckpointError, SafeReader, TensorOnlyLoadPlanner, root_cause

    path = resolve_checkpoint(directory)
    state_dir = path / STATE_DIR
    metadata = SafeReader(state_dir).read_metadata()
    entries = [
        (key, md)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    ]
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for i, (key, md) in enumerate(entries):
        tensor = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        batch[key] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= max_bytes or i == len(entries) - 1:
            try:
                with single_process_ok():
                    dcp.load(
                        batch,
                        storage_reader=SafeReader(state_dir),
                        planner=TensorOnlyLoadPlanner(),
                        no_dist=True,
                    )
            # DCP's own exception is a BaseException: unwrapped, it escapes the CLI's handler.
            except (RuntimeError, ValueError, KeyError, DCPException) as exc:
                raise CheckpointError(
                    f"could not read checkpoint {path}: {root_cause(exc)}"
                ) from None
            for k, t in batch.items():
                yield k.removeprefix("model."), t
            batch, size = {}, 0


class _ShardWriter:
    """Buffers tensors and writes safetensors files of at most `max_bytes` each."""

    def __init__(self, out: Path, max_bytes: int, dtype: torch.dtype | None) -> None:
        self.out, self.max_bytes, self.dtype = out, max_bytes, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        # Tied weights arrive as the same storage; safetensors needs each entry on its own.
        self.pending[name] = tensor.contiguous().clone()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def discard(self) -> None:
        """Remove what was written, so a failed export leaves no half of one behind."""
        for path, _ in self.files:
            path.unlink(missing_ok=True)
        self.files, self.pending = [], {}

    def close(self) -> Path:
        self.flush()
        if len(self.files) == 1:
            final = self.out / SINGLE_FILE
            os.replace(self.files[0][0], final)
            return final
        n = len(self.files)
        weight_map = {}
        for i, (path, names) in enumerate(self.files):
            target = self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, target)
            weight_map.update({name: target.name for name in names})
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2))
        return self.out / INDEX_FILE


def _original_class_name(model: nn.Module) -> str:
    """The model's own class name: fully_shard swaps in a generated `FSDP<Name>` subclass."""
    from torch.distributed.fsdp import FSDPModule

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper around the model
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def _save_hf_configs(model: nn.Module, out: Path) -> None:
    """config.json (and generation_config.json) of a Hugging Face model, without which
    `from_pretrained(out)` cannot know what model the weights belong to.

    Duck-typed, so transformers is never imported: anything with `save_pretrained` is saved
    by it. Like transformers' own `save_pretrained`, `architectures` names the model class
    (tools such as vLLM pick the class from it); it is set on a copy, not the user's config.
    """
    config: Any = getattr(model, "config", None)
    if callable(getattr(config, "save_pretrained", None)):
        config = copy.copy(config)
        if hasattr(config, "architectures"):
            config.architectures = [_original_class_name(model)]
        config.save_pretrained(out)
    generation: Any = getattr(model, "generation_config", None)  # None if it cannot generate
    if callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(out)


def _write_all(
    tensors: Iterator[tuple[str, torch.Tensor]], writer: _ShardWriter, writes: bool
) -> Path | None:
    """Drain `tensors` on every rank (a model's gathers are collectives); only the writing
    rank keeps them. A failure midway removes the files already written."""
    try:
        for name, tensor in tensors:
            if writes:
                writer.add(name, tensor)
        return writer.close() if writes else None
    except BaseException:
        writer.discard()
        raise


def export_weights(
    source: nn.Module | str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verify: bool = True,
) -> Path | None:
    """Write `source`'s weights as consolidated safetensors into the directory `out`.

    `source` is a model (wrapped or not; with a process group every rank must call, and
    rank 0 writes) or a shardwise checkpoint directory (read without a process group).
    Returns the written file (model.safetensors or the index) on the writing rank, None
    on others. `dtype` casts floating-point tensors (e.g. "bf16").

    A Hugging Face model (its `config` has `save_pretrained`) also gets config.json, and
    generation_config.json when it has a generation config, so `from_pretrained(out)`
    opens the export. A checkpoint directory holds no model object, hence no config: write
    it yourself with `model.config.save_pretrained(out)`.

    From a checkpoint, `verify` (as in `load_checkpoint`) first checks every file's size
    and SHA-256 against the manifest; on a mismatch it raises `CheckpointError` naming the
    file, and nothing is written to `out`. A read that fails midway removes what it wrote.
    """
    from shardwise.precision import parse_dtype
    from shardwise.strategies import unwrap

    cast = parse_dtype(dtype, "export_weights(dtype)")
    if max_shard_bytes < 1:
        raise ValueError(f"export_weights(max_shard_bytes={max_shard_bytes}) must be positive.")
    out = Path(out)
    writes = rank_and_world()[0] == 0
    if isinstance(source, nn.Module):
        staging = _prepare_out_on_rank0(out)  # every rank learns rank 0's verdict first
        tensors: Iterator[tuple[str, torch.Tensor]] = _model_tensors(source)
    else:
        if not writes:
            return None
        # Before `out` is created: a corrupted checkpoint leaves nothing there.
        tensors = _checkpoint_tensors(_checked_checkpoint(source, out, verify), max_shard_bytes)
        staging = _prepare_out_on_rank0(out)
    try:
        writer = _ShardWriter(staging or out, max_shard_bytes, cast)
        written = _write_all(tensors, writer, writes)
        if staging is None or written is None:
            return None
        if isinstance(source, nn.Module):
            _save_hf_configs(unwrap(source), staging)
        return _swap_in(staging, out, written)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _previous_export(out: Path) -> list[Path]:
    """The files of an earlier export in `out`. Anything else there is refused: an export
    replaces its own files only, so a user's file is never overwritten or deleted."""
    found, foreign = [], []
    for p in sorted(out.iterdir()):
        if p.name.startswith(STAGING_PREFIX) and p.is_dir() and not p.is_symlink():
            continue  # a killed export's staging directory: removed by _prepare_out_on_rank0
        if p.is_file() and (_WEIGHT_FILE.fullmatch(p.name) or p.name in _CONFIG_FILES):
            found.append(p)
        else:
            foreign.append(p.name)
    if foreign:
        raise WeightsError(
            f"export_weights(out={str(out)!r}) holds {foreign[:10]}, which no export writes. "
            "An export replaces an earlier export in the same directory but never touches "
            "other files: export into a new or empty directory, or move those files away."
        )
    return found


def _swap_in(staging: Path, out: Path, written: Path) -> Path:
    """Replace the earlier export in `out` by the files in `staging`.

    The old entry file (model.safetensors or the index) goes first and the new one comes
    last, so at every moment `out` holds one export's entry with that export's files, or
    no entry at all (a kill in between: loading fails loudly and the next export cleans
    up). Config files the new export does not write (a checkpoint's export has none) are
    left as they are: that is where the user's own config.json goes.
    """
    new = sorted(p.name for p in staging.iterdir())
    old = [p for p in _previous_export(out) if _WEIGHT_FILE.fullmatch(p.name) or p.name in new]
    aside = staging / ".previous"
    aside.mkdir()
    for p in sorted(old, key=lambda p: p.name not in (SINGLE_FILE, INDEX_FILE)):
        os.replace(p, aside / p.name)
    for name in sorted(new, key=lambda n: n == written.name):
        os.replace(staging / name, out / name)
    return out / written.name


def _prepare_out_on_rank0(out: Path) -> Path | None:
    """Rank 0 creates `out` and a staging directory in it (returned; None on other ranks);
    with a process group every rank gets its verdict, so a bad `out` fails on every rank
    instead of leaving the others in the first gather."""
    import torch.distributed as dist

    rank, world = rank_and_world()
    failure: Exception | None = None
    staging = None
    if rank == 0:
        try:
            if out.exists() and not out.is_dir():
                raise WeightsError(
                    f"export_weights(out={str(out)!r}) must be a directory, not a file."
                )
            out.mkdir(parents=True, exist_ok=True)
            _previous_export(out)
            for leftover in out.glob(f"{STAGING_PREFIX}*"):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)  # an export that was killed
            staging = out / f"{STAGING_PREFIX}{os.getpid()}"
            staging.mkdir()
        except (OSError, WeightsError) as exc:
            failure = exc
    if world > 1 and dist.is_initialized():
        verdict = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(verdict, src=0)  # bounded by the process group's timeout
        if rank != 0 and verdict[0] is not None:
            raise WeightsError(f"rank 0 could not prepare the export directory: {verdict[0]}")
    if failure is not None:
        raise failure
    return staging


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
    from shardwise.strategies import unwrap

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
