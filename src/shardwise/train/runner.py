"""Loops around the engine: epochs or steps, validation, checkpoints, logs, progress.

Owns: the training loop (accumulation windows, a partial window at the end of an epoch
still updating with the micro-batches it has, validation every N steps, periodic and final
checkpoints, the scheduler through the engine), validation and test averaged over all
ranks' samples, and metrics rows (CSV always, TensorBoard when installed). Rank 0 prints;
other ranks print nothing. Per-rank data is train/data.py; refusing to overwrite a run,
resuming and preemption are train/resume.py; the progress bar is train/progress.py.

Resume is exact (same losses, bit for bit, on CPU in fp32): the loop position, each rank's
RNG states and all engine state are restored, and the loaders draw from their own
generators. With `num_workers > 0`, worker seeds after a resume differ from an
uninterrupted run, so random augmentations inside workers are not reproduced. RNG states
are restored only at the saving world size. The checkpoints of an adapter model hold its
adapters and their optimizer state only (`save_adapters_only`); resuming one needs the
same base, built again by the script, and restores the rest exactly as above.

A run directory belongs to one run: `fit` without `resume` refuses, on every rank and
before writing anything, a run_dir that holds metrics or a checkpoint_dir that holds
checkpoints; the run and checkpoint directories are probed for writing before the first
step.

Must not: compute gradients or talk to the model directly (the engine does).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shardwise.checkpoint.async_save import wait_for_checkpoint
from shardwise.checkpoint.layout import checkpoint_name
from shardwise.checkpoint.save import save_checkpoint
from shardwise.config.training import RunnerConfig
from shardwise.distributed.process_group import rank_and_world
from shardwise.distributed.watchdog import guard
from shardwise.distributed.worker_errors import refused
from shardwise.parallelize.from_env import translation_from_env
from shardwise.parallelize.wrapped import wrap_info
from shardwise.train.data import ResumableSampler, make_loader
from shardwise.train.engine import Engine
from shardwise.train.losses import VIS_KEYS, parse_losses
from shardwise.train.metrics import MetricsLogger
from shardwise.train.packing import packed_attention_notice
from shardwise.train.progress import Progress, Window, count_batch, say
from shardwise.train.resume import (
    Preempted,
    any_rank,
    keep_earlier_export,
    preflight,
    resume,
    saved_runner_fields,
    saves_adapters_only,
    sigterm_requests_stop,
    step_to_resume,
)
from shardwise.train.resume import checkpoint_dir as _checkpoint_dir
from shardwise.train.stream import StreamLoader, micro_batches

EvaluateFn = Callable[[Any, Any], dict[str, float]]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA): same seed and world size, same run."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _data_parallel(engine: Engine, rank: int, world: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel ranks): under tensor
    parallelism the ranks of one tp group read the same part of each batch, under context
    parallelism those of one cp group (each attends to its part of the sequence), and under
    pipeline parallelism the stages of one pipeline do."""
    info = wrap_info(engine.model)
    spec = info.mesh_spec if info is not None else None
    if info is not None and spec is not None and (spec.tp > 1 or spec.pp > 1 or spec.cp > 1):
        return info.dp_rank, info.dp_size
    return rank, world


def _refuse_short_batches(engine: Engine, *loaders: DataLoader[Any] | None) -> None:
    """Under pipeline stages every batch must have one shape (the schedule sizes what it
    sends at its first step): a loader whose last batch is short is refused here, before
    any step, with the fix."""
    info = wrap_info(engine.model)
    if info is None or info.stages is None:
        return
    for name, loader in zip(("train_data", "val_data", "test_data"), loaders, strict=True):
        if isinstance(loader, StreamLoader):
            continue  # a stream's batches are always full
        if loader is None or loader.drop_last or loader.batch_size is None:
            continue
        per_rank = len(loader.sampler)  # type: ignore[arg-type]  # shardwise's own sampler
        if per_rank % loader.batch_size:
            raise refused(  # the user's setting: one line from `shardwise run`
                ValueError(
                    f"Runner({name}=...) with ParallelConfig.pp={info.stages.degree}: each "
                    f"data-parallel rank reads {per_rank} sample(s) in batches of "
                    f"{loader.batch_size}, so its last batch is short, and under pipeline stages "
                    "every batch must have one shape. Set RunnerConfig.drop_last=True (or "
                    "drop_last=True on your DataLoader), or a batch size that divides "
                    f"{per_rank}."
                )
            )


