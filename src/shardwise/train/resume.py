"""Starting a run: refusing to overwrite one, resuming one, and stopping cleanly on SIGTERM.

Owns: the checks before anything is written (an earlier run in run_dir, directories that
cannot be written, `save_adapters_only` for a model without adapters), finding and loading
the checkpoint `resume` names and moving newer checkpoints aside, and preemption: SIGTERM
sets a flag, the next optimizer-step boundary agrees on it across ranks (inside the
all-reduce each update already makes), the Runner saves there and raises `Preempted`, a
SystemExit with code 75 (EX_TEMPFAIL). A first SIGINT (Ctrl-C) is the same request; a
second raises `Interrupted` (exit code 130) at once, without saving, naming the newest
complete checkpoint.

What torchrun (torch 2.13) does with that: a worker's non-zero exit marks the worker group
FAILED, which the agent restarts while `--max-restarts` allows (any non-zero code counts;
the restarted workers continue with `resume='latest'`). When the agent itself gets SIGTERM,
as a scheduler reclaiming a node sends it, it raises SignalException, forwards SIGTERM to
the workers, waits `--shutdown-timeout` (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default)
before SIGKILL, and exits non-zero without restarting: the next start of the job, with
`resume='latest'`, continues from the checkpoint, exactly.

Must not: run the training loop (train/runner.py does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from shardwise.checkpoint.adapters import adapter_record
from shardwise.checkpoint.layout import (
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    set_aside_newer,
)
from shardwise.checkpoint.load import load_checkpoint
from shardwise.checkpoint.trust import CheckpointError
from shardwise.config.training import RunnerConfig
from shardwise.distributed.process_group import rank_and_world
from shardwise.distributed.worker_errors import refused
from shardwise.train.data import map_position
from shardwise.train.engine import Engine, set_accumulation
from shardwise.train.metrics import METRICS_FILE, free_name
from shardwise.train.progress import say
from shardwise.train.stream import StreamLoader

PREEMPTED_EXIT_CODE = 75
"""os.EX_TEMPFAIL ("temporary failure, retry"): a checkpoint was saved on SIGTERM. torchrun
restarts any non-zero exit within --max-restarts; a scheduler can match this code to
requeue (e.g. a Kubernetes podFailurePolicy rule)."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What asks a Runner to save and stop: SIGTERM (a scheduler reclaiming the node, torchrun
passing it on) and SIGUSR1 (SLURM's warning before a time limit or preemption, with
`--signal=USR1@SECONDS`). A first SIGINT (Ctrl-C) does too; a second stops at once
(`Interrupted`)."""


class Preempted(SystemExit):
    """Raised by `Runner.fit` on every rank after SIGTERM or SIGUSR1: a checkpoint was saved
    after `step`. Uncaught, the process exits with PREEMPTED_EXIT_CODE (no traceback)."""

    def __init__(self, step: int, checkpoint: Path, signum: int | None = signal.SIGTERM) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint
        self.signum = signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "a stop signal to a peer"
        return (
            f"{name}: stopped after optimizer step {self.step} and saved {self.checkpoint}; "
            f"exiting with code {PREEMPTED_EXIT_CODE}. Start the job again with "
            "RunnerConfig.resume='latest' to continue from it."
        )


INTERRUPTED_EXIT_CODE = 130
"""128 + SIGINT, the shell's code for a command stopped by Ctrl-C: a second SIGINT stopped
the Runner at once, without saving."""


class Interrupted(SystemExit):
    """Raised by `Runner.fit` on a second SIGINT (Ctrl-C): stopped at once, inside the step
    after `step`, without saving; `checkpoint` is the newest complete one (None: none).
    Uncaught, the process exits with INTERRUPTED_EXIT_CODE (no traceback)."""

    def __init__(self, step: int, checkpoint: Path | None = None) -> None:
        super().__init__(INTERRUPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        last = (
            f"the last good checkpoint is {self.checkpoint} (resume='latest' continues from it)"
            if self.checkpoint is not None
            else "there is no complete checkpoint to continue from"
        )
        return (
            f"SIGINT again: stopped at once after optimizer step {self.step}, without saving; "
            f"{last}."
        )


def last_good_checkpoint(config: RunnerConfig) -> Path | None:
    """The newest complete checkpoint of this run's checkpoint directory, or None."""
    root = checkpoint_dir(config)
    saved = [c for c in list_checkpoints(root) if c.complete] if root.is_dir() else []
    return saved[-1].path if saved else None


