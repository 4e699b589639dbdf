"""Loops around the engine: epochs or steps, distributed sampling, validation, logs, progress.

Owns: turning datasets or DataLoaders into per-rank loaders (each rank its own slice,
`set_epoch` every epoch), the training loop (accumulation windows, validation every N
steps, scheduler through the engine), metrics rows (CSV always, TensorBoard when
installed) and the rank-0 progress bar. Other ranks print nothing.

The last uneven batch: torch's DistributedSampler pads the dataset to a multiple of the
world size by repeating its first samples (drop_last=False) or drops the tail
(drop_last=True), so every rank runs the same number of batches; unequal counts would
hang the gradient collectives. The DataLoader then keeps a final partial batch unless
`drop_last`; its mean loss counts like a full batch's. A partial accumulation window at
the end of an epoch still updates, with the micro-batches it has.

Resume is exact (same losses, bit for bit, on CPU in fp32): the loop position, each
rank's RNG states and all engine state are restored, and the loaders draw from their own
generators. With `num_workers > 0`, worker seeds after a resume differ from an
uninterrupted run, so random augmentations inside workers are not reproduced. At another
world size (or per-rank batch size) the position is kept by the global samples consumed in
the epoch: DistributedSampler deals one epoch-wide order `order[rank::world]`, so after
b batches of B on each of W ranks exactly `order[:b*B*W]` was trained, and W' ranks that
each skip b*B*W/W' samples train `order[b*B*W:]`, each sample once. When W' does not divide
that count the resume is refused (an uneven split would need unequal batch counts, which
hang the collectives). RNG states are restored only at the saving world size.

A run directory belongs to one run: `fit` without `resume` refuses, on every rank and
before writing anything, a run_dir that holds metrics or a checkpoint_dir that holds
checkpoints; the run and checkpoint directories are probed for writing before the first
step.

Preemption (`stop_on_sigterm`): SIGTERM sets a flag; the next optimizer-step boundary
(the accumulation window is finished first) agrees on it across ranks, inside the
all-reduce each update already makes, so every rank stops after the same step; the Runner
saves a checkpoint there and raises `Preempted`, a SystemExit with code 75
(EX_TEMPFAIL). What torchrun (torch 2.13) does with that: a worker's non-zero exit marks
the worker group FAILED, which the agent restarts while `--max-restarts` allows (any
non-zero code counts; the restarted workers continue with `resume='latest'`). When the
agent itself gets SIGTERM, as a scheduler reclaiming a node sends it, it raises
SignalException, forwards SIGTERM to the workers, waits `--shutdown-timeout`
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) before SIGKILL, and exits non-zero
without restarting: the next start of the job, with `resume='latest'`, continues from the
checkpoint, exactly.

Must not: compute gradients or talk to the model directly (the engine does).
"""

from __future__ import annotations

import contextlib
import math
import random
import resource
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from shardwise.distributed import rank_and_world
from shardwise.engine import VIS_KEYS, Engine, parse_losses
from shardwise.metrics import METRICS_FILE, MetricsLogger
from shardwise.watchdog import guard

EvaluateFn = Callable[[Any, Any], dict[str, float]]

PREEMPTED_EXIT_CODE = 75
"""os.EX_TEMPFAIL ("temporary failure, retry"): a checkpoint was saved on SIGTERM. torchrun
restarts any non-zero exit within --max-restarts; a scheduler can match this code to
requeue (e.g. a Kubernetes podFailurePolicy rule)."""


