"""A NaN or inf in training: found on any rank, acted on by every rank at the same step.

Owns: `NonFiniteError`, the report naming which rank saw which non-finite value (a
collective, run only after the update's all-reduce said some rank was non-finite), the
stop-or-skip verdict with its message, and the debug list of trainable parameters that
received no gradient.

Must not: step the optimizer or touch gradients (engine.py does).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallelize.wrapped import unwrap


class NonFiniteError(FloatingPointError):
    """A loss or the gradient norm was NaN/inf (TrainConfig.on_nonfinite='stop'); raised on
    every rank at the same step."""


def nonfinite_report(bad: list[str], keys: list[str], device: torch.device) -> str:
    """'rank 1: loss, loss_cls; rank 3: grad_norm' (a collective: every rank calls it,
    and only after the reduce said some rank was non-finite). Each rank sends one
    flag per name of `keys` (the window's keys, the same list on every rank)."""
    names = ["grad_norm", *keys]
    mine = torch.tensor([float(n in bad) for n in names], device=device)
    rows = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
    found = []
    for rank, row in enumerate(rows):
        named = [n for n, flag in zip(names, row.tolist(), strict=True) if flag]
        if named:
            found.append(f"rank {rank}: {', '.join(named)}")
    return "; ".join(found)


def stop_or_warn(step: int, ranks: int, where: str, on_nonfinite: str) -> None:
    """Raise `NonFiniteError` ('stop'), or warn once on rank 0 that the update was
    skipped ('skip')."""
    what = (
        f"Engine: non-finite loss or gradient norm at optimizer step {step} on "
        f"{ranks} rank(s) ({where})."
    )
    if on_nonfinite == "stop":
        raise NonFiniteError(
            f"{what} Training stopped on every rank (TrainConfig.on_nonfinite='stop'). "
            "Lower the learning rate, clip gradients (TrainConfig.max_grad_norm), check "
            "the data of that step, or set on_nonfinite='skip' to drop such updates."
        )
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(
            f"{what} The update was skipped on every rank (TrainConfig.on_nonfinite="
            "'skip'); parameters and optimizer state are unchanged.",
            stacklevel=5,
        )


def anomalous_params(model: nn.Module) -> list[str]:
    """Trainable parameters without a gradient after backward (warned on rank 0)."""
    missing = [
        name for name, p in unwrap(model).named_parameters() if p.requires_grad and p.grad is None
    ]
    if missing and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(
            f"Engine: {len(missing)} trainable parameter(s) received no gradient this "
            f"step: {missing[:20]}{' ...' if len(missing) > 20 else ''}. They are unused "
            "in forward or detached from the loss.",
            stacklevel=4,
        )
    return missing