@dataclass
class SigtermState:
    installed: bool = False
    received: bool = False
    signum: int | None = None
    """The stop signal this process received (None: none, or only a peer did)."""
    interrupted: bool = False
    """A SIGINT (Ctrl-C) came: the next one stops at once."""


def _probe(directory: Path, setting: str) -> list[str]:
    """[] if this process can create `directory` and write a file in it, else the reason."""
    probe = directory / f".shardwise_write_probe_{rank_and_world()[0]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return [f"{setting} is not writable ({exc.strerror or exc}: {exc.filename or directory})"]
    return []


def checkpoint_dir(config: RunnerConfig) -> Path:
    """Where a run's checkpoints go: `checkpoint_dir`, or RUN_DIR/checkpoints."""
    return Path(config.checkpoint_dir or Path(config.run_dir) / "checkpoints")


@contextlib.contextmanager
def sigterm_requests_stop(engine: Engine, config: RunnerConfig) -> Iterator[SigtermState]:
    """While fitting (when `config.stop_on_sigterm`), SIGTERM or SIGUSR1 (`STOP_SIGNALS`),
    or a first SIGINT, asks the engine to stop at the next update (a flag only: nothing else
    is safe in a handler); a second SIGINT raises `Interrupted` at once, which names the
    newest complete checkpoint on rank 0. The previous handlers are restored afterwards; a
    signal that came too late for fit to act on is then delivered to its own."""
    state = SigtermState()
    if not config.stop_on_sigterm:
        yield state
        return
    if threading.current_thread() is not threading.main_thread():
        warnings.warn(
            "Runner.fit() runs outside the main thread, where Python cannot install a "
            "signal handler: RunnerConfig.stop_on_sigterm has no effect here, and SIGTERM "
            "ends the process without a checkpoint. Call fit() from the main thread.",
            stacklevel=4,
        )
        yield state
        return

    def request_stop(signum: int, frame: Any) -> None:
        state.received, state.signum = True, state.signum or signum
        engine.request_stop()

    def interrupt(signum: int, frame: Any) -> None:
        if not state.interrupted:  # the first Ctrl-C: as SIGTERM
            state.interrupted = True
            request_stop(signum, frame)
            return
        # The second: at once. Any later SIGINT (a third Ctrl-C, or `shardwise run` passing
        # this one on) must not interrupt the line that says so, nor the exit.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise Interrupted(engine.step)

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    state.installed = True
    acted = False
    try:
        yield state
    except (Preempted, Interrupted) as stopped:
        acted = True
        if isinstance(stopped, Interrupted):
            previous.pop(signal.SIGINT)  # stays ignored while the process exits
            stopped.checkpoint = last_good_checkpoint(config)  # where a resume would start
            say(str(stopped))
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        engine._stop_requested = False
        if state.signum is not None and not acted:
            signal.raise_signal(state.signum)


def any_rank(flag: bool, world: int, device: torch.device) -> bool:
    """Whether `flag` is set on any rank (every rank calls this at the same point)."""
    if world == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t)
    return bool(t.item() > 0)


