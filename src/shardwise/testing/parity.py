"""Parity: does distributed training equal single-process training on the same global batch?

Owns: running a short training trajectory in one process (`train_reference`) and the
same trajectory under a `ParallelConfig` on every rank (`train_distributed`), and
comparing the two step by step (`compare_trajectories`). Users can run the same check
on their own model.

Must not: hide a mismatch. A comparison either passes within the stated tolerance or
raises `ParityError` naming the first step or parameter that diverged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config.parallel import ParallelConfig
from shardwise.parallelize.apply import wrap
from shardwise.parallelize.wrapped import unwrap

Batch = tuple[torch.Tensor, ...]
ModelFactory = Callable[[], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

default_optimizer: OptimizerFactory = functools.partial(torch.optim.AdamW, lr=1e-3)


class ParityError(AssertionError):
    """Distributed training diverged from the single-process reference."""


@dataclass
class Trajectory:
    """Loss at every step (before the update) and the final parameters, full and on CPU."""

    losses: list[float]
    params: dict[str, torch.Tensor] = field(repr=False)


def split_batch(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous slice of every tensor in the global batch (dim 0)."""
    n = batch[0].shape[0]
    if n % world_size:
        raise ValueError(
            f"global batch size {n} does not divide evenly over {world_size} ranks; parity "
            f"needs equal slices. Use a batch size that is a multiple of {world_size}."
        )
    per = n // world_size
    return tuple(t[rank * per : (rank + 1) * per] for t in batch)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered in full, fp32, on CPU, under the model's own names.

    Sharded (DTensor) parameters are all-gathered, so every rank must call this.
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in unwrap(model).named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().cpu().clone()
    return out


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    opt.step()
    return loss.detach()


def train_reference(
    build_model: ModelFactory,
    batches: Sequence[Batch],
    *,
    optimizer: OptimizerFactory = default_optimizer,
    seed: int = 0,
) -> Trajectory:
    """Train on each whole global batch in this one process (no process group needed)."""
    torch.manual_seed(seed)
    model = build_model()
    opt = optimizer(model.parameters())
    losses = [float(_step(model, opt, batch)) for batch in batches]
    return Trajectory(losses, full_parameters(model))


def train_distributed(
    build_model: ModelFactory,
    config: ParallelConfig,
    batches: Sequence[Batch],
    *,
    optimizer: OptimizerFactory = default_optimizer,
    seed: int = 0,
    shard_batch: Callable[[Batch, int, int], Batch] = split_batch,
    after_wrap: Callable[[nn.Module], None] | None = None,
) -> Trajectory:
    """Train the same steps under `config`, each rank on its slice; call on every rank.

    The reported loss is the mean of the ranks' losses, which equals the loss on the
    whole batch because the slices are equal. `shard_batch` and `after_wrap` exist so a
    test can build a deliberately wrong setup and watch the comparison fail.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = wrap(build_model(), config)
    if after_wrap is not None:
        after_wrap(model)
    opt = optimizer(model.parameters())
    device = next(iter(unwrap(model).parameters())).device
    losses = []
    for batch in batches:
        local = tuple(t.to(device) for t in shard_batch(batch, rank, world))
        loss = _step(model, opt, local).float().cpu()
        dist.all_reduce(loss)  # SUM; gloo has no AVG
        losses.append(float(loss) / world)
    return Trajectory(losses, full_parameters(model))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


_DIVERGED = (
    "a run that diverged shows nothing about parity (a NaN fails no '>' check, so a "
    "comparison that did not look for it would pass it). Find the step where it first "
    "diverges: a lower learning rate, or a dtype whose range holds the update (AdamW's "
    "eps=1e-8 is 0 in float16)."
)


def worst_of(differences: Iterable[float]) -> float:
    """The largest of `differences`, refusing one that is not finite.

    Python's `max` keeps its first value against a NaN (every comparison with NaN is
    False), so a trajectory that went NaN after its first step reads as a difference of 0.
    Raises `ParityError` on a NaN or an infinity instead.
    """
    values = list(differences)
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ParityError(
            f"{len(bad)} of {len(values)} differences are not finite (first: {bad[0]}): "
            + _DIVERGED
        )
    return max(values, default=0.0)


@dataclass(frozen=True)
class ParityReport:
    max_loss_rel: float
    max_param_rel: float
    worst_param: str

    def __str__(self) -> str:
        return (
            f"max loss rel diff {self.max_loss_rel:.2e}, max parameter rel diff "
            f"{self.max_param_rel:.2e} ({self.worst_param})"
        )


def compare_trajectories(
    reference: Trajectory,
    candidate: Trajectory,
    *,
    rtol: float = 1e-5,
    label: str = "candidate",
    check_params: bool = True,
) -> ParityReport:
    """Raise `ParityError` unless every loss and (optionally) final parameter matches.

    Relative difference: |a-b|/|b| for losses, ||a-b||/||b|| per parameter tensor.
    """
    if len(reference.losses) != len(candidate.losses):
        raise ParityError(
            f"{label}: {len(candidate.losses)} steps, reference has {len(reference.losses)}"
        )
    pairs = list(zip(candidate.losses, reference.losses, strict=True))
    for step, (a, b) in enumerate(pairs):
        if not (math.isfinite(a) and math.isfinite(b)):
            raise ParityError(
                f"{label}: loss at step {step} is not finite: {a} vs reference {b}; " + _DIVERGED
            )
    loss_rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in pairs]
    for step, r in enumerate(loss_rel):
        if r > rtol:
            raise ParityError(
                f"{label}: loss diverges at step {step}: {candidate.losses[step]:.8f} vs "
                f"reference {reference.losses[step]:.8f} (rel {r:.2e} > rtol {rtol:.0e})"
            )
    worst, worst_rel = "", 0.0
    if check_params:
        if set(reference.params) != set(candidate.params):
            missing = sorted(set(reference.params) - set(candidate.params))
            extra = sorted(set(candidate.params) - set(reference.params))
            raise ParityError(f"{label}: parameter names differ: missing {missing}, extra {extra}")
        for name, ref in reference.params.items():
            got = candidate.params[name]
            if got.shape != ref.shape:
                raise ParityError(f"{label}: {name} shape {tuple(got.shape)} != {tuple(ref.shape)}")
            for side, tensor in (("candidate", got), ("reference", ref)):
                if not bool(torch.isfinite(tensor).all()):
                    raise ParityError(
                        f"{label}: final parameter {name!r} of the {side} is not finite; "
                        + _DIVERGED
                    )
            r = _rel(got, ref)
            if r > worst_rel:
                worst, worst_rel = name, r
        if worst_rel > rtol:
            raise ParityError(
                f"{label}: final parameter {worst!r} differs from reference (rel {worst_rel:.2e} "
                f"> rtol {rtol:.0e})"
            )
    return ParityReport(max(loss_rel, default=0.0), worst_rel, worst)
