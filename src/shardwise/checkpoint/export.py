"""Consolidated weights: export to safetensors, from a live model or a checkpoint.

Owns: `export_weights` (from a live, possibly sharded model, or from a checkpoint
directory). Files use the model's own parameter names, with no `module.` or `_orig_mod.`
prefixes, in Hugging Face's layout: `model.safetensors`, or numbered shards plus
`model.safetensors.index.json` above `max_shard_bytes`. One tensor is gathered at a time,
onto CPU, so no rank's accelerator ever holds the whole model. Loading, the other
direction, is parallelize/weights.py (`load_weights`).

A model with a Hugging Face config (`model.config.save_pretrained`) also gets its
config.json (and generation_config.json), so `from_pretrained` opens the export; that is
duck-typed, and transformers is never imported here. A checkpoint is verified against its
manifest's SHA-256 hashes before any tensor is read, as `load_checkpoint` does.

A first export is written into a hidden staging directory beside `out` and renamed to
`out` when complete, so a failed export (a full disk: the error names the path, the bytes
needed and the space free) leaves no `out` behind. Rank 0 holds at most one file's worth of
tensors (`max_shard_bytes`, or one larger tensor) at a time: tensors are gathered one by one
and each file is written as soon as the next tensor would take it over the bound.

Exporting again into the same directory replaces the previous export: the new files are
written into a hidden staging directory inside `out`, then the old export's files are moved
out of the way and the new ones in, entry file (model.safetensors or the index) last, so
`out` never holds an index naming files of another export. Files no export writes are
never touched: an `out` holding any is refused.

An adapter model (peft) exports in peft's own format by default (`kind="adapter"`:
adapter_model.safetensors and adapter_config.json), or as merged weights in the base
model's names (`kind="merged"`); adapter_export.py streams their tensors, and this module
writes them like any other export.

Must not: invent a format (safetensors is the format) or unpickle anything.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.checkpoint.adapter_export import (
    checkpoint_adapter_tensors,
    checkpoint_merged_tensors,
    live_adapter_tensors,
    live_merged_tensors,
)
from shardwise.checkpoint.adapters import adapter_config, adapter_record, original_class
from shardwise.checkpoint.layout import (
    read_manifest,
    resolve_checkpoint,
    verify_checkpoint,
)
from shardwise.checkpoint.reading import model_entries, read_groups
from shardwise.checkpoint.trust import CheckpointError
from shardwise.config.precision import parse_dtype
from shardwise.distributed.process_group import rank_and_world
from shardwise.distributed.watchdog import guard
from shardwise.parallelize.weights import INDEX_FILE, SINGLE_FILE, WeightsError, _model_state
from shardwise.parallelize.wrapped import unwrap, wrap_info
from shardwise.plan.adapters import adapter_model
from shardwise.plan.quantized import quantized_layers

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
STAGING_PREFIX = ".shardwise-export-"
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_WEIGHT_FILE = re.compile(
    r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json"
    r"|\.part-\d{5}\.safetensors"  # a part left by an export killed before this layout
    # An adapter's config goes with its weights: left behind a merged export, it would make
    # from_pretrained load the adapter on top of the merged model.
    r"|adapter_model\.safetensors|adapter_config\.json"
)
ExportKind = Literal["auto", "full", "adapter", "merged"]
EXPORT_KINDS: tuple[str, ...] = get_args(ExportKind)
_CONFIG_FILES = ("config.json", "generation_config.json")


def _checked_checkpoint(directory: str | Path, out: Path, verify: bool) -> Path:
    """The checkpoint `directory` names, resolved once (a later save may move `latest`, and
    the checkpoint read must be the one verified), refused before `out` is touched if its
    files differ from its manifest.

    Corruption is found by the same check `load_checkpoint` runs, so the two cannot
    disagree about what an intact checkpoint is (and `shardwise checkpoint verify` is it).
    """

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


def _model_tensors(
    model: nn.Module, keep: bool, make_room: Callable[[torch.Tensor], None] | None = None
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full CPU tensor) per state_dict entry, one at a time; all ranks must iterate
    together (the gathers are collectives). Only the rank that writes (`keep`) keeps each
    gathered tensor; the others yield None and free it at once. No copy is made beyond the
    gather itself (and the move to host memory from an accelerator): an unsharded CPU
    parameter is written from its own storage. `make_room(value)` runs before each gather
    on the writing rank (the writer writes its file first when the tensor would not fit)."""
    for name, value in _model_state(model).items():
        if keep and make_room is not None:
            make_room(value)
        if isinstance(value, DTensor):
            value = value.full_tensor()  # new memory on every rank
        yield name, value.detach().cpu() if keep else None
        del value


