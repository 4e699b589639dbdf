"""The checkpoint directory on disk: names, listing, manifest reading, verification, pruning.

Owns: the layout of ROOT (step_N directories, `latest`, `superseded/`, the temporary and
deleting prefixes), listing and resolving checkpoints, reading and verifying a manifest
(sizes and SHA-256 of every file), moving superseded checkpoints aside, removing what
killed saves left, pruning, and `set_aside_newer`.

Must not: write checkpoint contents (save.py and commit.py do) or read tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shardwise.checkpoint.ranks import _gather_to_all, _my_share, _on_rank0
from shardwise.checkpoint.trust import (
    CheckpointError,
    check_manifest,
    read_dcp_metadata,
)
from shardwise.distributed.process_group import (
    rank_and_world,
)

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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        if not name.startswith("step_") or not name[5:].isdigit():
            continue
        _refuse_link(p, root)
        if not p.is_dir():
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
        target = _latest_target(latest)
        if (target / MANIFEST).is_file():
            return target
    complete = [c for c in list_checkpoints(path) if c.complete]
    if complete:
        return complete[-1].path
    raise CheckpointError(
        f"{path} holds no complete checkpoint (no {MANIFEST}; incomplete saves are ignored)."
    )


def _refuse_link(step_dir: Path, root: Path) -> None:
    """A step_* entry must be a real directory inside `root`, not a link to elsewhere."""
    if step_dir.is_symlink() or not step_dir.resolve().is_relative_to(root.resolve()):
        raise CheckpointError(
            f"{step_dir} is a symbolic link (to {step_dir.resolve()}): a checkpoint must be a "
            f"directory inside {root}, so that resuming, pruning and `latest` never act on "
            "another run's files. Remove the link, or copy that checkpoint here."
        )


def _latest_target(latest: Path) -> Path:
    """The checkpoint a `latest` file names: one step_N directory beside it, nothing else."""
    name = latest.read_text().strip()
    if _step_of(name) is None or "/" in name or "\\" in name:
        raise CheckpointError(
            f"{latest} names {name[:80]!r}; it may only name a step_N directory beside it "
            f"(in {latest.parent}). It was not followed. Fix or delete {latest}: without it, "
            "the newest complete checkpoint there is used."
        )
    target = latest.parent / name
    if target.exists():
        _refuse_link(target, latest.parent)
    return target


def read_manifest(checkpoint: str | Path) -> dict[str, Any]:
    path = resolve_checkpoint(checkpoint) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path} is unreadable or not JSON ({exc}): the checkpoint is corrupted."
        ) from None
    if not isinstance(manifest, dict):
        check_manifest(manifest, path)  # names what the top level is instead
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a shardwise checkpoint manifest.")
    return dict(check_manifest(manifest, path))


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


def _remove_leftovers(root: Path, busy: set[Path]) -> None:
    """Rank 0, at a save: remove what killed saves and prunings left behind. `keep` (this
    save's target, moved aside if it exists) and a save still in flight are left alone."""
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