def preflight(config: RunnerConfig, rank: int, world: int) -> str:
    """On every rank, before anything is written: look for an earlier run in run_dir (rank
    0) and probe the directories for writing. Every rank gets every rank's findings (one
    all-gather), so all raise or none does. Returns the refusal for a fresh run over an
    earlier one ('' when run_dir is unused)."""
    cfg = config
    existing, problems = "", []
    if rank == 0:
        existing = earlier_run(cfg)
        problems += _probe(Path(cfg.run_dir), f"RunnerConfig.run_dir={cfg.run_dir!r}")
    if cfg.save_every or cfg.save_at_end:
        setting = (
            f"RunnerConfig.checkpoint_dir={cfg.checkpoint_dir!r}"
            if cfg.checkpoint_dir
            else f"RunnerConfig.checkpoint_dir=None (RUN_DIR/checkpoints = '{checkpoint_dir(cfg)}')"
        )
        problems += _probe(checkpoint_dir(cfg), setting)
    found: list[Any] = [(existing, problems)]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, (existing, problems))
    bad = [f"{p} (rank {r})" if world > 1 else p for r, (_, mine) in enumerate(found) for p in mine]
    if bad:
        raise ValueError(
            f"Runner: cannot write where this run writes: {'; '.join(bad)}. Choose "
            "directories this process can create and write, or fix their permissions. "
            "Nothing was trained."
        )
    return str(found[0][0])


def saves_adapters_only(config: RunnerConfig, model: torch.nn.Module) -> bool:
    """Whether the Runner's checkpoints hold the adapters only (`save_adapters_only`; None:
    for an adapter model with a frozen base). The same answer on every rank, from the
    model's names alone: no collective."""
    if config.save_adapters_only is False:
        return False
    record = adapter_record(model)
    frozen = record is not None and record["base"]["parameters"] > 0
    if config.save_adapters_only and not frozen:
        what = "has no adapters" if record is None else "has no frozen base (all of it trains)"
        raise ValueError(
            f"RunnerConfig.save_adapters_only=True, but the model {what}: an adapters-only "
            "checkpoint holds the adapters of a peft model without its frozen base. Add "
            "adapters (an adapter section, or peft.get_peft_model) or set "
            "save_adapters_only=None to save the whole model. Nothing was trained."
        )
    return frozen


def earlier_run(config: RunnerConfig) -> str:
    """The refusal for a fresh run over an earlier one ('' when run_dir is unused)."""
    found = []
    root = checkpoint_dir(config)
    if root.is_dir():
        saved = [c for c in list_checkpoints(root) if c.complete]
        if saved:
            found.append(f"{len(saved)} checkpoint(s) in {root}, the newest {saved[-1].path.name}")
    run_dir = Path(config.run_dir)
    if (run_dir / METRICS_FILE).is_file():
        found.append(f"metrics in {run_dir / METRICS_FILE}")
    board = run_dir / "tensorboard"
    if board.is_dir() and any(board.rglob("events.out.tfevents*")):
        found.append(f"TensorBoard events in {board}")
    if not found:
        return ""
    return (
        f"Runner.fit(): RunnerConfig.run_dir={config.run_dir!r} already holds a run "
        f"({'; '.join(found)}) and RunnerConfig.resume=None starts a fresh one, which "
        "would overwrite it. Set resume='latest' to continue that run, or choose a new "
        "run_dir to start over. Nothing was changed."
    )


EXPORT_DIR = "export"
"""RUN_DIR/export: where the examples and the demo export the final weights."""


def keep_earlier_export(config: RunnerConfig) -> Path | None:
    """Move an earlier run's RUN_DIR/export aside to export.<n> (returned), so a resumed
    run's export at its end does not replace it. Rank 0 only; None when there is none."""
    export = Path(config.run_dir) / EXPORT_DIR
    if not export.is_dir() or not any(export.iterdir()):
        return None
    kept = free_name(export)
    export.rename(kept)
    say(f"the earlier run's {export} was kept as {kept}; this run exports to {export}")
    return kept


def resume_target(config: RunnerConfig) -> str | None:
    """The checkpoint (or root) `config.resume` continues from; None: a fresh start."""
    if config.resume != "latest":
        return config.resume
    root = checkpoint_dir(config)
    if not root.is_dir() or not any(c.complete for c in list_checkpoints(root)):
        return None  # nothing saved yet: a fresh start (preemptible jobs rerun as is)
    return str(root)