def _total_steps(config: RunnerConfig, batches_per_epoch: int | None, accumulate_steps: int) -> int:
    """The optimizer steps the run is to take (for the progress bar): max_steps, or
    max_epochs' worth at this world's batches per epoch, whichever comes first (a stream's
    epoch has no known length: max_steps, or 0 for unknown)."""
    total = config.max_steps or 0
    if config.max_epochs is not None and batches_per_epoch is not None:
        by_epochs = math.ceil(batches_per_epoch / accumulate_steps) * config.max_epochs
        total = min(total, by_epochs) if total else by_epochs
    return total


def _say_what_ended(
    config: RunnerConfig,
    engine: Engine,
    epochs: int,
    batches_per_epoch: int | None,
    dp_world: int,
) -> str:
    """The limit that ended training ('max_steps=8' or 'max_epochs=1'), said by rank 0 in
    one line. Whichever of the two comes first ends it, and an epoch's steps depend on the
    data-parallel ranks: a max_steps that max_epochs cut short is named with both."""
    done = engine.step + engine.skipped_steps
    if config.max_steps is not None and done >= config.max_steps:
        ended = f"max_steps={config.max_steps}"
        say(f"finished after optimizer step {engine.step}: {ended} reached")
        return ended
    ended = f"max_epochs={config.max_epochs}"
    short = f", before max_steps={config.max_steps}" if config.max_steps is not None else ""
    if batches_per_epoch is None:
        epoch = "an epoch reads the stream once, until a rank runs out"
    else:
        per_epoch = math.ceil(batches_per_epoch / engine.train_config.accumulate_steps)
        epoch = f"an epoch is {per_epoch} optimizer step(s) at {dp_world} data-parallel rank(s)"
    say(
        f"finished after optimizer step {engine.step}: {ended} reached{short} ({epoch}; "
        "max_epochs=None trains until max_steps)"
    )
    return ended


def _stream_epoch_end(epoch: int, step: int) -> str:
    """What ended a stream's epoch, and what it left untrained (said once, by rank 0)."""
    return (
        f"epoch {epoch} of the stream ended after optimizer step {step}: a data-parallel rank "
        "could not fill its next step, so the rows the other parts still held (up to one "
        "step's, and more where parts differ in length) are not trained this epoch. Parts "
        "of equal length lose least: more documents per part, or shards of equal size."
    )


def _timer_due(config: RunnerConfig, since: float) -> bool:
    """Whether `save_every_minutes` have passed on this rank's clock since the last save.
    Clocks differ between ranks: a rank that is due asks the Engine to save
    (`request_save`), and the request rides on the update's own all-reduce, so all ranks
    save after the same update (any rank due: all save) and the timer costs no collective
    or host sync of its own."""
    minutes = config.save_every_minutes
    return minutes is not None and time.monotonic() - since >= 60 * minutes