class Preempted(SystemExit):
    """Raised by `Runner.fit` on every rank after SIGTERM: a checkpoint was saved after
    `step`. Uncaught, the process exits with PREEMPTED_EXIT_CODE (no traceback)."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return (
            f"SIGTERM: stopped after optimizer step {self.step} and saved {self.checkpoint}; "
            f"exiting with code {PREEMPTED_EXIT_CODE}. Start the job again with "
            "RunnerConfig.resume='latest' to continue from it."
        )


def _say(message: str) -> None:
    """One line on rank 0's stderr (the Runner's only output besides the progress bar)."""
    if rank_and_world()[0] == 0:
        print(f"shardwise: {message}", file=sys.stderr, flush=True)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA): same seed and world size, same run."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(kw_only=True)
class RunnerConfig:
    """How `Runner.fit` loops."""

    max_epochs: int | None = 1
    """Epochs over the training data (None: until max_steps)."""
    max_steps: int | None = None
    """Optimizer steps; training stops at whichever of max_epochs/max_steps comes first."""
    batch_size: int = 8
    """Per-rank batch size when given a Dataset (a DataLoader keeps its own)."""
    val_every: int | None = None
    """Validate every N optimizer steps (None: at the end of each epoch)."""
    val_batches: int | None = None
    """Validate on at most this many batches per rank (None: all)."""
    log_every: int = 1
    """Write a metrics row every N optimizer steps."""
    run_dir: str = "runs/default"
    """Where metrics.csv (and tensorboard/) go."""
    seed: int = 0
    """Seeds the sampler's shuffling (and everything, via seed_everything, in fit)."""
    shuffle: bool = True
    """Shuffle the training data each epoch."""
    drop_last: bool = False
    """Drop the tail that does not fill a batch on every rank."""
    num_workers: int = 0
    """DataLoader worker processes for datasets."""
    progress: bool = True
    """Show the progress bar on rank 0."""
    tensorboard: bool | None = None
    """Write TensorBoard scalars: None when installed, True to require it."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (None: RUN_DIR/checkpoints)."""
    save_every: int | None = None
    """Save a checkpoint every N optimizer steps (None: never during training)."""
    save_at_end: bool = False
    """Save a checkpoint when training ends."""
    keep_last: int | None = None
    """Keep only the newest N complete checkpoints (None: keep all)."""
    resume: str | None = None
    """'latest' (the newest complete checkpoint in checkpoint_dir, or a fresh start when there
    is none) or a checkpoint path to continue from. None: a fresh run, refused when run_dir
    already holds metrics or checkpoint_dir holds checkpoints."""
    async_save: bool = False
    """Write `save_every` checkpoints in the background (DCP's async_save): training goes on
    while the files are written; each becomes complete (manifest, `latest`) when the next
    save starts or fit ends. Costs one CPU copy of this rank's state, kept between saves."""
    stop_on_sigterm: bool = True
    """On SIGTERM, finish the current optimizer step, save a checkpoint and exit with code
    75 (all ranks at the same step); False leaves SIGTERM's handling as it was."""

    def __post_init__(self) -> None:
        for name in (
            "max_epochs",
            "max_steps",
            "val_every",
            "val_batches",
            "save_every",
            "keep_last",
        ):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"RunnerConfig.{name}={value!r} must be a positive int or None.")
        for name in ("batch_size", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunnerConfig.{name}={value!r} must be a positive int.")
        if self.max_epochs is None and self.max_steps is None:
            raise ValueError(
                "RunnerConfig: max_epochs and max_steps are both None, so training would never "
                "stop. Set at least one of them."
            )


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _count(batch: Any) -> tuple[int, int]:
    """(samples, tokens) in a batch: dim 0 of the first tensor; elements of the first
    integer tensor (token ids) if there is one."""
    tensors: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v)

    collect(batch)
    if not tensors:
        return 0, 0
    ints = [t for t in tensors if not t.is_floating_point() and t.dim() >= 2]
    return int(tensors[0].shape[0]) if tensors[0].dim() else 1, int(ints[0].numel()) if ints else 0