def step_to_resume(config: RunnerConfig) -> int:
    """The step `resume` will restore, read ahead (for validate() before fit())."""
    target = resume_target(config)
    try:
        return int(read_manifest(target)["step"]) if target is not None else 0
    except (CheckpointError, KeyError, ValueError):
        return 0  # fit() will report it


def resume(
    config: RunnerConfig, engine: Engine, loader: DataLoader[Any] | None, world: int
) -> tuple[int, int]:
    """(epoch, samples each rank skips in it) after restoring `config.resume`, or (0, 0).

    Checkpoints newer than the resumed step belong to a future this run abandons: they are
    moved aside (never deleted), so saves do not collide with them."""
    target = resume_target(config)
    # Under `shardwise run --max-restarts`, torch's agent counts the restarts for us.
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    attempt = f"restart {restart}: " if restart else ""
    if target is None:
        if attempt:
            say(f"{attempt}no complete checkpoint yet, so training starts again from step 0")
        return 0, 0
    saved = read_manifest(target)
    saved_step = int(saved["step"]) + int(saved.get("skipped_steps", 0))  # as fit() counts
    if config.max_steps is not None and saved_step > config.max_steps:
        raise ValueError(
            f"RunnerConfig.max_steps={config.max_steps} is below step {saved_step} of the "
            f"checkpoint it resumes from ({resolve_checkpoint(target)}): the run would train "
            f"nothing. Set max_steps above {saved_step} to train on, or start a fresh run "
            "(resume=None and a new run_dir). Nothing was loaded."
        )
    fresh = [dict(g) for g in engine.optimizer.param_groups]  # before the load replaces them
    manifest = load_checkpoint(target, engine)
    say(f"{attempt}resumed from step {engine.step} of {resolve_checkpoint(target)}")
    if config.max_steps is not None and saved_step == config.max_steps:
        say(f"the run is already complete at step {saved_step} (max_steps={config.max_steps})")
    changed = config_changes(manifest, engine.train_config, fresh)
    changed += runner_changes(manifest.get("runner") or {}, config)
    if changed and rank_and_world()[0] == 0:
        warnings.warn(
            "Runner: resuming with a config that differs from the checkpoint's: "
            + "; ".join(changed),
            stacklevel=3,
        )
    position = manifest.get("runner") or {}
    if not position:
        raise CheckpointError(
            f"{target} was saved by save_checkpoint outside a Runner: it has no loop "
            "position to resume from. Load it with load_checkpoint() instead."
        )
    set_aside_newer(checkpoint_dir(config), engine.step)
    saved_world = int(manifest.get("world_size", world))
    batch = (loader.batch_size if loader else None) or 1
    streamed = isinstance(loader, StreamLoader)
    if streamed != ("stream" in position):
        kinds = ("a stream", "map-style data")
        then, now = kinds if not streamed else kinds[::-1]
        raise refused(
            ValueError(
                f"RunnerConfig.resume={config.resume!r}: the checkpoint was saved training "
                f"on {then}, and this run's train_data is {now}: where it stopped in one "
                "means nothing in the other. Give the same kind of train_data, or start a "
                "fresh run."
            )
        )
    keep_global_batch(position, engine, batch, world, config.resume)
    if isinstance(loader, StreamLoader):
        loader.load_state_dict(position["stream"], config.resume)
        return int(position["epoch"]), 0
    return map_position(position, saved_world, loader, world, config.resume)


