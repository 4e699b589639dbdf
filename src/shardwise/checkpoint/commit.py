"""Making a written checkpoint visible, or removing it: the atomic end of every save.

Owns: preparing the temporary directory, hashing each rank's share of the written files,
rank 0's finalisation (manifest, moving superseded steps aside, the rename that makes the
checkpoint visible, `latest`), the tidying after it that no rank waits for (pruning,
removing leftovers), and the clean-up and message when a save fails.
Synchronous and asynchronous saves both end here.

Must not: write tensors (DCP does, in save.py and async_save.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from shardwise.checkpoint.layout import (
    LATEST,
    MANIFEST,
    RNG_DIR,
    STATE_DIR,
    TMP_PREFIX,
    _checkpoint_dirs,
    _files,
    _listing,
    _log,
    _move_aside,
    _prune,
    _remove_leftovers,
    _write_atomic,
    list_checkpoints,
)
from shardwise.checkpoint.ranks import _agree, _gather_to_all, _my_share
from shardwise.checkpoint.trust import (
    CheckpointError,
)
from shardwise.distributed.process_group import (
    rank_and_world,
)


def _prepare(root: Path, tmp: Path) -> BaseException | None:
    """Rank 0: the root and an empty temporary directory."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # this very step's save was killed before: start it afresh
            shutil.rmtree(tmp)
            _log.warning(
                "shardwise checkpoint: removed %s, the temporary directory of a save that "
                "did not finish",
                tmp,
            )
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
    if rank_and_world()[0] == 0:
        _tidy(root, final, keep_last)
    return final


def _tidy(root: Path, final: Path, keep_last: int | None) -> None:
    """Rank 0, once the checkpoint is visible and the other ranks have gone back to
    training: prune beyond `keep_last`, and remove what killed saves and prunings left.
    Slow on a large shared filesystem, so nobody waits for it in a collective (a NCCL
    watchdog would abort the job); a failure here is logged, the checkpoint stands."""
    try:
        if keep_last is not None:
            complete = [c for c in list_checkpoints(root) if c.complete and c.path != final]
            for old in complete[: max(0, len(complete) - (keep_last - 1))]:
                _prune(old.path)
        _remove_leftovers(root, busy={final})
    except (OSError, CheckpointError) as exc:
        _log.warning(
            "shardwise checkpoint: tidying %s after saving %s failed: %s", root, final, exc
        )


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


def _finalize(
    root: Path,
    tmp: Path,
    final: Path,
    manifest: dict[str, Any],
    keep_last: int | None,
    files: dict[str, Any],
) -> None:
    """Rank 0, after every rank wrote and hashed: manifest, rename, `latest`."""
    # A file that no rank listed (a slow shared filesystem) is hashed here.
    files.update(_files(tmp, [n for n in _listing(tmp) if n not in files]))
    manifest["files"] = dict(sorted(files.items()))
    manifest["bytes"] = sum(f["size"] for f in manifest["files"].values())
    _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2))
    step = int(manifest["step"])
    _move_aside(root, _checkpoint_dirs(root, step - 1), f"superseded by the save at step {step}")
    os.rename(tmp, final)  # the moment the checkpoint becomes visible
    _write_atomic(root / LATEST, final.name + "\n")