def _launched_runner() -> RunnerConfig:
    """The runner values of the file `shardwise run --from` launched the script with (its
    micro-batch, a torchtitan file's steps), else the defaults."""
    launched = translation_from_env()
    return launched.config.runner if launched is not None else RunnerConfig()


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
        self.config = config or _launched_runner()
        self.rank, self.world = rank_and_world()
        self.dp_rank, self.dp_world = _data_parallel(engine, self.rank, self.world)
        self.evaluate = evaluate
        cfg, rank, world = self.config, self.dp_rank, self.dp_world  # the sampler's split
        pin = engine.device.type == "cuda"  # pinned batches copy to a GPU asynchronously
        kw: dict[str, Any] = {"pin_memory": pin, "device": engine.device}
        train = make_loader(train_data, "train_data", cfg.shuffle, cfg, rank, world, **kw)
        self.train_loader = train
        self.val_loader = make_loader(val_data, "val_data", False, cfg, rank, world, **kw)
        self.test_loader = make_loader(test_data, "test_data", False, cfg, rank, world, **kw)
        _refuse_short_batches(engine, self.train_loader, self.val_loader, self.test_loader)
        self.logger = MetricsLogger(
            self.config.run_dir, enabled=self.rank == 0, tensorboard=self.config.tensorboard
        )
        self.history: list[dict[str, Any]] = []
        self._checked = False
        self._existing_run = ""  # what run_dir held before this Runner wrote (rank 0's view)
        self._resumed = False
        self.adapters_only = saves_adapters_only(self.config, engine.model)  # what save() keeps

    # --- loops ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until max_epochs or max_steps; validate as configured. Returns a summary.

        Raises `Preempted` (exit code 75) on every rank after saving, when SIGTERM came
        and `stop_on_sigterm` is set."""

        if self.train_loader is None:
            raise ValueError("Runner.fit() needs train_data.")
        cfg, engine = self.config, self.engine
        self._preflight()
        if cfg.resume is None and self._existing_run:
            raise ValueError(self._existing_run)  # the same verdict on every rank
        if self.adapters_only and (cfg.save_every or cfg.save_at_end):
            say("checkpoints hold the adapters and their optimizer state, not the frozen base")
        seed_everything(cfg.seed)
        self._resumed = True
        configured = engine.train_config.accumulate_steps  # before a resume may change it
        epoch, skip = resume(cfg, engine, self.train_loader, self.dp_world)
        per_epoch = self._batches_per_epoch()
        total = _total_steps(cfg, per_epoch, engine.train_config.accumulate_steps)
        loader = self.train_loader
        if isinstance(loader, StreamLoader) and loader.spec.packing is not None:
            notice = packed_attention_notice(engine.model)  # on every rank: it may set use_cache
            if notice:
                say(notice)
        step_limit = cfg.max_steps or math.inf
        if cfg.resume is not None and self.rank == 0:
            keep_earlier_export(cfg)  # a resumed or restarted run exports anew at its end
        self._start_logger()
        progress = Progress(total, enabled=cfg.progress and self.rank == 0)
        sampler = getattr(self.train_loader, "sampler", None)
        batch = self.train_loader.batch_size or 1
        window = Window()
        saved_at = engine.step if cfg.resume else -1
        position: dict[str, Any] | None = None
        start, last_save = time.perf_counter(), time.monotonic()
        last_train: dict[str, Any] = {}
        last_val: dict[str, float] = {}
        stop = False
        try:
            with sigterm_requests_stop(engine, cfg) as sigterm:
                # Epochs bound the loop by epochs, not by `total`: after a resume at another
                # world or batch size, an epoch has another number of steps.
                while (
                    engine.step + engine.skipped_steps < step_limit
                    and (cfg.max_epochs is None or epoch < cfg.max_epochs)
                    and not stop
                ):
                    if isinstance(sampler, DistributedSampler):
                        sampler.set_epoch(epoch)
                    if isinstance(sampler, ResumableSampler):
                        sampler.skip = skip
                    # The segment of the epoch this pass trains starts skip*world samples in.
                    offset, consumed, skip = skip // batch, skip * self.dp_world, 0
                    n = per_epoch
                    window.restart()
                    for i, (data, last, weight) in enumerate(
                        micro_batches(self.train_loader, engine, epoch, window, self.dp_world)
                    ):
                        window.add(data)
                        if _timer_due(cfg, last_save):
                            engine.request_save()
                        # A collective that times out here names the rank that never came.
                        with guard(f"train step {engine.step + engine.skipped_steps + 1}"):
                            logs = engine.train_step(data, force_update=last, loss_weight=weight)
                        if "grad_norm" not in logs:
                            continue
                        stop = logs.pop("stop", 0.0) > 0
                        logs = {k: v for k, v in logs.items() if k not in VIS_KEYS}
                        done = engine.step + engine.skipped_steps
                        # Where the loop stands after this update: what a resume needs (a
                        # stream's parts are gathered from every rank when it saves).
                        position = {"epoch": epoch, "stream": True} if n is None else {
                            "epoch": epoch,
                            "batches_done": offset + i + 1,
                            "total_batches": offset + n,
                            "samples_done": consumed + (i + 1) * batch * self.dp_world,
                        }  # fmt: skip
                        position |= {
                            "world_size": self.dp_world,
                            "batch_size": batch,
                            "accumulate_steps": engine.train_config.accumulate_steps,
                            "accumulate_configured": configured,
                        }
                        row = window.close(logs, self.dp_world, engine.device, done, epoch)
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
                        if engine.save_requested or (cfg.save_every and done % cfg.save_every == 0):
                            self.save(position, async_=cfg.async_save)
                            saved_at, last_save = engine.step, time.monotonic()
                            window.restart()
                        if done >= step_limit and (n is None or i < n - 1):
                            break  # max_steps reached inside the epoch
                    else:
                        if n is None:
                            say(_stream_epoch_end(epoch, engine.step))
                        epoch += 1
                        if cfg.val_every is None and self.val_loader is not None:
                            last_val = self.validate()
                        continue
                    break
                if not stop and sigterm.installed:
                    # A SIGTERM after the last update (during validation, say) counts too.
                    stop = any_rank(sigterm.received, self.world, engine.device)
                if stop and position is not None:
                    path = self.checkpoint_dir / checkpoint_name(engine.step)
                    if saved_at != engine.step:
                        path = self.save(position)
                    wait_for_checkpoint()  # an async save of this very step completes first
                    preempted = Preempted(engine.step, path, sigterm.signum)
                    say(str(preempted))
                    raise preempted
            if cfg.save_at_end and position is not None and saved_at != engine.step:
                self.save(position)
            # An asynchronous save still being written completes here (every rank; not in
            # `finally`: after an error some ranks may never arrive).
            wait_for_checkpoint()
        finally:
            progress.close()
            self.logger.close()
        ended_by = _say_what_ended(cfg, engine, epoch, per_epoch, self.dp_world)
        return {
            "steps": engine.step, "skipped_steps": engine.skipped_steps, "epochs": epoch,
            "ended_by": ended_by, "train": last_train, "val": last_val,
            "seconds": time.perf_counter() - start, "run_dir": str(Path(cfg.run_dir)),
        }  # fmt: skip

    def _batches_per_epoch(self) -> int | None:
        """This rank's batches in an epoch (None for a stream: unknown until it ends)."""
        loader = self.train_loader
        return None if isinstance(loader, StreamLoader) or loader is None else len(loader)

    @property
    def checkpoint_dir(self) -> Path:
        return _checkpoint_dir(self.config)

    def save(self, position: dict[str, Any], *, async_: bool = False) -> Path:
        """Checkpoint the engine plus where the loop is, for an exact resume (of an adapter
        model, its adapters only: `adapters_only`). With `async_` the files are written in
        the background (DCP's async_save) and the checkpoint is complete only once
        `wait_for_checkpoint()` (or the next save) has finished it."""

        state = {**position, "seed": self.config.seed, "config": saved_runner_fields(self.config)}
        if isinstance(self.train_loader, StreamLoader) and "stream" in position:
            state["stream"] = self.train_loader.state_dict()  # every rank's parts
        where, keep, only = self.checkpoint_dir, self.config.keep_last, self.adapters_only
        if async_:
            pending = save_checkpoint(
                where, self.engine, keep_last=keep, runner_state=state, adapters_only=only,
                async_=True,
            )  # fmt: skip
            return pending.path
        return save_checkpoint(
            where, self.engine, keep_last=keep, runner_state=state, adapters_only=only
        )

    # --- start: checks, resume, logger ----------------------------------------------------

    def _preflight(self) -> None:
        """Once per Runner, on every rank, before anything is written (see resume.preflight)."""
        if not self._checked:
            self._checked = True
            self._existing_run = preflight(self.config, self.rank, self.world)

    def _start_logger(self) -> None:
        """Open the metrics files: appended to, or (resuming) cut after the resumed step."""
        if self.logger.started:
            return
        keep = None
        if self.config.resume is not None:
            keep = self.engine.step if self._resumed else step_to_resume(self.config)
        self.logger.start(keep_until_step=keep)

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
        result = _mean_metrics(loader, step, self.evaluate, self.config.val_batches,
                               self.engine.device)  # fmt: skip
        self._log({"step": self.engine.step, "split": split, **result})
        return result