def _checkpoint_tensors(
    directory: str | Path, max_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for the model entries of a shardwise checkpoint, read in batches."""
    path = resolve_checkpoint(directory)
    for group in read_groups(path, [[k] for k in model_entries(path)], max_bytes):
        yield from group.items()


class _ShardWriter:
    """Buffers tensors and writes safetensors files of at most `max_bytes` each."""

    def __init__(
        self, out: Path, max_bytes: int, dtype: torch.dtype | None, entry: str = SINGLE_FILE
    ) -> None:
        self.out, self.max_bytes, self.dtype, self.entry = out, max_bytes, dtype, entry
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def make_room(self, tensor: torch.Tensor) -> None:
        """Write the current file now if `tensor` (before its gather: its full shape) would
        take it over `max_bytes`, so the file's tensors are freed before the gather."""
        dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
        nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue `tensor` for the current file, writing that file first when `tensor` would
        take it over `max_bytes`: at most one file's worth (or one tensor larger than
        that) is held at a time."""
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self.flush()
        tensor = tensor.contiguous()
        # Tied weights arrive as one storage; safetensors needs each entry on its own.
        storage = tensor.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() == storage for t in self.pending.values()):
            tensor = tensor.clone()
        self.pending[name] = tensor
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        _readable(path)
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
            final = self.out / self.entry
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
            config.architectures = [original_class(model).__name__]
        config.save_pretrained(out)
    generation: Any = getattr(model, "generation_config", None)  # None if it cannot generate
    if callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(out)


def _write_all(
    tensors: Iterator[tuple[str, torch.Tensor | None]], writer: _ShardWriter, writes: bool
) -> Path | None:
    """Drain `tensors` on every rank (a model's gathers are collectives); only the writing
    rank keeps them. A failure midway removes the files already written."""
    try:
        for name, tensor in tensors:
            if writes and tensor is not None:
                writer.add(name, tensor)
        return writer.close() if writes else None
    except BaseException:
        writer.discard()
        raise


@guard("export_weights")  # a rank that stops inside is named (StallError)
def _refuse_quantized(model: nn.Module, kind: str) -> None:
    """A bitsandbytes-quantized base exports as packed codes without their quant_state
    (it lives on the layer, not in a parameter): no loader could reopen it."""
    layers = quantized_layers(model)
    if kind != "adapter" and layers:
        raise NotImplementedError(
            f"export_weights(kind={kind!r}): {len(layers)} layer(s) of the model are "
            f"quantized by bitsandbytes (e.g. {layers[0]}), and their weights would be written "
            "as packed codes without the quant_state that decodes them, which from_pretrained "
            "cannot reopen. Export the adapters (kind='adapter', the default for a peft "
            "model), or merge them into a dequantized base in one process."
        )


def _refuse_pipeline_stage(model: nn.Module) -> None:
    """A pipelined model holds one stage per rank: exporting it live would write rank 0's
    stage alone. Its checkpoint holds every stage."""
    info = wrap_info(model)
    if info is not None and info.stages is not None:
        raise NotImplementedError(
            f"export_weights of a model wrapped with ParallelConfig.pp={info.stages.degree} is not "
            "built yet: each rank holds one stage, so rank 0 would write its own stage alone. "
            "Save a checkpoint and export that in one process (after shardwise.shutdown(), "
            "or `shardwise checkpoint export DIR --out OUT`): export_weights(checkpoint_dir, "
            "out) reads every stage's tensors."
        )


def export_weights(
    source: nn.Module | str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    verify: bool = True,
    kind: ExportKind = "auto",
) -> Path | None:
    """Write `source`'s weights as consolidated safetensors into the directory `out`.

    `source` is a model (wrapped or not; with a process group every rank must call, and
    rank 0 writes) or a shardwise checkpoint directory (read without a process group).
    Returns the written file (model.safetensors, the index, or adapter_model.safetensors)
    on the writing rank, None on others. `dtype` casts floating-point tensors (e.g. "bf16").

    A Hugging Face model (its `config` has `save_pretrained`) also gets config.json, and
    generation_config.json when it has a generation config, so `from_pretrained(out)`
    opens the export. A checkpoint directory holds no model object, hence no config: write
    it yourself with `model.config.save_pretrained(out)`.

    `kind` says what is written. "full": every tensor of the model under its own names.
    "adapter" (a peft model, or a checkpoint of one): peft's own format,
    adapter_model.safetensors (the trainable tensors under peft's names) and
    adapter_config.json, which `PeftModel.from_pretrained(base, out)` opens. "merged" (a
    LoRA model, or a full checkpoint of one): the base model's tensors in its own names,
    each LoRA layer's weight with W + scale * B @ A merged in, plus the base's config.json,
    which `from_pretrained(out)` opens; other methods, DoRA and non-Linear LoRA raise
    NotImplementedError naming what. "auto": "adapter" for an adapter model, else "full".

    From a checkpoint, `verify` (as in `load_checkpoint`) first checks every file's size
    and SHA-256 against the manifest; on a mismatch it raises `CheckpointError` naming the
    file, and nothing is written to `out`. A read that fails midway removes what it wrote.
    """

    cast = parse_dtype(dtype, "export_weights(dtype)")
    if max_shard_bytes < 1:
        raise ValueError(f"export_weights(max_shard_bytes={max_shard_bytes}) must be positive.")
    if kind not in EXPORT_KINDS:
        raise ValueError(
            f"export_weights(kind={kind!r}) is not one of {list(EXPORT_KINDS)}: 'adapter' "
            "(peft's format), 'merged' (LoRA merged into the base), 'full' (every tensor), "
            "or 'auto' ('adapter' for an adapter model, else 'full')."
        )
    out = Path(out)
    writes = rank_and_world()[0] == 0
    if isinstance(source, nn.Module):
        _refuse_pipeline_stage(source)
        record = adapter_record(source)  # the same on every rank: they all take one path
        chosen = _resolved_kind(kind, record, "the model")
        _refuse_quantized(source, chosen)
        writer = _writer(out, max_shard_bytes, cast, chosen)
        tensors: Iterator[tuple[str, torch.Tensor | None]]
        # A refusal (what a merge cannot do) comes here, before `out` is touched.
        if chosen == "adapter" and record is not None:
            tensors = live_adapter_tensors(source, record, writes)
        elif chosen == "merged" and record is not None:
            tensors = live_merged_tensors(source, record, writes, writer.make_room)
        else:
            tensors = _model_tensors(source, writes, writer.make_room)
        staging = _prepare_out_on_rank0(out)  # every rank learns rank 0's verdict first
        writer.out = staging or out
    else:
        if not writes:
            return None
        # Before `out` is created: a corrupted checkpoint leaves nothing there.
        path = _checked_checkpoint(source, out, verify)
        manifest = read_manifest(path)
        record = manifest.get("adapters")
        chosen = _resolved_kind(kind, record, f"checkpoint {path}")
        if chosen == "adapter" and record is not None:
            tensors = checkpoint_adapter_tensors(path, record, max_shard_bytes)
        elif chosen == "merged":
            tensors = checkpoint_merged_tensors(path, manifest, max_shard_bytes)
        else:
            tensors = _checkpoint_tensors(path, max_shard_bytes)
        staging = _prepare_out_on_rank0(out)
        writer = _writer(staging or out, max_shard_bytes, cast, chosen)
    try:
        try:
            written = _write_all(tensors, writer, writes)
            if staging is None or written is None:
                return None
            _write_configs(source, record, chosen, staging)
            return _swap_in(staging, out, written)
        except (OSError, SafetensorError) as exc:
            needed = _needed_bytes(source, cast, record if chosen == "adapter" else None)
            raise WeightsError(_write_failed(out, exc, needed)) from exc
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _resolved_kind(kind: str, record: dict[str, Any] | None, what: str) -> str:
    if kind == "auto":
        return "adapter" if record is not None else "full"
    if kind in ("adapter", "merged") and record is None:
        raise ValueError(
            f"export_weights(kind={kind!r}): {what} has no adapters (not a peft model, or a "
            f"checkpoint saved before shardwise recorded adapters). kind={kind!r} exports a "
            "peft model's adapters; use kind='full' (or 'auto') for this one."
        )
    return kind


def _writer(out: Path, max_bytes: int, cast: torch.dtype | None, kind: str) -> _ShardWriter:
    if kind == "adapter":  # peft reads one adapter_model.safetensors
        return _ShardWriter(out, 2**63 - 1, cast, entry=ADAPTER_FILE)
    return _ShardWriter(out, max_bytes, cast)


def _write_configs(
    source: nn.Module | str | Path, record: dict[str, Any] | None, kind: str, staging: Path
) -> None:
    """adapter_config.json beside an adapter; a live model's Hugging Face configs: the base
    model's for a merged export (the model it now is), the model's own for a full one."""
    if kind == "adapter" and record is not None:
        (staging / ADAPTER_CONFIG).write_text(adapter_config(record))
        return
    if not isinstance(source, nn.Module):
        return
    found = adapter_model(unwrap(source)) if kind == "merged" else None
    _save_hf_configs(found.base if found is not None else unwrap(source), staging)


def _needed_bytes(
    source: nn.Module | str | Path, cast: torch.dtype | None, record: dict[str, Any] | None
) -> int:
    """The bytes an export of `source` writes (tensor data; headers are small); with an
    adapter `record`, of its trainable tensors alone."""

    def size(numel: int, dtype: torch.dtype) -> int:
        dtype = cast if cast is not None and dtype.is_floating_point else dtype
        return numel * dtype.itemsize

    only = set(record["trainable"]) if record is not None else None
    if isinstance(source, nn.Module):
        state = _model_state(source)
        return sum(size(v.numel(), v.dtype) for k, v in state.items() if not only or k in only)
    entries = model_entries(resolve_checkpoint(source))
    return sum(
        size(math.prod(md.size), md.properties.dtype)
        for k, md in entries.items()
        if not only or k in only
    )


def _write_failed(out: Path, exc: BaseException, needed: int) -> str:
    try:
        free = f"{shutil.disk_usage(out if out.exists() else out.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return (
        f"export_weights could not write to {out}: {exc}. The export needs about "
        f"{needed:,} bytes ({free} there). Nothing was left behind: an earlier export in "
        f"{out} is intact, and a new {out} was not created. Free space, or export "
        "elsewhere (or with dtype='bf16', half the size)."
    )


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
    if not out.exists():  # a first export: the whole directory appears at once
        os.replace(staging, out)
        return out / written.name
    new = sorted(p.name for p in staging.iterdir())
    old = [p for p in _previous_export(out) if _WEIGHT_FILE.fullmatch(p.name) or p.name in new]
    aside = staging / ".previous"
    aside.mkdir()
    for p in sorted(old, key=lambda p: p.name not in (SINGLE_FILE, INDEX_FILE, ADAPTER_FILE)):
        os.replace(p, aside / p.name)
    for name in sorted(new, key=lambda n: n == written.name):
        os.replace(staging / name, out / name)
    return out / written.name


def _prepare_out_on_rank0(out: Path) -> Path | None:
    """Rank 0 makes the staging directory (returned; None on other ranks): inside `out` for
    a re-export, beside it for a first one (renamed to `out` when complete, so a failed
    export leaves no partial `out`);
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
            if out.exists():  # a re-export: staged inside, swapped in file by file
                _previous_export(out)
                leftovers = list(out.glob(f"{STAGING_PREFIX}*"))
                staging = out / f"{STAGING_PREFIX}{os.getpid()}"
            else:  # staged beside `out` and renamed to it when complete
                out.parent.mkdir(parents=True, exist_ok=True)
                leftovers = list(out.parent.glob(f"{STAGING_PREFIX}{out.name}-*"))
                staging = out.parent / f"{STAGING_PREFIX}{out.name}-{os.getpid()}"
            for leftover in leftovers:
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover)  # an export that was killed
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


def _readable(path: Path) -> None:
    """The mode an ordinary file gets under this process's umask: safetensors writes its
    files 0600, so an export shared with colleagues or a serving job was unreadable."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
