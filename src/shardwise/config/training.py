"""How training steps and loops are configured: TrainConfig and RunnerConfig.

Owns: the two dataclasses the Engine and the Runner read, and their validation. They live
here, beside ParallelConfig, so the run file (config/run_file.py) can be read without
importing any training code.

Must not: import torch.distributed, read the environment, or hold loop logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

NonFinitePolicy = Literal["stop", "skip"]
"""What `TrainConfig.on_nonfinite` does with a NaN/inf loss or gradient norm."""
LossOver = Literal["batches", "tokens"]
"""What `TrainConfig.loss_over` averages the loss over."""


@dataclass(kw_only=True)
class TrainConfig:
    """How `Engine.train_step` turns micro-batches into optimizer steps."""

    accumulate_steps: int = 1
    """Micro-batches per optimizer step; gradients synchronise on the last one only."""
    sync_each_microbatch: bool = False
    """Reduce gradients after every micro-batch: more communication, less memory (FSDP
    keeps sharded instead of full gradients between micro-batches)."""
    keep_frozen_gathered: bool = False
    """Under gradient accumulation on an FSDP strategy, gather each unit holding frozen
    parameters (an adapter model's base) once per optimizer step and keep it gathered until
    the window's last backward, instead of twice per micro-batch: fewer all-gathers, for
    the memory of those units' whole parameters."""
    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm (over all shards and replicas)."""
    grad_scaler: bool | None = None
    """Dynamic loss scaling; None turns it on for fp16 compute."""
    init_scale: float = 2.0**16
    """Initial loss scale when scaling is on."""
    detect_anomalous_params: bool = False
    """Debug: list trainable parameters that received no gradient in a step."""
    on_nonfinite: NonFinitePolicy = "stop"
    """A NaN/inf loss (keys containing 'loss') or gradient norm on any rank: 'stop' raises
    NonFiniteError on every rank; 'skip' drops that update on every rank (parameters and
    optimizer state unchanged, counted in skipped_steps) and warns. Under fp16 loss
    scaling, a step with inf/nan gradients stays the grad scaler's to skip (and back off);
    a non-finite loss with finite gradients is still caught."""
    loss_over: LossOver = "batches"
    """What the loss averages over in one optimizer step. 'batches': the mean of each
    micro-batch's loss over micro-batches and data-parallel ranks (a model's loss as it
    returns it). 'tokens': the mean over every token the step's labels predict, on all
    ranks: each micro-batch's loss (a mean over its own tokens, as a causal language
    model's is) is weighted by its share of the step's tokens, which the Runner counts
    (labels other than -100 after each row's first position) and sums across ranks before
    the step. Packed rows and padded batches hold unequal counts; 'tokens' trains them as
    one long batch would. Not built under pipeline or context parallelism."""

    def __post_init__(self) -> None:
        k = self.accumulate_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"TrainConfig.accumulate_steps={k!r} must be an int >= 1 (micro-batches per "
                "optimizer step; 1 means no accumulation)."
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"TrainConfig.max_grad_norm={self.max_grad_norm!r} must be > 0, or None to "
                "not clip."
            )
        if not self.init_scale > 0:
            raise ValueError(f"TrainConfig.init_scale={self.init_scale!r} must be > 0.")
        if self.on_nonfinite not in get_args(NonFinitePolicy):
            raise ValueError(
                f"TrainConfig.on_nonfinite={self.on_nonfinite!r} is not allowed. Choose 'stop' "
                "(raise on every rank) or 'skip' (drop that update on every rank)."
            )
        if self.loss_over not in get_args(LossOver):
            raise ValueError(
                f"TrainConfig.loss_over={self.loss_over!r} is not allowed. Choose 'batches' "
                "(each micro-batch's loss as the model returns it, averaged) or 'tokens' "
                "(every predicted token of the step weighs the same)."
            )


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
    """DataLoader worker processes for datasets (for a stream: a divisor of
    stream_parts / data-parallel ranks)."""
    stream_parts: int = 64
    """An IterableDataset (a stream) is cut into this many parts, dealt to the
    data-parallel ranks (train/stream.py): a multiple of every data-parallel world size the
    run may resume at. The global order of samples, and so training, is the same at every
    such world size and worker count. Saved with each checkpoint; a resume keeps it."""
    progress: bool = True
    """Show the progress bar on rank 0."""
    tensorboard: bool | None = None
    """Write TensorBoard scalars: None when installed, True to require it."""
    checkpoint_dir: str | None = None
    """Where checkpoints go (None: RUN_DIR/checkpoints)."""
    save_every: int | None = None
    """Save a checkpoint every N optimizer steps (None: never during training)."""
    save_every_minutes: float | None = None
    """Also save at the first optimizer step once this many minutes have passed since the
    last save (or the start): steps lost to a lost node stay bounded in time whatever a
    step takes. A rank whose clock is due asks through the step's own all-reduce, and
    every rank saves after that step: no collective or host sync of its own (None: no
    timer)."""
    save_at_end: bool = False
    """Save a checkpoint when training ends."""
    keep_last: int | None = None
    """Keep only the newest N complete checkpoints (None: keep all)."""
    save_adapters_only: bool | None = None
    """Checkpoints of an adapter model (peft's) hold only what trains: the adapters and
    their optimizer state, not the frozen base, which the script builds again to resume
    (the same base is checked on load). None: adapters only for an adapter model with a
    frozen base, the whole model otherwise; True: adapters only, and a model without
    adapters is an error when fit() starts; False: always the whole model."""
    resume: str | None = None
    """'latest' (the newest complete checkpoint in checkpoint_dir, or a fresh start when there
    is none) or a checkpoint path to continue from. None: a fresh run, refused when run_dir
    already holds metrics or checkpoint_dir holds checkpoints."""
    async_save: bool = False
    """Write `save_every` checkpoints in the background (DCP's async_save): training goes on
    while the files are written; each becomes complete (manifest, `latest`) when the next
    save starts or fit ends. Costs one CPU copy of this rank's state, kept between saves."""
    stop_on_sigterm: bool = True
    """On SIGTERM or SIGUSR1 (SLURM's warning before a time limit or preemption), or a first
    SIGINT (Ctrl-C), finish the current optimizer step, save a checkpoint and exit with code
    75 (all ranks at the same step); a second SIGINT stops at once, unsaved, naming the last
    good checkpoint (exit code 130). False leaves the three signals' handling as it was."""

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
        minutes = self.save_every_minutes
        if minutes is not None and (
            isinstance(minutes, bool)
            or not isinstance(minutes, (int, float))
            or not 0 < minutes < float("inf")
        ):
            raise ValueError(
                f"RunnerConfig.save_every_minutes={minutes!r} must be a positive number of "
                "minutes (e.g. 30) or None."
            )
        for name in ("batch_size", "log_every", "stream_parts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunnerConfig.{name}={value!r} must be a positive int.")
        if self.max_epochs is None and self.max_steps is None:
            raise ValueError(
                "RunnerConfig: max_epochs and max_steps are both None, so training would never "
                "stop. Set at least one of them."
            )
