"""Reading torch.distributed.checkpoint (DCP) directories without trusting them.

Owns: `read_dcp_metadata` (DCP's pickled `.metadata` through an allow-list unpickler, and
every storage entry checked to name a file inside the directory), `SafeReader` (DCP's
FileSystemReader using it), `TensorOnlyLoadPlanner` (refuses pickled entries) and
`root_cause` (the per-rank errors inside DCP's CheckpointException). Used by shardwise's
checkpoints, weight export and the Lightning strategy's DCP checkpoints.

Must not: write anything, or read a file outside the checkpoint directory.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path, PurePosixPath
from typing import Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardwise.distributed.watchdog import is_comm_failure

__all__ = [
    "CheckpointError",
    "SafeReader",
    "TensorOnlyLoadPlanner",
    "check_manifest",
    "outside_reason",
    "read_dcp_metadata",
    "root_cause",
    "stalled_collective",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what is intact."""


_DCP_METADATA_CLASSES = {
    "Metadata",
    "ChunkStorageMetadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any other global (os.system, builtins.eval...) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch.distributed.checkpoint.metadata" and name in _DCP_METADATA_CLASSES)
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (
                module == "torch"
                and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))
            )
            or (module == "torch.serialization" and name == "_get_layout")
            or (
                module == "pathlib"
                and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
            )
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"refused to load global {module}.{name}: a checkpoint's metadata may only "
                "reference torch.distributed.checkpoint's metadata classes"
            )
        return super().find_class(module, name)


def read_dcp_metadata(state_dir: str | Path) -> Metadata:
    """DCP's `.metadata` for `state_dir`, unpickled through the allow-list."""
    path = Path(state_dir) / ".metadata"
    try:
        with path.open("rb") as f:
            metadata = _AllowListUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete shardwise checkpoint.") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"{path} is not a valid checkpoint metadata file and was not loaded ({exc}). The "
            "checkpoint is corrupted or was tampered with."
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} does not hold DCP metadata (found {type(metadata).__name__})."
        )
    _check_storage_paths(metadata, path)
    return metadata


def _check_storage_paths(metadata: Metadata, path: Path) -> None:
    """Refuse a `.metadata` whose entries name files outside its own directory: DCP's reader
    opens `directory / relative_path` as it is, so an absolute path or `..` would make a
    load read any file the process can (into a parameter, or into an export)."""
    base = path.parent.resolve()
    checked: set[str] = set()
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        fqn = getattr(index, "fqn", index)
        if not isinstance(rel, (str, os.PathLike)):
            raise CheckpointError(
                f"{path}: the storage entry for {fqn!r} names no file ({rel!r}). The "
                "checkpoint is corrupted or was tampered with and was not loaded."
            )
        name = os.fspath(rel)
        if name in checked:
            continue
        why = outside_reason(name, base)
        if why is None:
            checked.add(name)
            continue
        raise CheckpointError(
            f"{path}: the storage entry for {fqn!r} names {name!r}, {why}. A checkpoint may "
            f"only read files inside {path.parent}; it was not loaded (the checkpoint is "
            "corrupted or was tampered with)."
        )


def outside_reason(name: str, base: Path) -> str | None:
    """Why the relative path `name` does not stay inside the directory `base`, or None."""
    if os.path.isabs(name) or PurePosixPath(name).is_absolute():
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a path with '..'"
    if name in ("", ".") or not (base / name).resolve().is_relative_to(base.resolve()):
        return "a path that resolves outside that directory (through a link)"
    return None


_SHA256_HEX = frozenset("0123456789abcdef")


def _expect(ok: bool, path: Path, field: str, value: Any, expected: str) -> None:
    if not ok:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise CheckpointError(
            f"{path}: field {field} is {type(value).__name__} {shown}, expected {expected}. "
            "The manifest is corrupted or was edited; the checkpoint was not used."
        )


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_manifest(manifest: Any, path: Path) -> dict[str, Any]:
    """`manifest` (parsed from `path`) when every field readers use has its type, every file
    entry is a size and a SHA-256, and every file name stays inside the checkpoint
    directory; otherwise a CheckpointError naming the file, the field and what was
    expected (never a raw TypeError or KeyError later, in verify or in resume)."""
    _expect(isinstance(manifest, dict), path, "(the top level)", manifest, "an object")
    for key, low in (("step", 0), ("world_size", 1)):
        _expect(key in manifest, path, key, None, "present")
        _expect(_is_int(manifest[key], low), path, key, manifest[key], f"an integer >= {low}")
    for key in ("skipped_steps", "bytes"):
        if key in manifest:
            _expect(_is_int(manifest[key]), path, key, manifest[key], "an integer >= 0")
    files = manifest.get("files")
    _expect(isinstance(files, dict), path, "files", files, "an object of name: {size, sha256}")
    base = path.parent
    for name, entry in files.items():
        where = f"files[{name!r}]"
        _expect(isinstance(entry, dict), path, where, entry, "an object {size, sha256}")
        size, digest = entry.get("size"), entry.get("sha256")
        _expect(_is_int(size), path, f"{where}.size", size, "a size in bytes (integer >= 0)")
        _expect(
            isinstance(digest, str) and len(digest) == 64 and set(digest) <= _SHA256_HEX,
            path, f"{where}.sha256", digest, "64 lowercase hex digits",
        )  # fmt: skip
        why = outside_reason(name, base)
        _expect(why is None, path, where, name, f"a file inside {base} (it is {why})")
    contents = manifest.get("contents", "full")  # adapters.CONTENTS; absent before adapters
    _expect(contents in ("full", "adapters"), path, "contents", contents,
            "'full' or 'adapters'")  # fmt: skip
    for key in ("optimizer", "scheduler", "grad_scaler", "runner", "train_config",
                "parallel_config", "adapters"):  # fmt: skip
        value = manifest.get(key)
        _expect(value is None or isinstance(value, dict), path, key, value, "an object or null")
    optimizer = manifest.get("optimizer")
    if optimizer is not None:
        _expect(isinstance(optimizer.get("class"), str), path, "optimizer.class",
                optimizer.get("class"), "the optimizer's class name")  # fmt: skip
        groups = optimizer.get("param_groups")
        _expect(
            isinstance(groups, list) and all(isinstance(g, dict) for g in groups),
            path, "optimizer.param_groups", groups, "a list of objects",
        )  # fmt: skip
    return cast(dict[str, Any], manifest)  # an object: checked first


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read through `read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported by shardwise")
        metadata = read_dcp_metadata(Path(self.path))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner refusing pickled (non-tensor) entries."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; shardwise "
            "checkpoints hold tensors only and never unpickle entries."
        )


def root_cause(exc: BaseException) -> BaseException | str:
    """DCP wraps each rank's failure; report the underlying errors (e.g. ENOSPC)."""
    if isinstance(exc, DCPException):
        causes = []
        for rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"rank {rank}: {inner}")
        return "; ".join(causes) or str(exc)
    return exc


def stalled_collective(exc: BaseException) -> BaseException | None:
    """The collective failure inside `exc` (DCP wraps each rank's), or None: a save that
    waited for a stopped peer goes straight to the stall check instead of into another
    collective that would wait the whole timeout again."""
    if isinstance(exc, DCPException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and is_comm_failure(inner):
                return inner
        return None
    return exc if is_comm_failure(exc) else None