class Runner:
    """Train, validate and test an `Engine` over data, logging as it goes."""

    def __init__(
        self,
        engine: Engine,
        train_data: Dataset[Any] | DataLoader[Any] | None = None,
        val_data: Dataset[Any] | DataLoader[Any] | None = None,
        test_data: Dataset[Any] | DataLoader[Any] | None = None,
        config: RunnerConfig | None = None,
        *,
        evaluate: EvaluateFn | None = None,
    ) -> None:
        self.engine = engine
        self.config = config or RunnerConfig()
        self.rank, self.world = rank_and_world()
        self.evaluate = evaluate
        self.train_loader = self._loader(train_data, "train_data", self.config.shuffle)
        self.val_loader = self._loader(val_data, "val_data", False)
        self.test_loader = self._loader(test_data, "test_data", False)
        self.logger = MetricsLogger(
            self.config.run_dir, enabled=self.rank == 0, tensorboard=self.config.tensorboard
        )
        self.history: list[dict[str, Any]] = []
        self._checked = False
        self._existing_run = ""  # what run_dir held before this Runner wrote (rank 0's view)
        self._resumed = False

    # --- data ---------------------------------------------------------------------------

    def _loader(self, data: Any, name: str, shuffle: bool) -> DataLoader[Any] | None:
        if data is None:
            return None
        if isinstance(getattr(data, "dataset", data), IterableDataset):
            raise TypeError(
                f"Runner({name}=...) is an IterableDataset, which shardwise cannot split across "
                "ranks. Use a map-style Dataset, or shard the stream per rank yourself and "
                "drive Engine.train_step directly."
            )
        cfg = self.config
        if isinstance(data, DataLoader):
            dataset, batch_size = data.dataset, data.batch_size
            collate, workers, drop_last = data.collate_fn, data.num_workers, data.drop_last
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            dataset, batch_size, collate, workers, drop_last = (
                data,
                cfg.batch_size,
                None,
                cfg.num_workers,
                cfg.drop_last,
            )
        else:
            raise TypeError(
                f"Runner({name}=...) got {type(data).__name__}; expected a map-style Dataset "
                "or a DataLoader over one."
            )
        sampler: DistributedSampler[Any] = _ResumableSampler(
            dataset,
            num_replicas=self.world,
            rank=self.rank,
            shuffle=shuffle,
            seed=cfg.seed,
            drop_last=cfg.drop_last,
        )
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=collate,
            num_workers=workers,
            drop_last=drop_last,
            # Its own generator: creating an iterator draws a base seed, and drawing it from
            # the global RNG would shift dropout masks after a resume.
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        if len(loader) == 0:
            raise ValueError(
                f"Runner: {name} yields no batches: {len(dataset)} sample(s) over "  # type: ignore[arg-type]
                f"{self.world} rank(s) with batch_size={batch_size} and drop_last={drop_last} "
                "gives 0 batches per rank. Use more data, a smaller batch_size, or drop_last=False."
            )
        return loader

    # --- loops ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until max_epochs or max_steps; validate as configured. Returns a summary.

        Raises `Preempted` (exit code 75) on every rank after saving, when SIGTERM came
        and `stop_on_sigterm` is set."""
        from shardwise.checkpoint import wait_for_checkpoint

        if self.train_loader is None:
            raise ValueError("Runner.fit() needs train_data.")
        cfg, engine = self.config, self.engine
        self._preflight()
        if cfg.resume is None and self._existing_run:
            raise ValueError(self._existing_run)  # the same verdict on every rank
        seed_everything(cfg.seed)
        k = engine.train_config.accumulate_steps
        steps_per_epoch = math.ceil(len(self.train_loader) / k)
        total = cfg.max_steps or 0
        if cfg.max_epochs is not None:
            by_epochs = steps_per_epoch * cfg.max_epochs
            total = min(total, by_epochs) if total else by_epochs
        step_limit = cfg.max_steps or math.inf
        epoch, skip = self._resume()
        self._start_logger()
        progress = _Progress(total, enabled=cfg.progress and self.rank == 0)
        sampler = self.train_loader.sampler
        batch = self.train_loader.batch_size or 1
        window = _Window()
        saved_at = engine.step if cfg.resume else -1
        position: dict[str, Any] | None = None
        start = time.perf_counter()
        last_train: dict[str, Any] = {}
        last_val: dict[str, float] = {}
        stop = False
        try:
            with self._sigterm_requests_stop() as sigterm:
                # Epochs bound the loop by epochs, not by `total`: after a resume at another
                # world or batch size, an epoch has another number of steps.
                while (
                    engine.step + engine.skipped_steps < step_limit
                    and (cfg.max_epochs is None or epoch < cfg.max_epochs)
                    and not stop
                ):
                    if isinstance(sampler, DistributedSampler):
                        sampler.set_epoch(epoch)
                    if isinstance(sampler, _ResumableSampler):
                        sampler.skip = skip
                    # The segment of the epoch this pass trains starts skip*world samples in.
                    offset, consumed, skip = skip // batch, skip * self.world, 0
                    n = len(self.train_loader)
                    window.restart()
                    for i, data in enumerate(self.train_loader):
                        window.add(data)
                        # A collective that times out here names the rank that never came.
                        with guard(f"train step {engine.step + engine.skipped_steps + 1}"):
                            logs = engine.train_step(data, force_update=i == n - 1)
                        if "grad_norm" not in logs:
                            continue
                        stop = logs.pop("stop", 0.0) > 0
                        logs = {k: v for k, v in logs.items() if k not in VIS_KEYS}
                        done = engine.step + engine.skipped_steps
                        # Where the loop stands after this update: what a resume needs.
                        position = {
                            "epoch": epoch,
                            "batches_done": offset + i + 1,
                            "total_batches": offset + n,
                            "samples_done": consumed + (i + 1) * batch * self.world,
                            "world_size": self.world,
                            "batch_size": batch,
                        }
                        row = window.close(logs, self.world, engine.device, done, epoch)
                        last_train = row
                        if done % cfg.log_every == 0 or done == total:
                            self._log(row)
                        progress.update(row)
                        if stop:
                            break
                        if (
                            cfg.val_every
                            and self.val_loader is not None
                            and done % cfg.val_every == 0
                        ):
                            last_val = self.validate()
                            window.restart()  # validation time is not training throughput
                        if cfg.save_every and done % cfg.save_every == 0:
                            self.save(position, async_=cfg.async_save)
                            saved_at = engine.step
                            window.restart()
                        if done >= step_limit and i < n - 1:
                            break  # max_steps reached inside the epoch
                    else:
                        epoch += 1
                        if cfg.val_every is None and self.val_loader is not None:
                            last_val = self.validate()
                        continue
                    break
                if not stop and sigterm.installed:
                    # A SIGTERM after the last update (during validation, say) counts too.
                    stop = self._any_rank(sigterm.received)
                if stop and position is not None:
                    path = self.checkpoint_dir / _checkpoint_name(engine.step)
                    if saved_at != engine.step:
                        path = self.save(position)
                    wait_for_checkpoint()  # an async save of this very step completes first
                    preempted = Preempted(engine.step, path)
                    _say(str(preempted))
                    raise preempted
            if cfg.save_at_end and position is not None and saved_at != engine.step:
                self.save(position)
            # An asynchronous save still being written completes here (every rank; not in
            # `finally`: after an error some ranks may never arrive).
            wait_for_checkpoint()
        finally:
            progress.close()
            self.logger.close()
        return {
            "steps": engine.step,
            "skipped_steps": engine.skipped_steps,
            "epochs": epoch,
            "train": last_train,
            "val": last_val,
            "seconds": time.perf_counter() - start,
            "run_dir": str(Path(cfg.run_dir)),
        }

    @contextlib.contextmanager
    def _sigterm_requests_stop(self) -> Iterator[_Sigterm]:
        """While fitting, SIGTERM asks the engine to stop at the next update (a flag only:
        nothing else is safe in a handler). The previous handler is restored afterwards; a
        SIGTERM that came too late for fit to act on is then delivered to it."""
        state = _Sigterm()
        if not self.config.stop_on_sigterm:
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
            state.received = True
            self.engine.request_stop()

        previous = signal.signal(signal.SIGTERM, request_stop)
        state.installed = True
        acted = False
        try:
            yield state
        except Preempted:
            acted = True
            raise
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self.engine._stop_requested = False
            if state.received and not acted:
                signal.raise_signal(signal.SIGTERM)

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (every rank calls this at the same point)."""
        if self.world == 1:
            return flag
        t = torch.tensor([float(flag)], device=self.engine.device)
        dist.all_reduce(t)
        return bool(t.item() > 0)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config.checkpoint_dir or Path(self.config.run_dir) / "checkpoints")

    def save(self, position: dict[str, Any], *, async_: bool = False) -> Path:
        """Checkpoint the engine plus where the loop is, for an exact resume. With `async_`
        the files are written in the background (DCP's async_save) and the checkpoint is
        complete only once `wait_for_checkpoint()` (or the next save) has finished it."""
        from shardwise.checkpoint import save_checkpoint

        state = {**position, "seed": self.config.seed}
        where, keep = self.checkpoint_dir, self.config.keep_last
        if async_:
            pending = save_checkpoint(
                where, self.engine, keep_last=keep, runner_state=state, async_=True
            )
            return pending.path
        return save_checkpoint(where, self.engine, keep_last=keep, runner_state=state)

    # --- start: checks, resume, logger ----------------------------------------------------

    def _preflight(self) -> None:
        """Once per Runner, on every rank, before anything is written: look for an earlier
        run in run_dir (rank 0) and probe the directories for writing. Every rank gets
        every rank's findings (one all-gather), so all raise or none does."""
        if self._checked:
            return
        self._checked = True
        cfg = self.config
        existing, problems = "", []
        if self.rank == 0:
            existing = self._earlier_run()
            problems += _probe(Path(cfg.run_dir), f"RunnerConfig.run_dir={cfg.run_dir!r}")
        if cfg.save_every or cfg.save_at_end:
            setting = (
                f"RunnerConfig.checkpoint_dir={cfg.checkpoint_dir!r}"
                if cfg.checkpoint_dir
                else f"RunnerConfig.checkpoint_dir=None (RUN_DIR/checkpoints = "
                f"'{self.checkpoint_dir}')"
            )
            problems += _probe(self.checkpoint_dir, setting)
        found: list[Any] = [(existing, problems)]
        if self.world > 1:
            found = [None] * self.world
            dist.all_gather_object(found, (existing, problems))
        self._existing_run = found[0][0]
        bad = [
            f"{p} (rank {r})" if self.world > 1 else p
            for r, (_, mine) in enumerate(found)
            for p in mine
        ]
        if bad:
            raise ValueError(
                f"Runner: cannot write where this run writes: {'; '.join(bad)}. Choose "
                "directories this process can create and write, or fix their permissions. "
                "Nothing was trained."
            )

    def _earlier_run(self) -> str:
        """The refusal for a fresh run over an earlier one ('' when run_dir is unused)."""
        from shardwise.checkpoint import list_checkpoints

        cfg = self.config
        found = []
        if self.checkpoint_dir.is_dir():
            saved = [c for c in list_checkpoints(self.checkpoint_dir) if c.complete]
            if saved:
                found.append(
                    f"{len(saved)} checkpoint(s) in {self.checkpoint_dir}, the newest "
                    f"{saved[-1].path.name}"
                )
        run_dir = Path(cfg.run_dir)
        if (run_dir / METRICS_FILE).is_file():
            found.append(f"metrics in {run_dir / METRICS_FILE}")
        board = run_dir / "tensorboard"
        if board.is_dir() and any(board.rglob("events.out.tfevents*")):
            found.append(f"TensorBoard events in {board}")
        if not found:
            return ""
        return (
            f"Runner.fit(): RunnerConfig.run_dir={cfg.run_dir!r} already holds a run "
            f"({'; '.join(found)}) and RunnerConfig.resume=None starts a fresh one, which "
            "would overwrite it. Set resume='latest' to continue that run, or choose a new "
            "run_dir to start over. Nothing was changed."
        )

    def _start_logger(self) -> None:
        """Open the metrics files: appended to, or (resuming) cut after the resumed step."""
        if self.logger.started:
            return
        keep = None
        if self.config.resume is not None:
            keep = self.engine.step if self._resumed else self._step_to_resume()
        self.logger.start(keep_until_step=keep)

    def _resume_target(self) -> str | None:
        """The checkpoint (or root) `config.resume` continues from; None: a fresh start."""
        from shardwise.checkpoint import list_checkpoints

        resume = self.config.resume
        if resume != "latest":
            return resume
        root = self.checkpoint_dir
        if not root.is_dir() or not any(c.complete for c in list_checkpoints(root)):
            return None  # nothing saved yet: a fresh start (preemptible jobs rerun as is)
        return str(root)

    def _step_to_resume(self) -> int:
        """The step `resume` will restore, read ahead (for validate() before fit())."""
        from shardwise.checkpoint import CheckpointError, read_manifest

        target = self._resume_target()
        try:
            return int(read_manifest(target)["step"]) if target is not None else 0
        except (CheckpointError, KeyError, ValueError):
            return 0  # fit() will report it

    def _resume(self) -> tuple[int, int]:
        """(epoch, samples each rank skips in it) after restoring `config.resume`, or (0, 0)."""
        from shardwise.checkpoint import CheckpointError, load_checkpoint

        self._resumed = True
        target = self._resume_target()
        if target is None:
            return 0, 0
        manifest = load_checkpoint(target, self.engine)
        position = manifest.get("runner") or {}
        if not position:
            raise CheckpointError(
                f"{target} was saved by save_checkpoint outside a Runner: it has no loop "
                "position to resume from. Load it with load_checkpoint() instead."
            )
        self._set_aside_newer()
        return self._map_position(position, int(manifest.get("world_size", self.world)))

    def _set_aside_newer(self) -> None:
        """Checkpoints in checkpoint_dir newer than the resumed step belong to a future this
        run abandons: move them aside (never delete), so saves do not collide with them."""
        from shardwise import checkpoint

        root, step = self.checkpoint_dir, self.engine.step
        set_aside = getattr(checkpoint, "set_aside_newer", None)
        if set_aside is not None:
            set_aside(root, step)
            return
        newer = root.is_dir() and any(c.step > step for c in checkpoint.list_checkpoints(root))
        if newer:  # same listing, same verdict on every rank
            raise NotImplementedError(
                f"Runner: resumed at step {step} but {root} holds newer checkpoints, and this "
                "shardwise has no checkpoint.set_aside_newer to move them aside; saving would "
                "collide with them. Move the newer step_* directories out of the way."
            )

    def _map_position(self, position: dict[str, Any], saved_world: int) -> tuple[int, int]:
        """(epoch, samples to skip per rank) for the saved position at this world size."""
        epoch, done, total = position["epoch"], position["batches_done"], position["total_batches"]
        if done >= total:
            return epoch + 1, 0
        batch = (self.train_loader.batch_size if self.train_loader else None) or 1
        world = int(position.get("world_size", saved_world))
        saved_batch = int(position.get("batch_size", batch))  # older checkpoints: unchanged
        consumed = int(position.get("samples_done", done * saved_batch * world))
        if (world, saved_batch) == (self.world, batch):
            return epoch, consumed // world
        if consumed % self.world:
            fits = [d for d in range(1, min(consumed, 64) + 1) if consumed % d == 0]
            raise ValueError(
                f"RunnerConfig.resume={self.config.resume!r}: the checkpoint was saved by "
                f"{world} rank(s) {consumed} samples into epoch {epoch} ({done} batch(es) of "
                f"{saved_batch} per rank). {consumed} does not split evenly over this world "
                f"size {self.world}, so the ranks cannot continue exactly where it stopped "
                "(an uneven split would train a sample twice, skip one, or give ranks unequal "
                f"batch counts). Resume at a world size dividing {consumed} (e.g. {fits}), "
                "or from a checkpoint saved at the end of an epoch."
            )
        skip = consumed // self.world
        sampler = self.train_loader.sampler if self.train_loader else None
        per_rank = int(getattr(sampler, "num_samples", skip + 1))
        _say(
            f"resuming at world size {self.world} ({batch} per rank and batch) from a "
            f"checkpoint saved at world size {world} ({saved_batch} per rank and batch): epoch "
            f"{epoch} continues after the {consumed} samples it consumed, each rank skipping "
            f"{skip}. RNG states are restored only at the saving world size."
        )
        return (epoch + 1, 0) if skip >= per_rank else (epoch, skip)

    def _log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        self.logger.log(row)

    def validate(self) -> dict[str, float]:
        """Mean metrics over the validation data, averaged over all ranks' samples."""
        return self._evaluate(self.val_loader, "val", self.engine.val_step)

    def test(self) -> dict[str, float]:
        """Mean metrics over the test data, averaged over all ranks' samples."""
        result = self._evaluate(self.test_loader, "test", self.engine.test_step)
        self.logger.close()
        return result

    def _evaluate(
        self, loader: DataLoader[Any] | None, split: str, step: Callable[[Any], Any]
    ) -> dict[str, float]:
        if loader is None:
            raise ValueError(
                f"Runner.{'validate' if split == 'val' else 'test'}() needs {split}_data."
            )
        self._preflight()
        self._start_logger()
        sums: dict[str, float] = {}
        count = 0
        for i, batch in enumerate(loader):
            if self.config.val_batches is not None and i >= self.config.val_batches:
                break
            outputs = step(batch)
            metrics = self.evaluate(outputs, batch) if self.evaluate else _loss_metrics(outputs)
            samples = _count(batch)[0] or 1
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * samples
            count += samples
        keys = sorted(sums)
        totals = torch.tensor([sums[k] for k in keys] + [float(count)], dtype=torch.float64)
        if self.world > 1:
            moved = totals.to(self.engine.device)
            dist.all_reduce(moved)
            totals = moved.cpu()
        result = {k: float(totals[i] / max(float(totals[-1]), 1.0)) for i, k in enumerate(keys)}
        row = {"step": self.engine.step, "split": split, **result}
        self._log(row)
        return result