def keep_global_batch(
    position: dict[str, Any], engine: Engine, batch: int, world: int, resume: str | None
) -> None:
    """At another number of data-parallel ranks (a node lost or gained), set the engine's
    accumulation so every optimizer step still takes the checkpoint's global batch: the
    same training as without the change. Accumulation, not the per-rank batch, absorbs it:
    it never raises a rank's activation memory. Nothing changes at the same world, for an
    older checkpoint, or where this run's batch_size or accumulate_steps differ from the
    checkpoint's configured ones (the user's change is used, and warned of)."""
    saved_world = int(position.get("world_size", world))
    saved_batch, saved_steps = position.get("batch_size"), position.get("accumulate_steps")
    configured = position.get("accumulate_configured", saved_steps)
    now = engine.train_config.accumulate_steps
    if saved_world == world or saved_steps is None or saved_batch != batch or configured != now:
        return
    total = int(saved_batch) * saved_world * int(saved_steps)
    steps, rest = divmod(total, batch * world)
    if rest or steps < 1:
        fits = [w for w in range(1, 257) if total % (batch * w) == 0]
        raise refused(  # the same on every rank; shown as one line by `shardwise run`
            ValueError(
                f"RunnerConfig.resume={resume!r}: the checkpoint's global batch is {total} samples "
                f"({saved_world} data-parallel rank(s) x {saved_batch} x {saved_steps} "
                f"accumulated), and {world} rank(s) x batch_size {batch} cannot make it up with "
                f"whole accumulation steps. Run at a data-parallel world in {fits}, or set "
                "batch_size (a changed batch_size trains with this world's global batch)."
            )
        )
    set_accumulation(engine, steps)
    say(
        f"data-parallel ranks {saved_world} -> {world}: resuming after step {engine.step} "
        f"with accumulate_steps={steps} (was {saved_steps}), so every step still takes the "
        f"global batch of {total} samples"
    )


_RUNNER_FIELDS = ("max_steps", "max_epochs", "batch_size", "seed")


def saved_runner_fields(config: RunnerConfig) -> dict[str, Any]:
    """The RunnerConfig fields that shape training, kept in a checkpoint to compare on resume."""
    return {name: getattr(config, name) for name in _RUNNER_FIELDS}


def runner_changes(position: dict[str, Any], config: RunnerConfig) -> list[str]:
    """'runner.field: checkpoint A, now B (now's is used)' for each changed field. A new
    max_steps or max_epochs moves the end of training and reshapes the rest of a schedule
    built from it (a cosine to max_steps); a new batch_size changes what a step is."""
    saved = position.get("config") or {}
    return [
        f"runner.{name}: checkpoint {saved[name]!r}, now {getattr(config, name)!r} (now's is used)"
        for name in _RUNNER_FIELDS
        if name in saved and _differs(saved[name], getattr(config, name))
    ]


_HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps", "momentum")


def config_changes(
    manifest: dict[str, Any], train: Any, fresh_groups: list[dict[str, Any]]
) -> list[str]:
    """'field: checkpoint A, now B (which is used)' for each optimizer hyperparameter and
    TrainConfig field that differs between the checkpoint and this run. The optimizer's
    come back from the checkpoint (so a new lr is ignored); the TrainConfig is this run's."""
    out = []
    saved_groups = (manifest.get("optimizer") or {}).get("param_groups") or []
    for i, (saved, fresh) in enumerate(zip(saved_groups, fresh_groups, strict=False)):
        for key in _HYPERPARAMETERS:
            # A scheduler moves lr; its starting value (initial_lr) is what a config sets.
            name = "initial_lr" if key == "lr" and "initial_lr" in saved else key
            then, now = saved.get(name), fresh.get(name, fresh.get(key))
            if key in fresh and _differs(then, now):
                where = (
                    f"optimizer param_groups[{i}].{key}"
                    if len(fresh_groups) > 1
                    else (f"optimizer.{key}")
                )
                out.append(f"{where}: checkpoint {then!r}, now {now!r} (the checkpoint's is used)")
    saved_train = manifest.get("train_config") or {}
    for field in dataclasses.fields(train) if dataclasses.is_dataclass(train) else ():
        if field.name in saved_train and _differs(
            saved_train[field.name], getattr(train, field.name)
        ):
            out.append(
                f"train.{field.name}: checkpoint {saved_train[field.name]!r}, now "
                f"{getattr(train, field.name)!r} (now's is used)"
            )
    return out


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return not math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return bool(a != b)
