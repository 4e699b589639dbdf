"""Stepping and looping: the Engine's steps and the Runner's loops around them.

engine.py (train/val/test steps, accumulation, clipping, loss scaling), nonfinite.py
(NaN/inf on any rank), optim.py (optimizers built after wrapping, mmengine's OptimWrapper),
muon.py and muon_comm.py (Muon on whole matrices under every layout),
losses.py (the loss contract), runner.py (the loop) with data.py (per-rank data),
resume.py (resume and preemption) and progress.py (the progress bar), stream.py and
packing.py (streamed data, packed documents), metrics.py and
plot.py (what a run writes and draws).
"""

from shardwise.config.training import RunnerConfig, TrainConfig
from shardwise.train.engine import MODES, Engine, clip_grad_norm_, total_grad_norm
from shardwise.train.losses import VIS_KEYS, model_parse_losses, parse_losses, split_outputs
from shardwise.train.metrics import METRICS_FILE, MetricsLogger, read_metrics
from shardwise.train.muon import Muon
from shardwise.train.nonfinite import NonFiniteError
from shardwise.train.optim import (
    OptimizerFactory,
    OptimWrapperLike,
    SchedulerFactory,
    SchedulerLike,
    WrapperSettings,
    build_optimizer,
    build_scheduler,
    check_hyperparameters,
    is_optim_wrapper,
    read_optim_wrapper,
)
from shardwise.train.packing import PackedStream, pack
from shardwise.train.plot import plot_run
from shardwise.train.resume import PREEMPTED_EXIT_CODE, Preempted
from shardwise.train.runner import EvaluateFn, Runner, seed_everything

__all__ = [
    "METRICS_FILE",
    "MODES",
    "PREEMPTED_EXIT_CODE",
    "VIS_KEYS",
    "Engine",
    "EvaluateFn",
    "MetricsLogger",
    "Muon",
    "NonFiniteError",
    "OptimWrapperLike",
    "OptimizerFactory",
    "PackedStream",
    "Preempted",
    "Runner",
    "RunnerConfig",
    "SchedulerFactory",
    "SchedulerLike",
    "TrainConfig",
    "WrapperSettings",
    "build_optimizer",
    "build_scheduler",
    "check_hyperparameters",
    "clip_grad_norm_",
    "is_optim_wrapper",
    "model_parse_losses",
    "pack",
    "parse_losses",
    "plot_run",
    "read_metrics",
    "read_optim_wrapper",
    "seed_everything",
    "split_outputs",
    "total_grad_norm",
]
