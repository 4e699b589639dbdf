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
uninterrupted run, so random augmentations inside workers are not reproduced.

Must not: compute gradients or talk to the model directly (the engine does).
"""

from __future__ import annotations

import math
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from shardwise.distributed import rank_and_world
from shardwise.engine import VIS_KEYS, Engine, parse_losses
from shardwise.metrics import MetricsLogger

EvaluateFn = Callable[[Any, Any], dict[str, float]]


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
    is none) or a checkpoint path to continue from."""

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
        """Train until max_epochs or max_steps; validate as configured. Returns a summary."""
        if self.train_loader is None:
            raise ValueError("Runner.fit() needs train_data.")
        cfg, engine = self.config, self.engine
        seed_everything(cfg.seed)
        k = engine.train_config.accumulate_steps
        steps_per_epoch = math.ceil(len(self.train_loader) / k)
        total = cfg.max_steps or 0
        if cfg.max_epochs is not None:
            by_epochs = steps_per_epoch * cfg.max_epochs
            total = min(total, by_epochs) if total else by_epochs
        epoch, skip_batches = self._resume()
        self.logger.start(keep_until_step=engine.step if cfg.resume else None)
        progress = _Progress(total, enabled=cfg.progress and self.rank == 0)
        sampler = self.train_loader.sampler
        window = _Window()
        saved_at = engine.step if cfg.resume else -1
        position: dict[str, Any] | None = None
        start = time.perf_counter()
        last_train: dict[str, Any] = {}
        last_val: dict[str, float] = {}
        try:
            while engine.step + engine.skipped_steps < total:
                if isinstance(sampler, DistributedSampler):
                    sampler.set_epoch(epoch)
                if isinstance(sampler, _ResumableSampler) and skip_batches:
                    sampler.skip = skip_batches * (self.train_loader.batch_size or 1)
                offset, skip_batches = skip_batches, 0
                n = len(self.train_loader)
                window.restart()
                for i, batch in enumerate(self.train_loader):
                    window.add(batch)
                    logs = engine.train_step(batch, force_update=i == n - 1)
                    if "grad_norm" not in logs:
                        continue
                    logs = {k: v for k, v in logs.items() if k not in VIS_KEYS}
                    done = engine.step + engine.skipped_steps
                    # Where the loop stands after this update: what a resume needs.
                    position = {
                        "epoch": epoch,
                        "batches_done": offset + i + 1,
                        "total_batches": offset + n,
                    }
                    row = window.close(logs, self.world, engine.device, done, epoch)
                    last_train = row
                    if done % cfg.log_every == 0 or done == total:
                        self._log(row)
                    progress.update(row)
                    if cfg.val_every and self.val_loader is not None and done % cfg.val_every == 0:
                        last_val = self.validate()
                        window.restart()  # validation time is not training throughput
                    if cfg.save_every and done % cfg.save_every == 0:
                        self.save(position)
                        saved_at = engine.step
                        window.restart()
                    if done >= total and i < n - 1:
                        break  # max_steps reached inside the epoch
                else:
                    epoch += 1
                    if cfg.val_every is None and self.val_loader is not None:
                        last_val = self.validate()
                    continue
                break
            if cfg.save_at_end and position is not None and saved_at != engine.step:
                self.save(position)
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

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config.checkpoint_dir or Path(self.config.run_dir) / "checkpoints")

    def save(self, position: dict[str, Any]) -> Path:
        """Checkpoint the engine plus where the loop is, for an exact resume."""
        from shardwise.checkpoint import save_checkpoint

        state = {**position, "seed": self.config.seed}
        return save_checkpoint(
            self.checkpoint_dir, self.engine, keep_last=self.config.keep_last, runner_state=state
        )

    def _resume(self) -> tuple[int, int]:
        """(epoch, batches to skip in it) after restoring `config.resume`, or (0, 0)."""
        from shardwise.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

        resume = self.config.resume
        if resume is None:
            return 0, 0
        if resume == "latest":
            root = self.checkpoint_dir
            if not root.is_dir() or not any(c.complete for c in list_checkpoints(root)):
                return 0, 0  # nothing saved yet: a fresh start (preemptible jobs rerun as is)
            resume = str(root)
        manifest = load_checkpoint(resume, self.engine)
        position = manifest.get("runner") or {}
        if not position:
            raise CheckpointError(
                f"{resume} was saved by save_checkpoint outside a Runner: it has no loop "
                "position to resume from. Load it with load_checkpoint() instead."
            )
        epoch, done, total = position["epoch"], position["batches_done"], position["total_batches"]
        return (epoch + 1, 0) if done >= total else (epoch, done)

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
