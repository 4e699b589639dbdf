"""Checkpoints on disk: sharded, atomic, exact to resume, loadable at any world size.

Layout of ROOT/step_00000100/:
    state/          DCP files: model and optimizer tensors only (resharded on load)
    rng/            rank_<r>.safetensors: each rank's RNG states
    shardwise.json  the manifest: counters, configs, optimizer hyperparameters, scheduler
                    and grad-scaler state, runner position, versions, SHA-256 of every file
ROOT/latest         name of the newest complete checkpoint

An adapters-only checkpoint (`save_checkpoint(..., adapters_only=True)`, a peft model)
has the same layout and machinery; its state/ holds the trainable tensors and their
optimizer state, and its manifest says `contents: "adapters"` and records the adapters
and a fingerprint of the base they need (adapters.py).

Modules, bottom to top: trust.py (reading DCP without trusting it: nothing unpickles with
code execution, paths stay inside), ranks.py (how ranks agree), layout.py (the directory,
listing, verification, pruning), contents.py (manifest and RNG), adapters.py (what a
checkpoint records about a peft model's adapters, peft's key names, LoRA's merge),
commit.py (the atomic end of a save: a checkpoint is visible only once complete),
async_save.py, save.py, load.py, reading.py (a checkpoint's tensors without a model),
adapter_export.py (the tensors of peft-format and merged exports) and export.py
(consolidated safetensors).

The directory rule (what a save does to what is already under ROOT):
- A save at step N supersedes every checkpoint under ROOT with a step >= N: they are
  moved, never deleted, to ROOT/superseded/<UTC time>/ (one log line each) just before the
  new one is renamed into place. So `latest`, `keep_last` and the newest-complete fallback
  always see one linear history, whether the step existed because a kill came between the
  rename and the `latest` update, because training resumed from an older checkpoint, or
  because the directory holds an older run. `set_aside_newer(root, step)` applies the same
  rule right after resuming, before any save.
- Leftovers of killed saves and prunings (`.tmp-step_*`, `.deleting-step_*`, and `step_*`
  without a manifest) are removed by rank 0 at the next save, one log line each. Pruning
  renames a directory to `.deleting-step_*` before removing it, so a half-deleted one is
  never mistaken for a checkpoint.

Every module logs to the logger "shardwise.checkpoint". Must not: hand-write sharding or
the tensor format (DCP owns both).
"""

from shardwise.checkpoint.async_save import PendingCheckpoint, wait_for_checkpoint
from shardwise.checkpoint.contents import EngineState
from shardwise.checkpoint.export import DEFAULT_MAX_SHARD_BYTES, STAGING_PREFIX, export_weights
from shardwise.checkpoint.layout import (
    DELETING_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    RNG_DIR,
    STATE_DIR,
    SUPERSEDED,
    TMP_PREFIX,
    CheckpointInfo,
    checkpoint_name,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    set_aside_newer,
    verify_checkpoint,
)
from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.ranks import single_process_ok
from shardwise.checkpoint.save import save_checkpoint
from shardwise.checkpoint.trust import (
    CheckpointError,
    SafeReader,
    TensorOnlyLoadPlanner,
    read_dcp_metadata,
    root_cause,
)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DELETING_PREFIX",
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "RNG_DIR",
    "STAGING_PREFIX",
    "STATE_DIR",
    "SUPERSEDED",
    "TMP_PREFIX",
    "CheckpointError",
    "CheckpointInfo",
    "EngineState",
    "PendingCheckpoint",
    "SafeReader",
    "TensorOnlyLoadPlanner",
    "checkpoint_name",
    "export_weights",
    "list_checkpoints",
    "load_checkpoint",
    "read_dcp_metadata",
    "read_manifest",
    "resolve_checkpoint",
    "root_cause",
    "save_checkpoint",
    "set_aside_newer",
    "single_process_ok",
    "verify_checkpoint",
    "wait_for_checkpoint",
]