def _loss_metrics(outputs: Any) -> dict[str, float]:
    try:
        _, logs = parse_losses(outputs)
    except (TypeError, ValueError):
        return {}
    return {k: float(v) for k, v in logs.items()}


@dataclass
class _Sigterm:
    installed: bool = False
    received: bool = False


def _checkpoint_name(step: int) -> str:
    from shardwise.checkpoint import checkpoint_name

    return checkpoint_name(step)


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


class _ResumableSampler(DistributedSampler):
    """DistributedSampler that can start its next epoch a number of samples in (resume)."""

    skip = 0

    def __iter__(self) -> Any:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)

    def __len__(self) -> int:
        return int(super().__len__()) - self.skip


class _Window:
    """Samples, tokens and time of one optimizer step's micro-batches."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.samples = self.tokens = 0
        self.start = time.perf_counter()

    def add(self, batch: Any) -> None:
        samples, tokens = _count(batch)
        self.samples += samples
        self.tokens += tokens

    def close(
        self, logs: dict[str, float], world: int, device: torch.device, step: int, epoch: int
    ) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        row: dict[str, Any] = {"step": step, "split": "train", "epoch": epoch, **logs}
        row["samples_per_s"] = self.samples * world / elapsed
        if self.tokens:
            row["tokens_per_s"] = self.tokens * world / elapsed
        row["peak_mem_mb"] = _peak_memory_mb(device)
        self.restart()
        return row


class _Progress:
    """A rich progress bar on rank 0; nothing anywhere else."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self._bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            # Not a terminal (CI, a pipe): rich would assume 80 columns and cut the stats.
            console=Console(file=sys.stderr, width=None if sys.stderr.isatty() else 160),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=total, stats="")
        self._bar.start()

    def update(self, row: dict[str, Any]) -> None:
        if self._bar is None:
            return
        rate = (
            f"{row['tokens_per_s']:,.0f} tok/s"
            if "tokens_per_s" in row
            else f"{row['samples_per_s']:,.1f} samples/s"
        )
        stats = (
            f"loss {row.get('loss', float('nan')):.4f}  lr {row.get('lr', 0.0):.2e}  "
            f"gnorm {row.get('grad_norm', float('nan')):.3f}  {rate}  "
            f"mem {row['peak_mem_mb']:,.0f} MB"
        )
        self._bar.update(self._task, completed=row["step"], stats=stats)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