def _mean_metrics(
    loader: Any,
    step: Callable[[Any], Any],
    evaluate: EvaluateFn | None,
    limit: int | None,
    device: torch.device,
) -> dict[str, float]:
    """Metrics averaged over every rank's samples (at most `limit` batches a rank); a
    stream is read from its start, in step on every rank."""
    sums: dict[str, float] = {}
    count = 0
    if isinstance(loader, StreamLoader):
        loader.restart()
    batches = loader.batches(0, 1) if isinstance(loader, StreamLoader) else loader
    for i, batch in enumerate(batches):
        if limit is not None and i >= limit:
            break
        outputs = step(batch)
        metrics = evaluate(outputs, batch) if evaluate else _loss_metrics(outputs)
        samples = count_batch(batch)[0] or 1
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * samples
        count += samples
    keys = sorted(sums)
    totals = torch.tensor([sums[k] for k in keys] + [float(count)], dtype=torch.float64)
    if rank_and_world()[1] > 1:
        moved = totals.to(device)
        dist.all_reduce(moved)
        totals = moved.cpu()
    return {k: float(totals[i] / max(float(totals[-1]), 1.0)) for i, k in enumerate(keys)}


def _loss_metrics(outputs: Any) -> dict[str, float]:
    try:
        _, logs = parse_losses(outputs)
    except (TypeError, ValueError):
        return {}
    return {k: float(v) for k, v in logs.items()}
