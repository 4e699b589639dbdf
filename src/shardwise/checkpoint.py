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

Must not: hand-write sharding or the tensor format (DCP owns both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import platform
import random
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardwise.distributed import rank_and_world

MANIFEST = "shardwise.json"
LATEST = "latest"
STATE_DIR = "state"
RNG_DIR = "rng"
TMP_PREFIX = ".tmp-"
FORMAT = "shardwise-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says why and what is intact."""


# --- safe reading of DCP metadata ----------------------------------------------------------

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
    return metadata


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not supported by shardwise")
        metadata = read_dcp_metadata(Path(self.path))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; shardwise "
            "checkpoints hold tensors only and never unpickle entries."
        )


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


# --- save ---------------------------------------------------------------------------------------


def save_checkpoint(
    directory: str | Path,
    engine: Any,
    *,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    runner_state: dict[str, Any] | None = None,
) -> Path:
    """Save `engine` (model, optimizer, scheduler, scaler, counters, RNG) under `directory`.

    Every rank writes its own shards in parallel. The checkpoint is written to a
    temporary directory and renamed to ROOT/step_<step> only after every rank has
    finished; `latest` then points at it and, with `keep_last`, older complete checkpoints
    beyond that many are deleted. On failure the partial files are removed and nothing
    already saved is touched. Call it between optimizer steps (not mid-accumulation).
    """
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
    extra = _jsonable(extra, "save_checkpoint(extra=...)") if extra is not None else None
    root = Path(directory)
    name = checkpoint_name(engine.step)
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"

    error: BaseException | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if final.exists():
                raise CheckpointError(
                    f"{final} already exists. Delete it, or save to another directory."
                )
            if tmp.exists():  # left behind by a save that was killed
                shutil.rmtree(tmp)
            (tmp / STATE_DIR).mkdir(parents=True)
            (tmp / RNG_DIR).mkdir()
        except OSError as exc:
            error = CheckpointError(
                f"cannot create the checkpoint directory {tmp}: {exc}. Nothing was written; "
                f"checkpoints already under {root} are intact."
            )
        except CheckpointError as exc:
            error = exc
    _agree(error, "creating the checkpoint directory")

    try:
        model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
        with single_process_ok():
            dcp.save(
                {"model": model_sd, "optim": optim_sd["state"]},
                storage_writer=FileSystemWriter(tmp / STATE_DIR, sync_files=True),
                no_dist=not dist.is_initialized(),
            )
        save_file(_rng_tensors(), str(tmp / RNG_DIR / f"rank_{rank}.safetensors"))
        error = None
    except (OSError, RuntimeError, DCPException) as exc:
        error = CheckpointError(_write_failed(root, tmp, _root_cause(exc)))
    try:
        _agree(error, "writing the checkpoint")
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    # Every rank hashes its share of the files (they are still in the page cache).
    hashed: dict[str, Any] | str
    try:
        hashed = _files(tmp, _my_share(_listing(tmp)))
    except OSError as exc:
        hashed = f"rank {rank}: {exc}"
    shares = _gather_to_all(hashed)
    error = None
    if rank == 0:
        try:
            failures = [h for h in shares if isinstance(h, str)]
            if failures:
                raise OSError(f"hashing the written files failed: {'; '.join(failures)}")
            files: dict[str, Any] = {}
            for share in shares:
                files.update(share)
            manifest = _manifest(engine, optim_sd, world, extra, runner_state)
            _finalize(root, tmp, final, manifest, keep_last, files)
        except (OSError, CheckpointError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            error = CheckpointError(_write_failed(root, tmp, exc))
    _agree(error, "finalising the checkpoint")
    return final


def _root_cause(exc: BaseException) -> BaseException | str:
    """DCP wraps each rank's failure; report the underlying errors (e.g. ENOSPC)."""
    if isinstance(exc, DCPException):
        causes = []
        for rank, failure in exc.failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            causes.append(f"rank {rank}: {inner}")
        return "; ".join(causes) or str(exc)
    return exc


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
    os.rename(tmp, final)  # the moment the checkpoint becomes visible
    _write_atomic(root / LATEST, final.name + "\n")
    if keep_last is not None:
        complete = [c for c in list_checkpoints(root) if c.complete and c.path != final]
        for old in complete[: max(0, len(complete) - (keep_last - 1))]:
            shutil.rmtree(old.path, ignore_errors=True)


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
                storage_reader=_SafeReader(path / STATE_DIR),
                planner=_TensorOnlyLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
    except (RuntimeError, ValueError, KeyError, DCPException) as exc:
        raise CheckpointError(f"could not read checkpoint {path}: {_root_cause(exc)}") from None
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
